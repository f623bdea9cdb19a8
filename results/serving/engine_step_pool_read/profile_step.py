"""Where the engine's decode step spends its device time, slots against pages.

    python3 results/serving/engine_step_pool_read/profile_step.py --method full \
        --out runs/profile_step

SmolLM2, 4 slots busy with 1024-token prompts, one step per call: 8 decode calls of each engine
under `jax.profiler`, the XLA:CPU thunks grouped by kind (numbered suffixes dropped), ms per step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

import jax

sys.path.insert(0, "benchmarks")
import bench_common  # noqa: E402
import rocketkv_jax as rocketkv  # noqa: E402
from rocketkv_jax.runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

STEPS = 8


def profile(model, prompts, rc, page_size, out):
  eng = Engine(model, EngineConfig(rc, max_model_len=1024 + 34, max_new_tokens=17,
                                   max_num_seqs=len(prompts), page_size=page_size))
  params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
  for p in prompts:
    eng.add_request(p, params)
  while eng.stats().num_waiting:
    eng.step()
  for _ in range(3):  # compiled and warm
    eng._decode()  # pylint: disable=protected-access
  d = os.path.join(out, f"trace_{rc.method}_{page_size or 0}")
  t0 = time.perf_counter()
  with jax.profiler.trace(d):
    for _ in range(STEPS):
      eng._decode()  # pylint: disable=protected-access
  wall = (time.perf_counter() - t0) / STEPS * 1e3
  events = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))
  kinds = collections.defaultdict(float)
  for e in events["traceEvents"]:
    if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("$"):
      kinds[re.sub(r"\.\d+", "", re.sub(r"[._]?\d+(\.clone)?$", "", e["name"]))] += e["dur"]
  return wall, {k: v / STEPS / 1e3 for k, v in kinds.items()}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--method", choices=("full", "recommended"), default="full")
  ap.add_argument("--out", default="runs/profile_step")
  a = ap.parse_args()
  model = rocketkv.models.load(bench_common.resolve_model("smollm2"))
  prompts = [bench_common.niah_prompt_ids(model.tokenizer, 1024, index=i)[:1024]
             for i in range(4)]
  rc = (rocketkv.RocketConfig.recommended(256) if a.method == "recommended" else
        rocketkv.RocketConfig(token_budget=256, method="full"))
  res = {name: profile(model, prompts, rc, ps, a.out) for name, ps in (("slots", None),
                                                                        ("pages", 128))}
  names = sorted(set(res["slots"][1]) | set(res["pages"][1]),
                 key=lambda k: -max(res["slots"][1].get(k, 0), res["pages"][1].get(k, 0)))
  lines = ["| thunk kind | slots ms/step | pages ms/step |", "|---|---|---|"]
  lines += [f"| {k} | {res['slots'][1].get(k, 0):.2f} | {res['pages'][1].get(k, 0):.2f} |"
            for k in names[:20]]
  lines.append(f"| (wall ms/step under the profiler) | {res['slots'][0]:.1f} | "
               f"{res['pages'][0]:.1f} |")
  text = "\n".join(lines)
  print(text)
  with open(os.path.join(a.out, f"profile_step_{a.method}.md"), "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
