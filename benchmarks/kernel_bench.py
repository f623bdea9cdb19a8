"""Correctness and timing of the RocketKV Pallas kernels on a GPU, against the XLA path.

    python benchmarks/kernel_bench.py                  # GPU: compiled-kernel checks, then sweep
    python benchmarks/kernel_bench.py --lengths 32768 --budgets 256 1024 --batches 1 --iters 50
    python benchmarks/kernel_bench.py --smoke          # CPU: this script at tiny shapes,
                                                       # kernels interpreted (checks the script)

On a GPU, at Llama-3.1-8B attention shapes (Hq 32, Hkv 8, D 128), one layer:

1. Correctness of the COMPILED kernels (interpret=False), fp32 and bf16, batch 1 and 4, ragged
   lengths, fresh random inputs for every check: ||out - ref|| / ||ref|| for
   approx_bounds_scores, approx_chunk_scores, quant_slot_logits (`stage2="quant"`, 4-bit codes),
   sparse_attention and window_scores, where `ref` is
   the XLA function on the same values upcast to float32 at matmul precision "highest"; the XLA
   function on the native dtype at default precision is scored against the same `ref` for
   comparison. End to end, `rocketkv.select` + `attend` with impl="pallas" against impl="xla":
   overlap of the selected valid slots (mean and worst KV head) and the relative difference of
   the attention outputs.
2. Timing, for every (batch, context length, token budget): microseconds per call of
   select+attend (Pallas vs XLA, same plan and cache; the paper's stage 2 and `stage2="quant"`
   side by side, issue #13's step-time ratio), of the decode kernels alone, of dense
   decode attention over the whole uncompressed context (jax's Pallas `decode_attention.gqa`
   and `jax.nn.dot_product_attention`), and of stage-1 window scores (prefill, once per
   prompt). Each function runs `--iters` times inside one jitted `fori_loop` (each iteration's
   query depends on the previous output, so calls are serialised as in a decode loop and
   Python dispatch is paid once per loop); the median of 5 loops is reported, with the first
   call's time (compile + one loop). Bandwidth = the bytes each kernel must read (K/V rows, or
   the r selected summary rows for the chunk scores) / time; two ceilings are measured first
   (an empty loop iteration, and a 2 GiB read).

`--deadline-s` bounds the run: work that would start past it is skipped and listed, and the
final tables are still printed. `--json` writes every number.

Without a GPU (and without --smoke) it says so and runs a small interpret-mode correctness pass.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import rocketkv_jax as rocketkv
from rocketkv_jax import kernels
from rocketkv_jax.attend import sparse_attention_xla
from rocketkv_jax.cache import bounds_of
from rocketkv_jax.evict import window_scores_xla
from rocketkv_jax.select import approx_bounds_scores_xla, approx_chunk_scores_xla
from rocketkv_jax.methods.stage2 import cache_of
from rocketkv_jax.methods.stage2.quant import slot_logits_xla as quant_slot_logits_xla

import bench_common

# HBM peak bandwidth (GB/s) by device-kind substring; --peak-gbps overrides.
PEAK_GBPS = {"H200": 4800, "H100": 3350, "H800": 3350, "A100-SXM4-80GB": 2039, "A100": 1555,
             "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008, "RTX 3090": 936}
LLAMA = dict(hq=32, hkv=8, d=128)
SMOKE = dict(hq=8, hkv=2, d=64)
WINDOW = 32
# Pass marks for ||pallas - ref|| / ||ref||: fp32 kernels compute in IEEE fp32; bf16 kernels
# take bf16 operands (sparse_attention also rounds its output to bf16, ~2e-3).
TOL = {"float32": 1e-4, "bfloat16": 1e-2}
CHECKS = ("approx", "quant", "sparse", "window", "e2e")
T0 = time.perf_counter()


def _elapsed() -> float:
  return time.perf_counter() - T0


def _peak_gbps(override):
  if override:
    return override
  kind = jax.devices()[0].device_kind
  for name, gbps in PEAK_GBPS.items():
    if name in kind:
      return gbps
  return None


def _rel(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64; inf when out holds a non-finite value."""
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  if out.shape != ref.shape or not np.all(np.isfinite(out)):
    return float("inf")
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _err(e: BaseException, limit: int = 4000) -> str:
  """An exception as one string (type and the first `limit` characters of its message)."""
  import traceback
  traceback.print_exception(e, file=sys.stderr)
  return f"{type(e).__name__}: {str(e)[:limit]}"


def _f32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


# ---------------------------------------------------------------- correctness (compiled)
_xla_approx = jax.jit(approx_bounds_scores_xla, static_argnames=("chunk_size", "r"))
_xla_approx_chunk = jax.jit(approx_chunk_scores_xla, static_argnames=("chunk_size", "r"))
_xla_quant = jax.jit(quant_slot_logits_xla, static_argnames=("r",))
_xla_sparse = jax.jit(sparse_attention_xla)
_xla_window = jax.jit(window_scores_xla, static_argnames="reduce")


def _highest(f, *args, **kw):
  """The XLA reference: f on float32-upcast inputs at matmul precision "highest"."""
  with jax.default_matmul_precision("highest"):
    return f(*_f32(args), **kw)


@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _pallas(interpret: bool) -> str:
  """The impl that runs the kernels: compiled on a GPU, Pallas interpret mode otherwise."""
  return "interpret" if interpret else "pallas"


def _select_then_attend(q, cache, plan, impl):
  idx = rocketkv.select(q, cache, plan, impl=impl)
  return idx, rocketkv.attend(q, cache, idx, impl=impl)


def _random_cache(key, b, hkv, capacity, d, lengths, chunk, dtype):
  """A cache of `capacity` random rows per head, `lengths[b]` of them valid (rest zeroed)."""
  k1, k2 = jax.random.split(key)
  k = jax.random.normal(k1, (b, hkv, capacity, d), jnp.float32).astype(dtype)
  v = jax.random.normal(k2, (b, hkv, capacity, d), jnp.float32).astype(dtype)
  return rocketkv.full_cache(k, v, capacity, chunk, jnp.asarray(lengths, jnp.int32))


def _ragged(b: int, n: int) -> list[int]:
  """Ragged valid lengths in [1, n]: full, two partial, and nearly empty."""
  pool = [n, 2 * n // 3 + 1, n // 7 + 3, 5]
  return [n - 37] if b == 1 else pool[:b]


class _Skip(Exception):
  """A check that was not asked for."""


def _overlap(idx_a, idx_b, length) -> list[float]:
  """Per (sequence, KV head): |valid slots in both| / |valid slots of b|."""
  ia, ib, nl = np.asarray(idx_a), np.asarray(idx_b), np.asarray(length)
  out = []
  for bi in range(ia.shape[0]):
    for h in range(ia.shape[1]):
      sa = set(ia[bi, h][ia[bi, h] < nl[bi]].tolist())
      sb = set(ib[bi, h][ib[bi, h] < nl[bi]].tolist())
      out.append(len(sa & sb) / max(len(sb), 1) if (sa or sb) else 1.0)
  return out


def check_compiled(dims, length, budget, batches, interpret, deadline, records,
                   which=frozenset(CHECKS)):
  """Compiled Pallas kernels vs XLA at real shapes; returns True when every check passes."""
  hq, hkv, d = dims["hq"], dims["hkv"], dims["d"]
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), length - 100, 100, d)
  cap, cs, r, top_k = plan.capacity, plan.chunk_size, plan.r, plan.top_k
  print(f"\n== correctness: compiled kernels (interpret={interpret}) vs XLA; Hq {hq} Hkv {hkv} "
        f"D {d}; context {length}, budget {budget}: capacity {cap}, chunk {cs}, r {r}, "
        f"top_k {top_k}", flush=True)
  print(f"   err = ||out - ref|| / ||ref||, ref = XLA on fp32-upcast inputs at precision highest",
        flush=True)
  ok_all = True
  key = jax.random.PRNGKey(1234)
  for b in batches:
    for dt in (jnp.float32, jnp.bfloat16):
      if _elapsed() > deadline:
        print(f"   [skipped: past --deadline-s] batch {b} {jnp.dtype(dt).name}", flush=True)
        records.append(dict(kind="check", batch=b, dtype=jnp.dtype(dt).name, skipped=True))
        continue
      name = jnp.dtype(dt).name
      t_start = _elapsed()
      key, kc, kq, ki, kw, kwq, ke = jax.random.split(key, 7)
      lens = _ragged(b, cap)
      cache = _random_cache(kc, b, hkv, cap, d, lens, cs, dt)
      q = jax.random.normal(kq, (b, hq, d), jnp.float32).astype(dt)
      length_arr = cache.length
      rows = []

      def add(kernel, got_fn, ref_fn, xla_fn):
        """Runs one check; a kernel that fails to compile or run is a FAIL with its error."""
        if kernel.split("_")[0] not in which:
          return True
        try:
          ref = ref_fn()
          got = got_fn()
          e_x = _rel(xla_fn(), ref)
          e_p = _rel(got, ref)
        except Exception as e:  # noqa: BLE001 - record the error, go on with the others
          msg = _err(e)
          print(f"    {kernel}: ERROR {msg}", flush=True)
          rows.append((kernel, float("inf"), None, False, None))
          records.append(dict(kind="check", batch=b, dtype=name, kernel=kernel, error=msg,
                              ok=False))
          return False
        good = e_p <= TOL[name]
        rows.append((kernel, e_p, e_x, good, None))
        records.append(dict(kind="check", batch=b, dtype=name, kernel=kernel, err_pallas=e_p,
                            err_xla=e_x, ok=bool(good)))
        return good

      # approx chunk scores, on the cache's bounds and on kmin / kmax
      bnd = cache.bounds
      ref_a = lambda: _highest(_xla_approx, q, bnd, length_arr, chunk_size=cs, r=r)
      ok_all &= add("approx_bounds_scores",
                    lambda: kernels.approx_bounds_scores(q, bnd, length_arr, chunk_size=cs, r=r,
                                                         interpret=interpret),
                    ref_a, lambda: _xla_approx(q, bnd, length_arr, chunk_size=cs, r=r))
      ok_all &= add("approx_chunk_scores",
                    lambda: kernels.approx_chunk_scores(q, cache.kmin, cache.kmax, length_arr,
                                                        chunk_size=cs, r=r, interpret=interpret),
                    ref_a, lambda: _xla_approx_chunk(q, cache.kmin, cache.kmax, length_arr,
                                                     chunk_size=cs, r=r))

      # stage2="quant" slot logits (4-bit codes of the same keys), on the cache's capacity
      qplan = _quant_plan(budget, length, d)
      qstate = _quant_state(cache, qplan) if "quant" in which else None
      qr = qplan.r
      ok_all &= add("quant_slot_logits",
                    lambda: kernels.quant_slot_logits(q, qstate.codes, qstate.step, r=qr, bits=4,
                                                      capacity=qplan.capacity,
                                                      interpret=interpret),
                    lambda: _highest(_xla_quant, q, qstate, r=qr),
                    lambda: _xla_quant(q, qstate, r=qr))

      # sparse attention over top_k distinct random slots; slots past the length are masked
      idx = jnp.argsort(jax.random.uniform(ki, (b, hkv, cap)), axis=-1)[..., :top_k]
      idx = idx.astype(jnp.int32)
      valid = idx < length_arr[:, None, None]
      sargs = (q, cache.k, cache.v, idx, valid)
      ok_all &= add("sparse_attention",
                    lambda: kernels.sparse_attention(*sargs, interpret=interpret),
                    lambda: _highest(_xla_sparse, *sargs), lambda: _xla_sparse(*sargs))

      # stage-1 window scores over `length` random keys, ragged prompt lengths (>= WINDOW)
      kp = jax.random.normal(kw, (b, hkv, length if "window" in which else WINDOW, d),
                             jnp.float32).astype(dt)
      qw = jax.random.normal(kwq, (b, hq, WINDOW, d), jnp.float32).astype(dt)
      wl = jnp.asarray([max(WINDOW, x) for x in _ragged(b, length)], jnp.int32)
      for red in ("sum", "max"):  # RocketConfig.window_reduce
        ok_all &= add("window_scores" + ("" if red == "sum" else " max"),
                      lambda: kernels.window_scores(qw, kp, wl, reduce=red, interpret=interpret),
                      lambda: _highest(_xla_window, qw, kp, wl, reduce=red),
                      lambda: _xla_window(qw, kp, wl, reduce=red))
      del kp

      # end to end: select + attend, impl="pallas" vs impl="xla" (fresh query)
      q2 = jax.random.normal(ke, (b, hq, d), jnp.float32).astype(dt)
      good = True
      try:
        if "e2e" not in which:
          raise _Skip
        idx_p, out_p = _select_then_attend(q2, cache, plan, _pallas(interpret))
        idx_x, out_x = _select_then_attend(q2, cache, plan, "xla")
        with jax.default_matmul_precision("highest"):
          idx_h, out_h = _select_then_attend(q2, cache, plan, "xla")
        ov, ov_h = _overlap(idx_p, idx_x, length_arr), _overlap(idx_p, idx_h, length_arr)
        e2e, e2e_h = _rel(out_p, out_x), _rel(out_p, out_h)
        # verdict against the XLA path at precision highest (default precision on a GPU may
        # use TF32 for the fp32 chunk-score product, which moves near-tied chunks)
        good = min(ov_h) >= 0.95 and e2e_h <= 10 * TOL[name]
        extra = dict(overlap_mean=float(np.mean(ov)), overlap_min=float(min(ov)),
                     overlap_highest_mean=float(np.mean(ov_h)),
                     overlap_highest_min=float(min(ov_h)), err_pallas_vs_xla_highest=e2e_h)
        rows.append(("select+attend (pallas vs xla)", e2e, None, good, extra))
        records.append(dict(kind="check", batch=b, dtype=name, kernel="select+attend",
                            err_pallas_vs_xla=e2e, ok=bool(good), **extra))
      except _Skip:
        pass
      except Exception as e:  # noqa: BLE001
        msg = _err(e)
        print(f"    select+attend: ERROR {msg}", flush=True)
        good = False
        rows.append(("select+attend (pallas vs xla)", float("inf"), None, False, None))
        records.append(dict(kind="check", batch=b, dtype=name, kernel="select+attend",
                            error=msg, ok=False))
      ok_all &= good

      print(f"  batch {b} {name} lengths {lens} (window: {np.asarray(wl).tolist()}) "
            f"[{_elapsed() - t_start:.1f} s]", flush=True)
      for kernel, e_p, e_x, good, extra in rows:
        xs = f"  xla(native) {e_x:.2e}" if e_x is not None else ""
        ex = (f"  slot overlap mean {extra['overlap_mean']:.4f} min {extra['overlap_min']:.4f}"
              f" | vs xla@highest: err {extra['err_pallas_vs_xla_highest']:.2e} overlap mean "
              f"{extra['overlap_highest_mean']:.4f} min {extra['overlap_highest_min']:.4f}"
              if extra else "")
        print(f"    {kernel:<30s} err {e_p:.2e}{xs}{ex}  {'ok' if good else 'FAIL'}", flush=True)
  return ok_all


# ---------------------------------------------------------------- timing
def _loop(f, n: int):
  """jit(fori_loop(n x f)): iteration i's first argument depends on the sum of iteration
  i-1's first output (serialised calls; the sum is one small extra reduction per call)."""
  def run(*args):
    def body(_, acc):
      a0 = args[0] + (acc * 0).astype(args[0].dtype)
      # Consume the whole output: with out[0] alone XLA slices the XLA paths down to the
      # work that element needs (seen on the H200: a 2 GiB copy "ran" at 135 TB/s).
      out = jax.tree.leaves(f(a0, *args[1:]))[0]
      return acc + jnp.sum(out.astype(jnp.float32))
    return lax.fori_loop(0, n, body, jnp.float32(0))
  return jax.jit(run)


def _time_us(f, *args, iters: int) -> tuple[float, float]:
  """(median microseconds per call over 5 loops of `iters` calls, seconds of the first loop)."""
  t = bench_common.time_calls(_loop(f, iters), *args, repeats=5)
  return t.median / iters * 1e6, t.warmup_s


class Sweep:
  """Runs and records the timed rows."""

  def __init__(self, peak, iters, deadline, records):
    self.peak, self.iters, self.deadline, self.records = peak, iters, deadline, records
    self.skipped = []

  def row(self, ctx, name, f, args, nbytes, iters=None):
    if _elapsed() > self.deadline:
      self.skipped.append(f"{ctx} {name}")
      return None
    try:
      us, first = _time_us(f, *args, iters=iters or self.iters)
    except Exception as e:  # noqa: BLE001 - report and continue
      msg = _err(e, 1500)
      print(f"  {name:<34s} FAILED {msg}", flush=True)
      self.records.append(dict(kind="time", ctx=ctx, name=name, error=msg))
      return None
    gbps = nbytes / us / 1e3
    frac = f"{100 * gbps / self.peak:5.1f}%" if self.peak else "    ?"
    print(f"  {name:<34s} {us:9.1f} us  {gbps:8.1f} GB/s  {frac} of peak  "
          f"(first loop {first:5.1f} s)", flush=True)
    self.records.append(dict(kind="time", ctx=ctx, name=name, us=us, gbps=gbps, bytes=nbytes,
                             first_s=first))
    return us


@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _select_attend(q, cache, plan, impl):
  """`cache`: the plan's stage-2 state (a `KVCache`, or a `QuantState` for "quant")."""
  idx = rocketkv.select(q, cache, plan, impl=impl)
  return rocketkv.attend(q, cache_of(cache), idx, impl=impl)


def _quant_state(cache, qplan):
  """The `QuantState` of the same keys and values (a cache without chunk summaries)."""
  full = rocketkv.full_cache(cache.k, cache.v, qplan.capacity, 0, cache.length)
  return qplan.stage2.prefill(full, qplan)


def _quant_plan(budget, length, d):
  """The `stage2="quant"` (4-bit) plan of the same split as the paper's."""
  return rocketkv.plan(rocketkv.RocketConfig(token_budget=budget, stage2=rocketkv.Quant(bits=4)),
                       length - 100, 100, d)


def ceilings(sweep, interpret):
  """An empty loop iteration and a 2 GiB read (bandwidth ceiling)."""
  n = 1 << (16 if interpret else 30)  # 2 GiB of bf16 on a GPU
  x = jax.random.normal(jax.random.PRNGKey(7), (n,), jnp.float32).astype(jnp.bfloat16)
  print("\n== ceilings", flush=True)
  sweep.row("ceiling", "empty loop iteration", lambda a: a * 2, (x[:1024],), 0)
  sweep.row("ceiling", "read 2 GiB bf16 (sum)", lambda a: -a, (x,), 2 * n,
            iters=max(1, sweep.iters // 3))
  del x


def bench(dims, args, interpret, peak, records):
  sweep = Sweep(peak, args.iters, args.deadline_s, records)
  ceilings(sweep, interpret)
  hq, hkv, d = dims["hq"], dims["hkv"], dims["d"]
  dt = jnp.bfloat16
  isz = jnp.dtype(dt).itemsize
  from jax.experimental.pallas.ops.gpu import decode_attention as dense_pallas
  for b in args.batches:
    for length in args.lengths:
      ctx = f"B{b} L{length}"
      print(f"\n== timing: batch {b}, context {length}, bf16, Hq {hq} Hkv {hkv} D {d}",
            flush=True)
      key = jax.random.fold_in(jax.random.PRNGKey(0), 1000 * b + length % 997)
      kq, kk, kv, kw, kc = jax.random.split(key, 5)
      q = jax.random.normal(kq, (b, hq, d), jnp.float32).astype(dt)
      if _elapsed() <= args.deadline_s:
        kd = jax.random.normal(kk, (b, length, hkv, d), jnp.float32).astype(dt)  # [B, L, Hkv, D]
        vd = jax.random.normal(kv, (b, length, hkv, d), jnp.float32).astype(dt)
        dense_bytes = 2 * b * hkv * length * d * isz
        sweep.row(ctx, "dense pallas decode_attention",
                  functools.partial(dense_pallas.gqa, k_splits=16, interpret=interpret),
                  (q, kd, vd), dense_bytes)
        sweep.row(ctx, "dense jax.nn.dot_product_attention",
                  lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v)[:, 0],
                  (q, kd, vd), dense_bytes)
        del kd, vd
        kp = jax.random.normal(kk, (b, hkv, length, d), jnp.float32).astype(dt)
        qw = jax.random.normal(kw, (b, hq, WINDOW, d), jnp.float32).astype(dt)
        lens = jnp.full((b,), length, jnp.int32)
        wbytes = b * hkv * length * d * isz * 2  # the kernel reads the keys twice
        witers = max(1, args.iters // 5)
        sweep.row(ctx, "window scores pallas (prefill)",
                  functools.partial(kernels.window_scores, interpret=interpret), (qw, kp, lens),
                  wbytes, iters=witers)
        sweep.row(ctx, "window scores xla (prefill)", window_scores_xla, (qw, kp, lens), wbytes,
                  iters=witers)
        del kp
      for budget in args.budgets:
        if _elapsed() > args.deadline_s:
          sweep.skipped.append(f"{ctx} budget {budget}")
          continue
        plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), length - 100, 100, d)
        cache = _random_cache(kc, b, hkv, plan.capacity, d, [plan.capacity - 50] * b,
                              plan.chunk_size, dt)
        nc = plan.num_chunks
        approx_bytes = b * hkv * nc * plan.r * isz  # the r summary rows both paths gather
        sparse_bytes = 2 * b * hkv * plan.top_k * d * isz
        bctx = f"{ctx} budget {budget}"
        print(f" budget {budget}: capacity {plan.capacity}, top_k {plan.top_k}, "
              f"chunk {plan.chunk_size}, NC {nc}, r {plan.r}", flush=True)
        for impl in (_pallas(interpret), "xla"):
          sweep.row(bctx, f"rocketkv select+attend {impl.replace('interpret', 'pallas')}",
                    functools.partial(_select_attend, plan=plan, impl=impl), (q, cache),
                    approx_bytes + sparse_bytes)
        args_a = (q, cache.bounds, cache.length)
        sweep.row(bctx, "  approx chunk scores pallas",
                  functools.partial(kernels.approx_bounds_scores, chunk_size=plan.chunk_size,
                                    r=plan.r, interpret=interpret), args_a, approx_bytes)
        sweep.row(bctx, "  approx chunk scores xla",
                  functools.partial(approx_bounds_scores_xla, chunk_size=plan.chunk_size,
                                    r=plan.r), args_a, approx_bytes)
        idx = rocketkv.select(q, cache, plan, impl="xla")
        valid = jnp.ones(idx.shape, bool)
        args_s = (q, cache.k, cache.v, idx, valid)
        sweep.row(bctx, "  sparse attention pallas",
                  functools.partial(kernels.sparse_attention, interpret=interpret), args_s,
                  sparse_bytes)
        sweep.row(bctx, "  sparse attention xla", sparse_attention_xla, args_s, sparse_bytes)
        # stage2="quant" on the same keys: r rows of 4-bit codes instead of NC bound rows
        qplan = _quant_plan(budget, length, d)
        qstate = _quant_state(cache, qplan)
        code_bytes = b * hkv * qplan.r * qstate.codes.shape[-1]
        for impl in (_pallas(interpret), "xla"):
          sweep.row(bctx, f"quant select+attend {impl.replace('interpret', 'pallas')}",
                    functools.partial(_select_attend, plan=qplan, impl=impl), (q, qstate),
                    code_bytes + sparse_bytes)
        sweep.row(bctx, "  quant slot logits pallas",
                  functools.partial(kernels.quant_slot_logits, r=qplan.r, bits=4,
                                    capacity=qplan.capacity, interpret=interpret),
                  (q, qstate.codes, qstate.step), code_bytes)
        sweep.row(bctx, "  quant slot logits xla",
                  functools.partial(quant_slot_logits_xla, r=qplan.r), (q, qstate), code_bytes)
        del cache, qstate
  return sweep


def tune(dims, args, interpret, sweep):
  """Block-size variants of the two decode kernels at the largest (context, budget), batch 1
  (only while --deadline-s leaves time; the defaults are timed in the sweep)."""
  hq, hkv, d = dims["hq"], dims["hkv"], dims["d"]
  b, length, budget = 1, max(args.lengths), max(args.budgets)
  if _elapsed() > args.deadline_s:
    sweep.skipped.append("tune")
    return
  dt = jnp.bfloat16
  ctx = f"tune B{b} L{length} budget {budget}"
  print(f"\n== {ctx}: block-size variants", flush=True)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), length - 100, 100, d)
  key = jax.random.PRNGKey(99)
  q = jax.random.normal(key, (b, hq, d), jnp.float32).astype(dt)
  cache = _random_cache(jax.random.fold_in(key, 1), b, hkv, plan.capacity, d,
                        [plan.capacity - 50] * b, plan.chunk_size, dt)
  args_a = (q, cache.bounds, cache.length)
  for bc in (16, 32, 128, 256):
    sweep.row(ctx, f"approx pallas block_c={bc}",
              functools.partial(kernels.approx_bounds_scores, chunk_size=plan.chunk_size, r=plan.r,
                                interpret=interpret, block_c=bc), args_a, 0)
  idx = rocketkv.select(q, cache, plan, impl="xla")
  args_s = (q, cache.k, cache.v, idx, jnp.ones(idx.shape, bool))
  for kw in (dict(block_k=16), dict(block_k=64), dict(num_splits=1), dict(num_splits=8),
             dict(num_splits=64)):
    sweep.row(ctx, "sparse pallas " + ",".join(f"{k}={v}" for k, v in kw.items()),
              functools.partial(kernels.sparse_attention, interpret=interpret, **kw), args_s, 0)


def summary(records, sweep, peak):
  """The compact final tables (copied into results/)."""
  print("\n== summary: correctness (||out - ref|| / ||ref||; e2e = pallas vs xla)")
  print(f"  {'kernel':<22s} {'dtype':<9s} {'B':>2s} {'pallas':>9s} {'xla':>9s}  verdict")
  for r in records:
    if r.get("kind") != "check" or r.get("skipped"):
      continue
    if "error" in r:
      print(f"  {r['kernel']:<22s} {r['dtype']:<9s} {r['batch']:>2d}  ERROR {r['error'][:200]}")
    elif r["kernel"] == "select+attend":
      print(f"  {'select+attend e2e':<22s} {r['dtype']:<9s} {r['batch']:>2d} "
            f"{r['err_pallas_vs_xla']:9.2e} {'':>9s}  overlap {r['overlap_mean']:.4f} "
            f"(min {r['overlap_min']:.4f}); vs xla@highest {r['err_pallas_vs_xla_highest']:.2e}"
            f", overlap {r['overlap_highest_mean']:.4f} (min {r['overlap_highest_min']:.4f}) "
            f"{'ok' if r['ok'] else 'FAIL'}")
    else:
      print(f"  {r['kernel']:<22s} {r['dtype']:<9s} {r['batch']:>2d} {r['err_pallas']:9.2e} "
            f"{r['err_xla']:9.2e}  {'ok' if r['ok'] else 'FAIL'}")
  if sweep is None:
    return
  t = {(r["ctx"], r["name"].strip()): r for r in records if r.get("kind") == "time"}

  def us(ctx, name):
    r = t.get((ctx, name))
    return "-" if r is None else ("ERR" if "error" in r else f"{r['us']:.1f}")

  def bw(ctx, name):
    r = t.get((ctx, name))
    if r is None or "error" in r or not r["bytes"]:
      return "-"
    return f"{r['gbps']:.0f}" + (f" ({100 * r['gbps'] / peak:.0f}%)" if peak else "")

  print("\n== summary: ceilings")
  print(f"  empty loop iteration {us('ceiling', 'empty loop iteration')} us (again at the "
        f"end: {us('ceiling', 'empty loop iteration (end)')} us); "
        f"read {bw('ceiling', 'read 2 GiB bf16 (sum)')} GB/s")
  print("\n== summary: decode step, us per call (select+attend = both stages of selection + "
        "attention)")
  hdr = ("sel+att P", "sel+att X", "approx P", "approx X", "sparse P", "sparse X", "quant s+a P",
         "quant s+a X", "qlogits P", "qlogits X")
  names = ("rocketkv select+attend pallas", "rocketkv select+attend xla",
           "approx chunk scores pallas", "approx chunk scores xla", "sparse attention pallas",
           "sparse attention xla", "quant select+attend pallas", "quant select+attend xla",
           "quant slot logits pallas", "quant slot logits xla")
  print(f"  {'B':>2s} {'context':>7s} {'budget':>6s} " + " ".join(f"{h:>10s}" for h in hdr))
  ctxs = sorted({r["ctx"] for r in records if r.get("kind") == "time" and "budget" in r["ctx"]
                 and r["ctx"].startswith("B")},
                key=lambda c: [int("".join(ch for ch in w if ch.isdigit()) or 0)
                               for w in c.split()])
  for c in ctxs:
    bb, ll, _, bud = c.split()
    print(f"  {bb[1:]:>2s} {ll[1:]:>7s} {bud:>6s} " + " ".join(f"{us(c, n):>10s}"
                                                            for n in names))
  print("\n== summary: dense decode attention and prefill window scores, us per call (GB/s)")
  dctx = sorted({r["ctx"] for r in records if r.get("kind") == "time"
                 and r["ctx"].startswith("B") and "budget" not in r["ctx"]},
                key=lambda c: [int(w[1:]) for w in c.split()])
  dnames = ("dense pallas decode_attention", "dense jax.nn.dot_product_attention",
            "window scores pallas (prefill)", "window scores xla (prefill)")
  for c in dctx:
    print(f"  {c}: " + "; ".join(f"{n.replace(' (prefill)', '')} {us(c, n)} us {bw(c, n)}"
                                 for n in dnames))
  tuned = [r for r in records if r.get("kind") == "time" and r["ctx"].startswith("tune")]
  if tuned:
    print(f"\n== summary: block-size variants ({tuned[0]['ctx'][5:]}), us per call")
    cells = [f"{r['name'].strip()} " + ("ERR" if "error" in r else f"{r['us']:.1f}")
             for r in tuned]
    print("  " + "; ".join(cells))
  if sweep.skipped:
    print(f"\n  skipped (past --deadline-s): {sweep.skipped}")


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
      "window_scores max": (kernels.window_scores(qw, k, length, reduce="max", interpret=True),
                            window_scores_xla(qw, k, length, "max")),
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
  p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
  p.add_argument("--budgets", type=int, nargs="+", default=[256, 1024, 4096])
  p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
  p.add_argument("--iters", type=int, default=30, help="calls per timed loop")
  p.add_argument("--check-length", type=int, default=32768,
                 help="context length of the correctness checks (window scores: prompt length)")
  p.add_argument("--check-budget", type=int, default=1024)
  p.add_argument("--skip-check", action="store_true")
  p.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS,
                 help="which correctness checks to run")
  p.add_argument("--skip-timing", action="store_true")
  p.add_argument("--deadline-s", type=float, default=1e9,
                 help="skip work that would start this many seconds after the script started")
  p.add_argument("--json", default=None, help="write every number to this file")
  p.add_argument("--peak-gbps", type=float, default=None, help="HBM peak, GB/s")
  p.add_argument("--smoke", action="store_true",
                 help="run the GPU code on CPU at tiny shapes with the kernels interpreted "
                      "(checks this script, not performance)")
  args = p.parse_args(argv)
  if args.smoke:
    args.lengths = [min(x, 512) for x in args.lengths][:1]
    args.budgets = [64]
    args.check_length, args.check_budget = min(args.check_length, 512), min(args.check_budget, 64)
    args.iters = min(args.iters, 2)
  elif jax.default_backend() != "gpu":
    print(f"benchmarks/kernel_bench.py needs a GPU (backend here: {jax.default_backend()}); "
          "running the interpret-mode correctness pass instead (or use --smoke).")
    return 0 if correctness_pass() else 1
  interpret = args.smoke
  dims = SMOKE if interpret else LLAMA
  peak = None if interpret else _peak_gbps(args.peak_gbps)
  dev = jax.devices()[0]
  print(f"jax {jax.__version__}, device {dev.device_kind} ({jax.default_backend()}), "
        f"peak HBM {peak or '?'} GB/s" + ("  [smoke: interpret mode, timings meaningless]"
                                          if interpret else ""), flush=True)
  records: list[dict] = []
  ok = True
  if not args.skip_check:
    ok = check_compiled(dims, args.check_length, args.check_budget, args.batches, interpret,
                        args.deadline_s, records, set(args.checks))
  sweep = None
  if not args.skip_timing:
    sweep = bench(dims, args, interpret, peak, records)
    tune(dims, args, interpret, sweep)
    sweep.deadline = float("inf")  # the closing floor is cheap: always measured
    sweep.row("ceiling", "empty loop iteration (end)", lambda a: a * 2,
              (jnp.ones((1024,), jnp.bfloat16),), 0)
  summary(records, sweep, peak)
  print(f"\ncorrectness: {'all ok' if ok else 'FAILURES (see above)'}; "
        f"total {_elapsed():.0f} s", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, device=dev.device_kind, argv=sys.argv[1:],
                     records=records), f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
