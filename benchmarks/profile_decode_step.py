"""Per-op profile of one jitted, donated `rocketkv.decode_step` (XLA:CPU thunks).

Runs the step of `benchmarks/decode_attention.py` (Llama-3.1-8B attention shapes) under
`jax.profiler` with XLA:CPU's per-thunk trace events on and prints the mean microseconds per
step of the most expensive ops. That is how the README's "what is left" list was made.

    python benchmarks/profile_decode_step.py --dtype bfloat16 --context 32768 --budget 256
    python benchmarks/profile_decode_step.py --stage2 quant      # a stage-2 variant's step

The trace events exist only with --xla_cpu_enable_xprof_traceme=true, which this script adds to
XLA_FLAGS before importing jax. Profiling adds its own overhead: compare ops with each other,
not with the benchmark's wall times.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import rocketkv_jax as rocketkv  # noqa: E402
from rocketkv_jax.stage2_state import attach  # noqa: E402

HQ, HKV, D = 32, 8, 128
_SKIP = ("Thunk", "Pjit", "PjRt", "$")  # runtime / Python frames, not ops


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--context", type=int, default=32768)
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--stage2", default="minmax", choices=list(rocketkv.STAGE2),
                  help="RocketConfig.stage2: the stage-2 variant whose step is profiled")
  ap.add_argument("--steps", type=int, default=50, help="profiled steps (< 95)")
  ap.add_argument("--top", type=int, default=25)
  a = ap.parse_args()
  dt = jnp.dtype(a.dtype)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=a.budget, stage2=a.stage2),
                       a.context - 100, 100, D)
  k = jax.random.normal(jax.random.PRNGKey(0), (1, HKV, plan.prompt_budget, D), dt)
  cache = attach(rocketkv.full_cache(k, k, plan.capacity, plan.chunk_size), plan)
  q = jax.random.normal(jax.random.PRNGKey(1), (1, HQ, D), dt)
  kn = jnp.ones((1, HKV, 1, D), dt)
  step = jax.jit(lambda q, kn, vn, c: rocketkv.decode_step(q, kn, vn, c, plan),
                 donate_argnums=3)
  for _ in range(5):  # compile and warm up (the plan leaves 100 free slots)
    _, cache = step(q, kn, kn, cache)
  jax.block_until_ready(cache)
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(a.steps):
        _, cache = step(q, kn, kn, cache)
      jax.block_until_ready(cache)
    path = sorted(glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True))[-1]
    events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and not any(s in e["name"] for s in _SKIP):
      total[e["name"]] += e.get("dur", 0)
  print(f"{a.dtype} context {a.context} budget {a.budget} stage2 {a.stage2}: mean us per step "
        f"over {a.steps} steps")
  shown = 0.0
  for name, t in total.most_common(a.top):
    print(f"{t / a.steps:9.1f}  {name}")
    shown += t / a.steps
  print(f"{shown:9.1f}  (sum of the {a.top} above; all ops: "
        f"{sum(total.values()) / a.steps:.1f})")


if __name__ == "__main__":
  main()
