"""The serving engine's decode step against `rocketkv.generate`'s, side by side in one run.

    python3 benchmarks/engine_step.py --model smollm2 --slots 4 --prompt-len 2048 \\
        --new 64 --budget 256 --out runs/engine_step

Both decode the same `--slots` prompts of `--prompt-len` tokens with the same plan (generate's
`pad_to` = the engine's plan prompt length), greedy, no EOS. `generate` runs its whole decode as
one on-device loop; the engine runs one compiled call of `--steps-per-call` steps per host
round trip with every slot busy. With `--page-size P` a paged engine (`EngineConfig.page_size`,
the same plan and slots) runs beside them. Reported per method: ms per decode step of each
(median over `--repeats` alternating runs) and their ratios to generate's, also of the fastest
runs (on a shared machine noise only adds time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import bench_common
import rocketkv_jax as rocketkv
from rocketkv_jax.runtime.engine import Engine, EngineConfig, SamplingParams


def _configs(budget: int) -> dict:
  return {"full": rocketkv.RocketConfig(token_budget=budget, method="full"),
          "rocketkv": rocketkv.RocketConfig(token_budget=budget),
          "recommended": rocketkv.RocketConfig.recommended(budget)}


def _engine_ms(eng: Engine, prompts, new: int) -> float:
  """ms per decode step with every slot busy (the admissions are not timed)."""
  params = SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True)
  handles = [eng.add_request(p, params) for p in prompts]
  while eng.stats().num_waiting:  # admit every prompt (prefills), then time the decode calls
    eng.step()
  steps, t0 = 0, time.perf_counter()
  while eng.stats().num_running == len(prompts) and steps + eng.config.steps_per_call <= new:
    eng._decode()  # pylint: disable=protected-access  (one decode call, no admission)
    steps += eng.config.steps_per_call
  ms = 1e3 * (time.perf_counter() - t0) / steps
  for h in handles:
    h.cancel()
  eng.step()
  return ms


def _admit_seconds(model, rc, a) -> dict[int, float]:
  """Seconds one admission (prefill into a slot) of each --prefill-lengths prompt takes: the
  time every running request waits for it (the best of two, after a compiling one)."""
  lengths = [int(x) for x in a.prefill_lengths.split(",")]
  eng = Engine(model, EngineConfig(rc, max_model_len=max(lengths) + a.new + 2,
                                   max_new_tokens=a.new + 1, max_num_seqs=2))
  tok = model.tokenizer
  out = {}
  for n in lengths:
    ids = bench_common.niah_prompt_ids(tok, n)[:n]
    times = []
    for _ in range(3):
      h = eng.add_request(ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
      t0 = time.perf_counter()
      eng._admit(eng._waiting.popleft(), 0)  # pylint: disable=protected-access
      times.append(time.perf_counter() - t0)
      h.cancel()
      eng.step()
    out[n] = min(times[1:])
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2", help="smollm2, gemma3, an HF dir or a .gguf")
  ap.add_argument("--slots", type=int, default=4)
  ap.add_argument("--prompt-len", type=int, default=2048)
  ap.add_argument("--new", type=int, default=64, help="decode steps timed")
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--steps-per-call", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--methods", default="full,rocketkv,recommended")
  ap.add_argument("--prefill-lengths", default="",
                  help="comma-separated prompt lengths: also time one admission (prefill) of "
                       "each, the longest stall of the running requests it causes")
  ap.add_argument("--page-size", type=int, default=None,
                  help="also time an engine with a paged pool of pages of this many tokens")
  ap.add_argument("--out", default="runs/engine_step")
  a = ap.parse_args(argv)
  path = bench_common.resolve_model(a.model)
  if path is None:
    return 2
  configs = _configs(a.budget)
  names = a.methods.split(",")
  bad = [n for n in names if n not in configs]
  if bad or min(a.slots, a.prompt_len, a.new, a.repeats, a.steps_per_call,
                a.page_size or 1) < 1:
    print(f"error: --methods must be among {list(configs)} and sizes >= 1", file=sys.stderr)
    return 2
  model = rocketkv.models.load(path)
  tok = model.tokenizer
  prompts = [bench_common.niah_prompt_ids(tok, a.prompt_len, index=i)[:a.prompt_len]
             for i in range(a.slots)]
  rows = []
  for name in names:
    rc = configs[name]
    cfg = dict(max_model_len=a.prompt_len + 2 * a.new + 2, max_new_tokens=a.new + 1,
               max_num_seqs=a.slots, steps_per_call=a.steps_per_call)
    eng = Engine(model, EngineConfig(rc, **cfg))
    paged = Engine(model, EngineConfig(rc, page_size=a.page_size, **cfg)) if a.page_size else None
    eng_ms, paged_ms, gen_ms = [], [], []
    for r in range(a.repeats + 1):  # the first round compiles them; not reported
      e = _engine_ms(eng, prompts, a.new)
      pg = _engine_ms(paged, prompts, a.new) if paged else None
      res = rocketkv.generate(model, prompts, rocket_config=rc, max_new_tokens=a.new + 1,
                              pad_to=eng.plan.prompt_len, eos_token_ids=())
      g = res.stats["decode_ms_per_token"]
      if r:
        eng_ms.append(e)
        paged_ms.append(pg)
        gen_ms.append(g)
    row = dict(method=name, slots=a.slots, prompt_len=a.prompt_len, budget=a.budget,
               steps_per_call=a.steps_per_call, engine_ms=statistics.median(eng_ms),
               generate_ms=statistics.median(gen_ms), engine_runs=eng_ms, generate_runs=gen_ms)
    row["ratio"] = row["engine_ms"] / row["generate_ms"]
    # The ratio of the fastest runs too: on a shared machine noise only adds time.
    row["ratio_min"] = min(eng_ms) / min(gen_ms)
    if paged:
      row.update(page_size=paged.page_size, paged_ms=statistics.median(paged_ms),
                 paged_runs=paged_ms)
      row["paged_ratio"] = row["paged_ms"] / row["generate_ms"]
      row["paged_ratio_min"] = min(paged_ms) / min(gen_ms)
    row["admit_s"] = _admit_seconds(model, rc, a) if a.prefill_lengths else {}
    rows.append(row)
    pg = (f"  paged (P={row['page_size']}) {row['paged_ms']:8.2f} ms/step  ratio "
          f"{row['paged_ratio']:.3f} (fastest runs {row['paged_ratio_min']:.3f})" if paged else "")
    print(f"{name:12s} engine {row['engine_ms']:8.2f} ms/step  generate "
          f"{row['generate_ms']:8.2f} ms/step  ratio {row['ratio']:.3f} (fastest runs "
          f"{row['ratio_min']:.3f}){pg}  admit (prefill) s "
          f"{row['admit_s']}", flush=True)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "engine_step.json"), "w") as f:
    json.dump(dict(command=" ".join(sys.argv), model=a.model, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
