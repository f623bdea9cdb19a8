"""The smallest reproducers of where XLA:CPU runs a decode step above its floor (issue #40).

Each row times one kind of op the decode step is made of, over many separate buffers (so that
the reads come from memory, as in a step, not from a cache that one buffer would fit in), next
to a plain jitted sum over the same bytes (what reading them costs here):

    skinny matmul   [M, D] x `--layers` separate [D, F] weights, M = the decode batch: the
                    projections and the MLP at batch M (SmolLM2: D 576, F 1536)
    dense attention [B, Hkv, G, D] queries over separate [B, Hkv, C, D] K and V caches: the
                    two batched products of full-KV decode attention
    top-k           lax.top_k of k = 128 over [rows, N] scores (stage 2's selection), and
                    NumPy's one-thread partial selection of the same scores
    row gather      k rows of D floats per (sequence, KV head) out of separate [B, Hkv, C, D]
                    caches, at random slots (the quant variant's tokens) and in runs of 3
                    (minmax's chunks), and NumPy's one-thread row copy of the same random rows
    prefill         one layer's weight products at M = the prompt, and its blockwise causal
                    attention (models/attention.py), in GFLOP/s next to a square matmul's

    python benchmarks/xla_cpu_gaps.py                  # SmolLM2's shapes; ~1 minute
    python benchmarks/xla_cpu_gaps.py --quick          # tiny shapes: the tool's logic only
    XLA_FLAGS=--xla_cpu_use_xnnpack=true python benchmarks/xla_cpu_gaps.py   # a flag's effect

Results and what they mean: docs/roofline.md, "Where the gaps go".
"""

from __future__ import annotations

import argparse
import sys

import bench_common


def _buffers(shape, n, seed):
  import jax
  import jax.numpy as jnp

  return [jax.random.normal(jax.random.PRNGKey(seed + i), shape, jnp.float32) for i in range(n)]


def _read_s(bufs, repeats):
  """Seconds to read every buffer once (a jitted sum of each)."""
  import jax
  import jax.numpy as jnp

  return bench_common.time_calls(jax.jit(lambda xs: [jnp.sum(x) for x in xs]), bufs,
                                 repeats=repeats).median


def skinny_matmul_rows(d, f, layers, batches, repeats):
  """Per batch M: the weights' GB/s when multiplied at M rows (layout [D, F] and [F, D])."""
  import jax
  import jax.numpy as jnp

  kn = _buffers((d, f), layers, 0)
  nk = [jnp.asarray(w.T) for w in kn]
  gb = sum(w.nbytes for w in kn) / 1e9
  read = gb / _read_s(kn, repeats)

  def chain(fmt):
    def run(x, ws):
      for w in ws:  # each product feeds the next: XLA cannot merge or reorder them
        y = x @ w if fmt == "kn" else jnp.einsum("md,fd->mf", x, w)
        x = x + 1e-3 * y[:, :d]
      return x
    return jax.jit(run)

  rows = []
  for m in batches:
    x = jax.random.normal(jax.random.PRNGKey(99), (m, d), jnp.float32)
    for fmt, ws in (("[D, F]", kn), ("[F, D]", nk)):
      s = bench_common.time_calls(chain("kn" if ws is kn else "nk"), x, ws, repeats=repeats).median
      rows.append((f"matmul [{m}, {d}] x {layers} weights {fmt}", s, gb / s, read))
  return rows


def attention_rows(batch, hkv, g, c, d, layers, repeats):
  """Dense decode attention (scores, softmax, values) over `layers` separate caches."""
  import jax
  import jax.numpy as jnp

  ks, vs = _buffers((batch, hkv, c, d), layers, 0), _buffers((batch, hkv, c, d), layers, 100)
  gb = 2 * sum(k.nbytes for k in ks) / 1e9
  read = gb / _read_s(ks + vs, repeats)

  def run(q, ks, vs):
    for k, v in zip(ks, vs):
      s = jnp.einsum("bhgd,bhcd->bhgc", q, k) / jnp.sqrt(jnp.float32(d))
      p = jnp.exp(s - jnp.max(s, -1, keepdims=True))
      out = jnp.einsum("bhgc,bhcd->bhgd", p, v) / jnp.sum(p, -1, keepdims=True)
      q = q + 1e-3 * out
    return q

  q = jax.random.normal(jax.random.PRNGKey(7), (batch, hkv, g, d), jnp.float32)
  s = bench_common.time_calls(jax.jit(run), q, ks, vs, repeats=repeats).median
  return [(f"dense attention B={batch} Hkv={hkv} G={g} C={c} D={d} x {layers} layers", s,
           gb / s, read)]


def topk_rows(rows, n, k, layers, repeats):
  """lax.top_k over `layers` separate [rows, n] score arrays, next to NumPy's partial selection
  (argpartition, then the k sorted; one thread) of the same arrays."""
  import jax
  import numpy as np
  from jax import lax

  xs = _buffers((rows, n), layers, 0)
  s = bench_common.time_calls(jax.jit(lambda xs: [lax.top_k(x, k)[1] for x in xs]), xs,
                              repeats=repeats).median
  host = [np.asarray(x) for x in xs]

  def partial():
    out = []
    for x in host:
      part = np.argpartition(-x, k - 1, axis=1)[:, :k]
      order = np.argsort(-np.take_along_axis(x, part, 1), axis=1, kind="stable")
      out.append(np.take_along_axis(part, order, 1))
    return out

  s_np = bench_common.time_calls(partial, repeats=repeats).median
  return [(f"top_k k={k} of [{rows}, {n}] x {layers}", s, None, None),
          ("NumPy argpartition + sort of the k, one thread (the same scores)", s_np, None, None)]


def gather_rows(batch, hkv, c, d, k, layers, repeats):
  """`ops.gather_rows` of k slots per (sequence, KV head) from `layers` separate caches: the
  gathered bytes' GB/s at random slots, in runs of 3, and by NumPy's row copy (one thread)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from rocketkv_jax.ops import gather_rows as gather

  ks = _buffers((batch, hkv, c, d), layers, 0)
  gb = layers * batch * hkv * k * d * 4 / 1e9
  read = sum(x.nbytes for x in ks) / 1e9 / _read_s(ks, repeats)
  rng = np.random.default_rng(0)
  scattered = rng.integers(0, c, (batch, hkv, k))
  runs = (rng.integers(0, c // 3, (batch, hkv, -(-k // 3)))[..., None] * 3 + np.arange(3))
  fn = jax.jit(lambda xs, i: [gather(x, i) for x in xs])
  rows = []
  runs = runs.reshape(batch, hkv, -1)[..., :k]
  for what, idx in (("random slots", scattered), ("runs of 3 slots", runs)):
    s = bench_common.time_calls(fn, ks, jnp.asarray(idx, jnp.int32), repeats=repeats).median
    rows.append((f"row gather {what}, {batch * hkv} x {k} rows of {d} x {layers}", s, gb / s, read))
  flat = (np.arange(batch * hkv).reshape(batch, hkv, 1) * c + scattered).ravel()
  host = [np.asarray(x).reshape(-1, d) for x in ks]
  out = np.empty((flat.size, d), np.float32)
  copy = lambda: [np.take(x, flat, axis=0, out=out) for x in host]
  s = bench_common.time_calls(copy, repeats=repeats).median
  rows.append(("NumPy row copy, random slots, one thread (the same rows)", s, gb / s, read))
  return rows


def prefill_rows(n, d, f, hq, hkv, dh, repeats, square=2048):
  """One prefill layer's parts at an n-token prompt: (name, s, GFLOP/s, the square matmul's)."""
  import jax

  from rocketkv_jax.models.attention import blockwise_causal_attention

  sq = _buffers((square, square), 1, 5)[0]
  square_s = bench_common.time_calls(jax.jit(lambda a: a @ a), sq, repeats=repeats).median
  ref = 2 * square ** 3 / 1e9 / square_s
  shapes = {"q, o": [(d, hq * dh), (hq * dh, d)], "k, v": [(d, hkv * dh)] * 2,
            "gate, up": [(d, f)] * 2, "down": [(f, d)]}
  rows = []
  for name, shp in shapes.items():
    ws = [_buffers(w, 1, 8 + i)[0] for i, w in enumerate(shp)]
    xs = [_buffers((n, w[0]), 1, 16 + i)[0] for i, w in enumerate(shp)]  # [n, K] inputs
    s = bench_common.time_calls(jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)]), xs,
                                ws, repeats=repeats).median
    gf = sum(2 * n * k * m for k, m in shp) / 1e9
    rows.append((f"prefill products {name}: [{n}, K] x "
                 + ", ".join(f"[{k}, {m}]" for k, m in shp), s, gf / s, ref))
  q = _buffers((1, hq, n, dh), 1, 20)[0]
  k, v = _buffers((1, hkv, n, dh), 2, 21)
  s = bench_common.time_calls(jax.jit(lambda q, k, v: blockwise_causal_attention(q, k, v)), q,
                              k, v, repeats=repeats).median
  gf = 4 * hq * dh * n * (n + 1) / 2 / 1e9  # QK^T and PV over the causal pairs, once
  rows.append((f"prefill attention, causal, {hq}/{hkv} heads x {dh}, {n} tokens", s, gf / s,
               ref))
  return rows


def _parser():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="tiny shapes (CI: the logic only)")
  p.add_argument("--repeats", type=int, default=10)
  return p


def _rate(x: float) -> str:
  """A rate to 3 significant digits (--quick's are tiny), so the ratio beside it can be checked."""
  return f"{x:.1f}" if x >= 100 else f"{x:.3g}"


def main(argv=None) -> int:
  a = _parser().parse_args(argv)
  if a.repeats < 1:
    print("error: --repeats must be >= 1", file=sys.stderr)
    return 2
  import jax

  if a.quick:
    d, f, layers, batches, c = 32, 64, 3, (1, 4), 64
    att, topk, gat = (2, 2, 2, c, 16, 2), (4, 64, 8, 2), (2, 2, c, 16, 8, 2)
    pre = (128, d, f, 4, 2, 16, a.repeats, 128)
  else:  # SmolLM2-135M: D 576, FFN 1536, 30 layers; 3 KV heads of 64 dims, G = 3
    d, f, layers, batches, c = 576, 1536, 30, (1, 8, 16), 4032
    att, topk = (8, 3, 3, c, 64, 10), (24, 1596, 128, 30)
    gat = (8, 3, 1596, 64, 128, 60)  # K and V of 30 layers: the quant variant's capacity, top_k
    pre = (4000, d, f, 9, 3, 64, a.repeats)
  rows = skinny_matmul_rows(d, f, layers, batches, a.repeats)
  rows += attention_rows(1, *att[1:], a.repeats) + attention_rows(*att, a.repeats)
  rows += topk_rows(*topk, a.repeats) + gather_rows(*gat, a.repeats)
  flops = prefill_rows(*pre)
  print(f"jax {jax.__version__}, {jax.default_backend()}, {jax.device_count()} device(s)")
  print("| op | ms | GB/s of its operands | GB/s of a plain read of them | ratio |")
  print("|---|---:|---:|---:|---:|")
  for name, s, gbs, read in rows:
    if gbs is None:
      print(f"| {name} | {1e3 * s:.2f} | - | - | - |")
    else:
      print(f"| {name} | {1e3 * s:.2f} | {_rate(gbs)} | {_rate(read)} | {read / gbs:.3g}x |")
  print(f"\n| prefill op (one layer) | ms | GFLOP/s | GFLOP/s of a {pre[-1] if a.quick else 2048}^3 "
        "matmul | ratio |")
  print("|---|---:|---:|---:|---:|")
  for name, s, rate, ref in flops:
    print(f"| {name} | {1e3 * s:.2f} | {_rate(rate)} | {_rate(ref)} | {ref / rate:.3g}x |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
