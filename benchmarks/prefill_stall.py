"""How long a long prompt's admission stalls the running requests: groups = 1 against layer
groups (`EngineConfig.prefill_layer_groups`), side by side in one run.

    python3 benchmarks/prefill_stall.py --model smollm2 --prompt-tokens 4096 --groups 1,8 \\
        --out runs/prefill_stall

Per setting: `--running` requests with short prompts decode (one step per call); then a
`--prompt-tokens` prompt arrives and is admitted (prefill in one call, or in G layer-group
calls with a decode call between two). Reported: the longest gap between two consecutive decode
calls' ends while it is admitted (the stall the running requests see), the median gap before it
arrived (one decode step), the decode calls the running requests got during its admission, its
prefill seconds and the seconds the used programs took to compile. Each setting runs twice, the
first pass compiling its programs (not reported); the machine's load is not controlled. With
`--warmup-only`, instead: the seconds `Engine.warmup()` takes (every program a server compiles
before it listens) per group count, with the server's defaults (max_model_len 4096, pages of
128 tokens, 8 slots).
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


def _scenario(eng: Engine, running, long_prompt, steps_before: int, steps_after: int) -> dict:
  """Decode-call end times around one long admission; the engine is left empty."""
  ends = []
  decode = eng._decode  # pylint: disable=protected-access

  def timed():
    decode()
    ends.append(time.perf_counter())

  eng._decode = timed  # pylint: disable=protected-access
  try:
    many = SamplingParams(max_tokens=eng.plan.max_new_tokens, temperature=0.0, ignore_eos=True)
    handles = [eng.add_request(p, many) for p in running]
    while eng.stats().num_running < len(running):
      eng.step()
    for _ in range(steps_before):
      eng.step()
    before = len(ends)
    prefill0 = eng.stats().prefill_seconds_total
    h = eng.add_request(long_prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                    ignore_eos=True))
    arrive = time.perf_counter()
    while eng.stats().num_waiting or eng.stats().num_prefilling:  # until it joins the batch
      eng.step()
    joined = len(ends)
    for _ in range(steps_after):
      eng.step()
    stats = eng.stats()
    for x in handles + [h]:
      x.cancel()
    while eng.has_work():
      eng.step()
  finally:
    eng._decode = decode  # pylint: disable=protected-access
  gaps = [b - a for a, b in zip([arrive] + ends[before:joined], ends[before:joined + 1])]
  return dict(longest_stall_s=max(gaps), decode_step_s=statistics.median(
      b - a for a, b in zip(ends[:before - 1], ends[1:before])),
              decode_calls_during_admission=joined - before,
              prefill_s=stats.prefill_seconds_total - prefill0)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2", help="smollm2, gemma3, an HF dir or a .gguf")
  ap.add_argument("--method", default="recommended", help="recommended or a KV method")
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--prompt-tokens", type=int, default=4096, help="the long prompt's tokens")
  ap.add_argument("--running", type=int, default=2, help="requests decoding meanwhile")
  ap.add_argument("--running-tokens", type=int, default=256, help="their prompts' tokens")
  ap.add_argument("--groups", default="1,8", help="comma-separated prefill_layer_groups")
  ap.add_argument("--page-size", type=int, default=128, help="0: slots, no pages")
  ap.add_argument("--warmup-only", action="store_true",
                  help="time Engine.warmup() per group count at the server's defaults instead")
  ap.add_argument("--out", default="runs/prefill_stall")
  a = ap.parse_args(argv)
  path = bench_common.resolve_model(a.model)
  if path is None:
    return 2
  groups = [int(g) for g in a.groups.split(",")]
  model = rocketkv.models.load(path)
  rc = (rocketkv.RocketConfig.recommended(a.budget) if a.method == "recommended" else
        rocketkv.RocketConfig(token_budget=a.budget, method=a.method))
  if a.warmup_only:
    rows = []
    for g in groups:
      eng = Engine(model, EngineConfig(
          rc, max_model_len=min(4096, model.config.max_position_embeddings), max_new_tokens=256,
          max_num_seqs=8, page_size=128, prefill_layer_groups=g))
      rows.append(dict(groups=g, warmup_s=eng.warmup(), programs=eng.num_programs,
                       buckets=eng.buckets))
      print(f"groups {g:3d}: warmup {rows[-1]['warmup_s']:6.1f} s, {eng.num_programs} programs "
            f"({len(eng.buckets)} buckets)", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "warmup.json"), "w") as f:
      json.dump(dict(command=" ".join(["python3"] + sys.argv), model=a.model, rows=rows), f,
                indent=1)
    return 0
  tok = model.tokenizer
  long_prompt = bench_common.niah_prompt_ids(tok, a.prompt_tokens)[:a.prompt_tokens]
  running = [bench_common.niah_prompt_ids(tok, max(1024, a.running_tokens),
                                         index=i + 1)[:a.running_tokens]
             for i in range(a.running)]
  new = 256
  engines = {g: Engine(model, EngineConfig(
      rc, max_model_len=len(long_prompt) + new, max_new_tokens=new, max_num_seqs=a.running + 1,
      prefill_layer_groups=g, page_size=a.page_size or None,
      min_bucket=max(64, 1 << (a.running_tokens - 1).bit_length()))) for g in groups}
  rows = []
  for g, eng in engines.items():  # compile pass: the programs the scenario uses
    _scenario(eng, running, long_prompt, 2, 2)
    rows.append(dict(groups=g, layer_bounds=eng.layer_bounds,
                     compile_s=eng._counters["compile_s"],  # pylint: disable=protected-access
                     programs=eng.num_programs))
  for row, (g, eng) in zip(rows, engines.items()):
    row.update(_scenario(eng, running, long_prompt, 8, 4))
    print(f"groups {g:3d}: longest stall {row['longest_stall_s']:7.2f} s  decode step "
          f"{row['decode_step_s'] * 1e3:7.1f} ms  decode calls during admission "
          f"{row['decode_calls_during_admission']:3d}  prefill {row['prefill_s']:6.2f} s  "
          f"compile {row['compile_s']:6.1f} s ({row['programs']} programs)", flush=True)
  base = rows[0]["longest_stall_s"]
  for row in rows[1:]:
    print(f"stall ratio groups {rows[0]['groups']} / {row['groups']}: "
          f"{base / row['longest_stall_s']:.2f}")
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "prefill_stall.json"), "w") as f:
    json.dump(dict(command=" ".join(["python3"] + sys.argv), model=a.model, method=a.method,
                   budget=a.budget, prompt_tokens=len(long_prompt), rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
