"""The serving engine's one budget split against `generate`'s per-length split, on eval tasks.

    python3 benchmarks/engine_accuracy.py --model smollm2 --tasks niah_single vt cwe \\
        --length 4096 --samples 20 --budget 256 --methods rocketkv recommended \\
        --out runs/engine_accuracy

Each sample's prompt is decoded greedily per method twice: by `rocketkv.generate` planned as
the eval harness plans it (`pad_to` = the sample's padded length, the task's new tokens), and
by an `Engine` planned once for prompts of `max_model_len - max_new_tokens` tokens (default:
the model's context, less `--engine-new-tokens` 1024), as `python -m rocketkv_jax.serve`
runs it. Both are scored with the harness's metric (`tasks.score`); per (task, method) the
mean of each, the paired difference (engine - generate) with a 95% bootstrap interval, and the
samples whose answers differ. Full KV through `generate` is the reference row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import rocketkv_jax as rocketkv
from rocketkv_jax import models
from rocketkv_jax.eval import stats, tasks
from rocketkv_jax.eval.variants import rocket_config  # a method spec, `recommended` too
from rocketkv_jax.runtime.engine import Engine, EngineConfig, SamplingParams


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2", help="smollm2, gemma3, an HF dir or a .gguf")
  ap.add_argument("--tasks", nargs="+", default=["niah_single", "vt", "cwe"])
  ap.add_argument("--length", type=int, default=4096)
  ap.add_argument("--samples", type=int, default=20)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--methods", nargs="+", default=["rocketkv", "recommended"])
  ap.add_argument("--engine-new-tokens", type=int, default=1024,
                  help="the engine's planned new tokens (serve --max-new-tokens)")
  ap.add_argument("--engine-max-model-len", type=int, default=None,
                  help="the engine's max_model_len (default: the model's context)")
  ap.add_argument("--slots", type=int, default=4)
  ap.add_argument("--reuse-generate", default=None,
                  help="an earlier run's engine_accuracy.json (same model, tasks, length, "
                       "samples, seed, budget): its generate answers instead of running them")
  ap.add_argument("--out", default="runs/engine_accuracy")
  a = ap.parse_args(argv)
  try:
    path = models.resolve(a.model)
    bad = [t for t in a.tasks if t not in tasks.TASKS]
    if bad:
      raise ValueError(f"--tasks must be among {list(tasks.TASKS)}, got {bad}")
    for m in a.methods:
      rocket_config(m, a.budget)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  reuse = None
  if a.reuse_generate:
    with open(a.reuse_generate) as f:
      reuse = json.load(f)
    same = all(reuse.get(k) == getattr(a, k) for k in ("model", "length", "samples", "budget"))
    if not same:
      print("error: --reuse-generate: a run of another model, length, samples or budget",
            file=sys.stderr)
      return 2
  model = models.load(path)
  ctx = model.config.max_position_embeddings
  tok = tasks.formatted(model.tokenizer, "chat" if model.tokenizer.chat_template
                        else "completion")
  max_len = a.engine_max_model_len or ctx
  engines = {m: Engine(model, EngineConfig(rocket_config(m, a.budget), max_model_len=max_len,
                                           max_new_tokens=a.engine_new_tokens,
                                           max_num_seqs=a.slots))
             for m in a.methods}
  rows, records = [], []
  def write():
    """The JSON and the table of the rows so far (an interrupted run keeps them)."""
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "engine_accuracy.json"), "w") as f:
      json.dump(dict(command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                     model=a.model, length=a.length, samples=a.samples, budget=a.budget,
                     engine_max_model_len=max_len, engine_new_tokens=a.engine_new_tokens,
                     rows=rows, records=records), f, indent=1)
    with open(os.path.join(a.out, "engine_accuracy.md"), "w") as f:
      f.write("| task | method | generate | engine | engine - generate [95% CI] | answers "
              "differing |\n|---|---|---|---|---|---|\n")
      for r in rows:
        if r["method"] == "full":
          f.write(f"| {r['task']} | full | {r['generate']:.2f} | | | |\n")
        else:
          f.write(f"| {r['task']} | {r['method']} | {r['generate']:.2f} | {r['engine']:.2f} | "
                  f"{r['diff']:+.2f} [{r['diff_lo']:+.2f}, {r['diff_hi']:+.2f}] | "
                  f"{r['differing_answers']} / {a.samples} |\n")

  for task in a.tasks:
    new = tasks.MAX_NEW_TOKENS[task]
    padded = min(a.length, ctx - new)
    samples = [tasks.make_sample(tok, task, a.length, i, a.seed, target_tokens=padded)
               for i in range(a.samples)]
    ids = [tasks.prompt_ids(tok, s) for s in samples]

    def scored(texts):
      return np.array([tasks.score(s.metric, t, s.answers) for s, t in zip(samples, texts)])

    def by_generate(rc, method):
      if reuse is not None:
        got = {r["index"]: r["generate"] for r in reuse["records"]
               if r["task"] == task and r["method"] == method}
        if len(got) == len(samples):
          return [got[s.index] for s in samples]
      texts = []
      for i in range(0, len(ids), a.slots):
        texts += rocketkv.generate(model, ids[i:i + a.slots], rocket_config=rc,
                                   max_new_tokens=new, pad_to=padded).text
      return texts

    prior = [r for r in (reuse or {}).get("rows", []) if r["task"] == task
             and r["method"] == "full"]
    full = prior[0]["generate"] if prior else float(scored(by_generate(
        rocketkv.RocketConfig(token_budget=a.budget, method="full"), "full")).mean())
    rows.append(dict(task=task, method="full", generate=full))
    print(json.dumps(rows[-1]), flush=True)
    write()
    for m in a.methods:
      gen_texts = by_generate(rocket_config(m, a.budget), m)
      eng_texts = [o.text for o in engines[m].generate(
          ids, SamplingParams(max_tokens=new, temperature=0.0))]
      g, e = scored(gen_texts), scored(eng_texts)
      diff, lo, hi = stats.paired_bootstrap_diff(e, g)
      plan = engines[m].plan
      rows.append(dict(task=task, method=m, generate=float(g.mean()), engine=float(e.mean()),
                       diff=diff, diff_lo=lo, diff_hi=hi,
                       differing_answers=int(sum(x != y for x, y in zip(gen_texts, eng_texts))),
                       engine_plan=dict(prompt_len=plan.prompt_len,
                                        prompt_budget=plan.prompt_budget,
                                        capacity=plan.capacity, top_k=plan.top_k,
                                        chunk_size=plan.chunk_size, r=plan.r)))
      records += [dict(task=task, method=m, index=s.index, generate=gt, engine=et)
                  for s, gt, et in zip(samples, gen_texts, eng_texts)]
      print(json.dumps(rows[-1]), flush=True)
      write()
  write()
  print(open(os.path.join(a.out, "engine_accuracy.md")).read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
