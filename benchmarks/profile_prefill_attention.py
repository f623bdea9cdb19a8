"""Per-op profile of one layer's blockwise causal prefill attention (XLA:CPU thunks).

SmolLM2-135M attention shapes by default (9 query / 3 KV heads of 64 dims, fp32). Prints the
wall time of the jitted call, its rate in GFLOP/s of causal attention, and the mean
milliseconds per call of the most expensive ops with their output shapes, e.g. which of them
are the two products of a tile (`[.., bs, bs]` and `[.., bs, Dh]` outputs) and which are the
softmax's exp / row sum / row max. That is where the notes in `models/attention.py` come from.

    python benchmarks/profile_prefill_attention.py --length 8000 --block-size 512

The trace events exist only with --xla_cpu_enable_xprof_traceme=true, which this script adds to
XLA_FLAGS before importing jax.
"""

from __future__ import annotations

import argparse
import collections
import os
import re

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402

from rocketkv_jax.models.attention import blockwise_causal_attention  # noqa: E402

import bench_common  # noqa: E402

_SKIP = ("Thunk", "Pjit", "PjRt", "$")


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--length", type=int, default=8000)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--block-size", type=int, default=512)
  ap.add_argument("--heads", default="9,3", help="query heads, KV heads")
  ap.add_argument("--head-dim", type=int, default=64)
  ap.add_argument("--calls", type=int, default=3)
  ap.add_argument("--top", type=int, default=14)
  a = ap.parse_args()
  hq, hkv = (int(x) for x in a.heads.split(","))
  n, d, b = a.length, a.head_dim, a.batch
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (b, hq, n, d))
  k = jax.random.normal(keys[1], (b, hkv, n, d))
  v = jax.random.normal(keys[2], (b, hkv, n, d))
  f = jax.jit(lambda q, k, v: blockwise_causal_attention(q, k, v, block_size=a.block_size))
  best = bench_common.time_calls(f, q, k, v, repeats=a.calls).best
  gflop = 4 * b * hq * d * n * (n + 1) / 2 / 1e9
  print(f"batch {b}, length {n}, block {a.block_size}: {best * 1e3:.1f} ms per call "
        f"(best of {a.calls}), "
        f"{gflop / best:.0f} GFLOP/s of causal attention")
  events = bench_common.trace_events(
      lambda: [f(q, k, v).block_until_ready() for _ in range(a.calls)])
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if not any(s in e["name"] for s in _SKIP):
      total[e["name"]] += e.get("dur", 0)
      count[e["name"]] += 1
  hlo = f.lower(q, k, v).compile().as_text().splitlines()
  print("   ms/call  runs/call  op  (output shape)")
  for name, t in total.most_common(a.top):
    line = next((x.strip() for x in hlo if re.match(rf"\s*%?{re.escape(name)} = ", x)), "")
    m = re.search(r" = (\S+)", line)
    shape = m.group(1) if m else ""
    print(f"{t / a.calls / 1e3:10.2f}  {count[name] // a.calls:9d}  {name}  {shape}")


if __name__ == "__main__":
  main()
