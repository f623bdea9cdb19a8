"""Greedy tokens of every method and stage-2 variant on SmolLM2 (one prompt): a refactor check.

Run it before and after a change that must not change behaviour, and diff the two JSON files:

    python benchmarks/token_check.py --out /tmp/before.json     # on the old commit
    python benchmarks/token_check.py --out /tmp/after.json      # on the new one
    diff /tmp/before.json /tmp/after.json && echo identical

Methods are given as `examples/evaluate.py` specs (rocketkv_jax/eval/variants.py), the stable
interface across refactors of `RocketConfig`.
"""

from __future__ import annotations

import argparse
import json
import time

import rocketkv_jax as rocketkv
from rocketkv_jax.eval import tasks, variants

SPECS = (
    "full", "exact_topk", "snapkv", "quest", "sparq", "streamingllm", "rocketkv", "rocketkv_mt",
    "rocketkv:stage2=rerank", "rocketkv:stage2=lowrank", "rocketkv:stage2=quant",
    "rocketkv:stage2=quant,quant_capacity=equal_read,window_reduce=max",
    "rocketkv:skip_layers=2",
)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--task", default="niah_multikey", help="an eval task (rocketkv_jax/eval/tasks.py)")
  ap.add_argument("--length", type=int, default=2048, help="prompt length in tokens")
  ap.add_argument("--budget", type=int, default=64)
  ap.add_argument("--new", type=int, default=16, help="greedy tokens per method")
  ap.add_argument("--specs", nargs="*", default=list(SPECS))
  ap.add_argument("--out", required=True, help="JSON file: {spec: tokens}")
  args = ap.parse_args()
  model = rocketkv.models.load(rocketkv.models.smollm2_path())
  sample = tasks.make_sample(model.tokenizer, args.task, args.length, 0)
  prompt = tasks.prompt_ids(model.tokenizer, sample)
  out = {}
  for spec in args.specs:
    t0 = time.time()
    cfg = variants.rocket_config(spec, args.budget)
    res = rocketkv.generate(model, [prompt], method=cfg.method, token_budget=args.budget,
                            rocket_config=cfg, max_new_tokens=args.new)
    out[spec] = [int(t) for t in res.tokens[0]]
    print(f"{spec}: {out[spec]} ({time.time() - t0:.1f} s)", flush=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
