"""Cross-check: our harness vs lm-evaluation-harness (through the "rocketkv" backend), sample by
sample, on the same exported synthetic samples.

    python examples/lm_eval_crosscheck.py --task niah_single --lengths 2048 4096 --samples 20 \\
        --budget 256 --batch-size 5 --out results/lm_eval_crosscheck

For each length: `rocketkv_jax.eval.lm_eval export` writes the samples as an lm-eval task; lm-eval's
`simple_evaluate` runs it with the backend for method=full and method=rocketkv (greedy, stop at
EOS, the task's max_gen_toks); our harness (`harness.run_sweep`) runs the same (seed, samples)
with the same methods and batch size. Writes <out>/crosscheck.json (every prediction of both)
and <out>/crosscheck.md (per-sample agreement table).

--plan harness (default) gives the backend `pad_to=` the harness's padded prompt length, so
both plan the budget split for the same length (the harness plans for the task's nominal
length, not for each batch's longest prompt); --plan batch leaves the backend's default (each
batch planned for its longest context), which can keep a token or so fewer per head.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--task", default="niah_single")
  p.add_argument("--lengths", type=int, nargs="+", default=[2048])
  p.add_argument("--samples", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--budget", type=int, default=256)
  p.add_argument("--batch-size", type=int, default=5)
  p.add_argument("--plan", choices=("harness", "batch"), default="harness")
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)

  import lm_eval
  from lm_eval.tasks import TaskManager

  from rocketkv_jax import models
  from rocketkv_jax.eval import lm_eval as backend
  from rocketkv_jax.eval import harness, lm_eval_export

  model = models.load(models.smollm2_path())
  os.makedirs(args.out, exist_ok=True)
  configs = [("full", None), ("rocketkv", args.budget)]
  rows, timing = [], {}
  for length in args.lengths:
    task_dir = tempfile.mkdtemp(prefix="rocketkv_lm_eval_")
    (name,) = lm_eval_export.export(model, task_dir, [args.task], [length], args.samples,
                                    args.seed)
    tm = TaskManager(include_path=task_dir, include_defaults=False)
    theirs = {}
    max_new = harness.max_new_tokens_for(harness.SweepConfig(), args.task)
    pad_to = harness.padded_len(model, length, max_new) if args.plan == "harness" else None
    for method, budget in configs:
      lm = backend.RocketKVLM(pretrained=model, method=method, token_budget=budget or 256,
                              batch_size=args.batch_size, pad_to=pad_to)
      t0 = time.perf_counter()
      out = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=tm, log_samples=True)
      timing[f"lm_eval/{method}/{length}"] = time.perf_counter() - t0
      for s in out["samples"][name]:
        theirs[(method, s["doc"]["index"])] = (s["resps"][0][0], s["score"])
    cfg = harness.SweepConfig(tasks=(args.task,), context_lengths=(length,),
                              methods=("full", "rocketkv"), budgets=(args.budget,),
                              samples=args.samples, seed=args.seed, batch_size=args.batch_size,
                              gold_score=False)
    t0 = time.perf_counter()
    ours = harness.run_sweep(model, cfg, progress=False)
    timing[f"harness/{length}"] = time.perf_counter() - t0
    for r in ours["records"]:
      pred, score = theirs[(r["method"], r["index"])]
      rows.append(dict(length=length, index=r["index"], method=r["method"], budget=r["budget"],
                       answer=r["answers"][0], harness=r["prediction"], lm_eval=pred,
                       harness_score=r["score"], lm_eval_score=score,
                       same_text=r["prediction"] == pred))
  with open(os.path.join(args.out, "crosscheck.json"), "w") as f:
    json.dump(dict(args=vars(args), rows=rows, timing_s=timing), f, indent=1)
  lines = [f"Plan: {args.plan} (see the script's docstring).", "",
           "| length | method | samples | same text | harness score | lm-eval score |",
           "|---|---|---|---|---|---|"]
  for length in args.lengths:
    for method, budget in configs:
      rs = [r for r in rows if r["length"] == length and r["method"] == method]
      lines.append(f"| {length} | {method}{'@' + str(budget) if budget else ''} | {len(rs)} | "
                   f"{sum(r['same_text'] for r in rs)} | "
                   f"{100 * sum(r['harness_score'] for r in rs) / len(rs):.0f} | "
                   f"{100 * sum(r['lm_eval_score'] for r in rs) / len(rs):.0f} |")
  diff = [r for r in rows if not r["same_text"]]
  lines += ["", f"Samples whose outputs differ: {len(diff)}"]
  for r in diff:
    lines.append(f"- {r['length']} {r['method']} #{r['index']} (answer {r['answer']}): harness "
                 f"{r['harness']!r} ({r['harness_score']:.0f}) vs lm-eval {r['lm_eval']!r} "
                 f"({r['lm_eval_score']:.0f})")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(args.out, "crosscheck.md"), "w") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
