"""Benchmark of the RocketKV Pallas kernels against the XLA path and dense decode attention.

    python benchmarks/kernels.py                      # GPU: full sweep; CPU: correctness pass
    python benchmarks/kernels.py --lengths 32768 --budgets 256 1024 --iters 50

On a GPU, for Llama-3.1-8B attention shapes (Hq 32, Hkv 8, D 128, bf16) and every
(context length, token budget) it prints microseconds per decode step of one layer and the
achieved HBM bandwidth against the card's peak for:
  - rocketkv select+attend, Pallas kernels vs the pure-XLA path (same plan, same cache);
  - the two decode kernels alone (approx chunk scores, sparse attention), Pallas vs XLA;
  - dense decode attention over the whole uncompressed context: jax's Pallas `decode_attention`
    (gqa) and `jax.nn.dot_product_attention`;
  - stage-1 window scores (prefill, once per prompt), Pallas vs XLA.
Bytes counted are the K/V (or summary) rows each path must read at least; the bandwidth column
is bytes / time.

Without a GPU it says so and runs the interpret-mode correctness pass instead (small shapes).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import rocketkv_jax as rocketkv
from rocketkv_jax import kernels
from rocketkv_jax.attend import sparse_attention_xla
from rocketkv_jax.evict import window_scores_xla
from rocketkv_jax.select import approx_bounds_scores_xla, approx_chunk_scores_xla

# HBM peak bandwidth (GB/s) by device-kind substring; --peak-gbps overrides.
PEAK_GBPS = {"H200": 4800, "H100": 3350, "H800": 3350, "A100-SXM4-80GB": 2039, "A100": 1555,
             "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008, "RTX 3090": 936}
LLAMA = dict(hq=32, hkv=8, d=128)


def _peak_gbps(override):
  if override:
    return override
  kind = jax.devices()[0].device_kind
  for name, gbps in PEAK_GBPS.items():
    if name in kind:
      return gbps
  return None


def _time_us(f, *args, iters: int) -> float:
  """Median microseconds per call of a jitted f (compiled and warmed up first)."""
  jax.block_until_ready(f(*args))
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / iters * 1e6)
  return statistics.median(times)


def _row(name, us, nbytes, peak):
  gbps = nbytes / us / 1e3
  frac = f"{100 * gbps / peak:5.1f}%" if peak else "    ?"
  print(f"  {name:<34s} {us:9.1f} us  {gbps:8.1f} GB/s  {frac} of peak", flush=True)


def _random_cache(key, b, hkv, capacity, d, length, chunk, dtype):
  k1, k2 = jax.random.split(key)
  k = jax.random.normal(k1, (b, hkv, length, d), dtype)
  v = jax.random.normal(k2, (b, hkv, length, d), dtype)
  return rocketkv.full_cache(k, v, capacity, chunk)


@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _select_attend(q, cache, plan, impl):
  idx = rocketkv.select(q, cache, plan, impl=impl)
  return rocketkv.attend(q, cache, idx, impl=impl)


def bench_gpu(args):
  interp = args.smoke  # CPU smoke test of this script: tiny shapes, kernels in interpret mode
  peak = _peak_gbps(args.peak_gbps)
  dev = jax.devices()[0]
  b, hq, hkv, d = args.batch, LLAMA["hq"], LLAMA["hkv"], LLAMA["d"]
  if interp:
    hq, hkv, d = 4, 2, 64
  print(f"device: {dev.device_kind}  peak HBM: {peak or 'unknown (use --peak-gbps)'} GB/s  "
        f"batch {b}  one layer, Hq {hq}, Hkv {hkv}, D {d}, bf16"
        + ("  [smoke: interpret mode, timings meaningless]" if interp else ""))
  dt = jnp.bfloat16
  isz = jnp.dtype(dt).itemsize
  key = jax.random.PRNGKey(0)
  from jax.experimental.pallas.ops.gpu import decode_attention as dense_pallas
  for length in args.lengths:
    kq, kk, kv, kw = jax.random.split(jax.random.fold_in(key, length), 4)
    q = jax.random.normal(kq, (b, hq, d), dt)
    # dense baselines over the whole uncompressed context, [B, L, Hkv, D] layout
    kd = jax.random.normal(kk, (b, length, hkv, d), dt)
    vd = jax.random.normal(kv, (b, length, hkv, d), dt)
    dense_bytes = 2 * b * hkv * length * d * isz
    print(f"\ncontext {length}:")
    try:
      f = jax.jit(functools.partial(dense_pallas.gqa, k_splits=16, interpret=interp))
      _row("dense pallas decode_attention", _time_us(f, q, kd, vd, iters=args.iters),
           dense_bytes, peak)
    except Exception as e:  # noqa: BLE001 - report and continue
      print(f"  dense pallas decode_attention failed: {type(e).__name__}: {e}")
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v)[:, 0])
    _row("dense jax.nn.dot_product_attention", _time_us(f, q, kd, vd, iters=args.iters),
         dense_bytes, peak)
    del kd, vd
    # stage 1 (prefill): window scores of the last 32 queries
    kp = jax.random.normal(kk, (b, hkv, length, d), dt)
    qw = jax.random.normal(kw, (b, hq, 32, d), dt)
    lens = jnp.full((b,), length, jnp.int32)
    wbytes = b * hkv * length * d * isz * 2  # two passes over the keys
    fw = jax.jit(functools.partial(kernels.window_scores, interpret=interp))
    _row("window scores pallas (prefill)", _time_us(fw, qw, kp, lens,
                                                    iters=max(1, args.iters // 10)), wbytes, peak)
    try:
      _row("window scores xla (prefill)", _time_us(jax.jit(window_scores_xla), qw, kp, lens,
                                                   iters=max(1, args.iters // 10)), wbytes, peak)
    except Exception as e:  # noqa: BLE001 - the [W, L] matrix may not fit
      print(f"  window scores xla failed: {type(e).__name__}")
    del kp
    for budget in args.budgets:
      plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), length - 100, 100, d)
      cache = _random_cache(kk, b, hkv, plan.capacity, d, plan.capacity - 50, plan.chunk_size, dt)
      nc = plan.num_chunks
      approx_bytes = 2 * b * hkv * nc * d * isz
      sparse_bytes = 2 * b * hkv * plan.top_k * d * isz
      print(f" budget {budget}: capacity {plan.capacity}, top_k {plan.top_k}, "
            f"chunk {plan.chunk_size}, r {plan.r}")
      for impl in ("pallas", "xla"):  # (impl="pallas" off-GPU runs the kernels interpreted)
        _row(f"rocketkv select+attend {impl}",
             _time_us(functools.partial(_select_attend, plan=plan, impl=impl), q, cache,
                      iters=args.iters), approx_bytes + sparse_bytes, peak)
      args_a = (q, cache.bounds, cache.length)  # the cache's summary layout
      fa = jax.jit(functools.partial(kernels.approx_bounds_scores, chunk_size=plan.chunk_size,
                                     r=plan.r, interpret=interp))
      fx = jax.jit(functools.partial(approx_bounds_scores_xla, chunk_size=plan.chunk_size,
                                     r=plan.r))
      _row("  approx chunk scores pallas", _time_us(fa, *args_a, iters=args.iters),
           approx_bytes, peak)
      _row("  approx chunk scores xla", _time_us(fx, *args_a, iters=args.iters),
           approx_bytes, peak)
      idx = rocketkv.select(q, cache, plan, impl="xla")
      valid = jnp.ones(idx.shape, bool)
      args_s = (q, cache.k, cache.v, idx, valid)
      fs = jax.jit(functools.partial(kernels.sparse_attention, interpret=interp))
      _row("  sparse attention pallas", _time_us(fs, *args_s, iters=args.iters), sparse_bytes,
           peak)
      _row("  sparse attention xla", _time_us(jax.jit(sparse_attention_xla), *args_s,
                                              iters=args.iters), sparse_bytes, peak)


def correctness_pass():
  """Interpret-mode kernels vs the XLA path on small shapes (a few seconds on CPU)."""
  key = jax.random.PRNGKey(0)
  ks = jax.random.split(key, 6)
  b, hq, hkv, d, c, kk, cs, r = 2, 8, 2, 64, 90, 24, 3, 20
  q = jax.random.normal(ks[0], (b, hq, d), jnp.float32)
  k = jax.random.normal(ks[1], (b, hkv, c, d), jnp.float32)
  v = jax.random.normal(ks[2], (b, hkv, c, d), jnp.float32)
  length = jnp.array([c, 31], jnp.int32)
  idx = jax.random.randint(ks[3], (b, hkv, kk), 0, c)
  valid = idx < length[:, None, None]
  kmin, kmax = rocketkv.chunk_summaries(k, length, cs)
  qw = jax.random.normal(ks[4], (b, hq, 16, d), jnp.float32)
  checks = {
      "sparse_attention": (kernels.sparse_attention(q, k, v, idx, valid, interpret=True),
                           sparse_attention_xla(q, k, v, idx, valid)),
      "approx_chunk_scores": (
          kernels.approx_chunk_scores(q, kmin, kmax, length, chunk_size=cs, r=r,
                                      interpret=True),
          approx_chunk_scores_xla(q, kmin, kmax, length, cs, r)),
      "window_scores": (kernels.window_scores(qw, k, length, interpret=True),
                        window_scores_xla(qw, k, length)),
  }
  ok = True
  for name, (got, want) in checks.items():
    err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    good = err <= 1e-4 * max(1.0, float(np.max(np.abs(np.asarray(want)))))
    ok &= good
    print(f"  {name:<22s} max |pallas - xla| = {err:.2e}  {'ok' if good else 'MISMATCH'}")
  return ok


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
  p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--iters", type=int, default=100)
  p.add_argument("--peak-gbps", type=float, default=None, help="HBM peak, GB/s")
  p.add_argument("--smoke", action="store_true",
                 help="run the GPU sweep's code on CPU at tiny shapes, kernels interpreted "
                      "(checks this script, not performance), e.g. --smoke --lengths 512 "
                      "--budgets 64 --iters 1")
  args = p.parse_args(argv)
  if args.smoke:
    bench_gpu(args)
    return 0
  if jax.default_backend() != "gpu":
    print(f"benchmarks/kernels.py needs a GPU (backend here: {jax.default_backend()}); "
          "running the interpret-mode correctness pass instead.")
    return 0 if correctness_pass() else 1
  bench_gpu(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
