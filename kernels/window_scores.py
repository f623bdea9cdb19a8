"""SnapKV window scores: attention mass each prompt key receives from the last W queries.

Summed over the window and the group (`reduce="sum"`, SnapKV and the paper) or their largest
probability (`reduce="max"`, `RocketConfig.window_reduce`).

The W window queries of the G heads of one KV head are flattened into G*W rows (padded to a
power of two >= 16, tiled by `block_m` rows). Two Pallas passes over the keys, each split along
L across programs so a 128K prompt keeps the GPU busy, and neither ever holds the whole
[rows, L] score matrix:

1. row statistics: grid (batch, KV head, row block, L split); online max / sum of the causal,
   length-masked logits over the split's keys; the splits' partials are merged in XLA;
2. column sums (or maxima): same grid; recompute each [block_m, block_l] logit tile, normalise
   with the merged row max / sum and sum (max) over rows into the [L] output; row blocks are
   summed (maxed) in XLA. Padded rows have probability 0, so they change neither.

Query row r is window step w = r % W of group head r // W at position lengths - W + w; it sees
keys at positions <= its own and < lengths. Keys at or past lengths score 0.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rocketkv_jax._checks import group_size, require, require_rank
from rocketkv_jax.ops import WINDOW_REDUCE

from ._util import (NEG_INF, cdiv, compiler_params, dot_precision, next_pow2, padded_dim,
                    safe_max)

_TARGET_PROGRAMS = 256


def _logits(q, k_ref, start, n, rb, *, window: int, rows: int, block_l: int, scale: float,
            precision):
  """Masked logits [bm, bl] of query rows (row block rb) against keys [start, start + bl)."""
  bm = q.shape[0]
  kpos = start + jnp.arange(block_l)
  kb = plgpu.load(k_ref.at[pl.ds(start, block_l), :], mask=(kpos < n)[:, None], other=0)
  s = plgpu.dot(q, kb.astype(q.dtype), trans_b=True, precision=precision) * scale
  r = rb * bm + jnp.arange(bm)
  qpos = n - window + r % window
  ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < n) & (r < rows)[:, None]
  return jnp.where(ok, s, NEG_INF)


def _stats_kernel(len_ref, q_ref, k_ref, m_ref, l_ref, *, split_len: int, **kw):
  """q [bm, Dp], k [L, Dp] -> this split's row max / sum [bm]."""
  rb, sp = pl.program_id(2), pl.program_id(3)
  n = len_ref[()]
  q = q_ref[...]
  bl = kw["block_l"]
  start0 = sp * split_len
  nblk = jnp.clip((n - start0 + bl - 1) // bl, 0, split_len // bl)

  def body(i, carry):
    m, l = carry
    s = _logits(q, k_ref, start0 + i * bl, n, rb, **kw)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = safe_max(m_new)
    l = jnp.exp(m - m_use) * l + jnp.sum(jnp.exp(s - m_use[:, None]), axis=1)
    return m_new, l

  bm = q.shape[0]
  m, l = lax.fori_loop(0, nblk, body, (jnp.full((bm,), NEG_INF, jnp.float32),
                                       jnp.zeros((bm,), jnp.float32)))
  m_ref[...] = m
  l_ref[...] = l


def _colsum_kernel(len_ref, q_ref, k_ref, m_ref, l_ref, o_ref, *, split_len: int, reduce: str,
                   **kw):
  """q [bm, Dp], k [L, Dp], merged m / l [bm] -> column sums (maxima) o [split_len]."""
  rb, sp = pl.program_id(2), pl.program_id(3)
  n = len_ref[()]
  q = q_ref[...]
  m_use = safe_max(m_ref[...])
  inv_l = 1.0 / jnp.maximum(l_ref[...], 1e-30)
  bl = kw["block_l"]
  start0 = sp * split_len
  nblk = jnp.clip((n - start0 + bl - 1) // bl, 0, split_len // bl)

  def body(i, carry):
    s = _logits(q, k_ref, start0 + i * bl, n, rb, **kw)
    p = jnp.exp(s - m_use[:, None]) * inv_l[:, None]
    o_ref[pl.ds(i * bl, bl)] = (jnp.max if reduce == "max" else jnp.sum)(p, axis=0)
    return carry

  def zeros(i, carry):
    o_ref[pl.ds(i * bl, bl)] = jnp.zeros((bl,), jnp.float32)
    return carry

  lax.fori_loop(0, nblk, body, 0)
  lax.fori_loop(nblk, split_len // bl, zeros, 0)


def _check(q_window, k, lengths):
  require_rank("q_window", q_window, 4, "[B, Hq, W, D]")
  require_rank("k", k, 4, "[B, Hkv, L, D]")
  b, hkv, l, d = k.shape
  require(q_window.shape[0] == b and q_window.shape[3] == d,
        f"q_window must have shape [B={b}, Hq, W, D={d}], got {q_window.shape}")
  group_size(q_window.shape[1], hkv, "q_window")
  require(1 <= q_window.shape[2] <= l, f"window W={q_window.shape[2]} must be in [1, L={l}]")
  require(getattr(lengths, "shape", None) == (b,),
        f"lengths must have shape [B]={(b,)}, got {getattr(lengths, 'shape', None)}")
  for name, x in (("q_window", q_window), ("k", k)):
    require(jnp.issubdtype(x.dtype, jnp.floating), f"{name} must be floating, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("reduce", "interpret", "block_m", "block_l",
                                             "num_splits", "num_warps", "num_stages"))
def window_scores(q_window: jax.Array, k: jax.Array, lengths: jax.Array, *, reduce: str = "sum",
                  interpret: bool = False, block_m: int = 128, block_l: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None,
                  num_stages: int = 2) -> jax.Array:
  """Window-to-key attention mass, summed (or maxed) over the window and the group.

  Args:
    q_window: [B, Hq, W, D] the last W valid queries of each sequence (post-RoPE).
    k: [B, Hkv, L, D] keys (post-RoPE), right-padded.
    lengths: [B] int32 valid prompt lengths.
    reduce: "sum" | "max" over the W queries and the G heads of the group.
    interpret: run the kernels in Pallas interpret mode (CPU testing).
    block_m: query rows per tile (power of two >= 16); G*W rows are tiled by it.
    block_l: keys per tile (power of two >= 16); None: 8192 // block_m, clamped to [16, 64]
      (a [block_m, block_l] fp32 logit tile stays in registers).
    num_splits: programs along L per (batch, KV head, row block); None picks one.
    num_warps: Triton warps; None: 4, or 8 for tiles of more than 4096 logits.
    num_stages: Triton software-pipelining stages.
  Returns:
    [B, Hkv, L] float32, 0 at padding. Equals `rocketkv_jax.evict.window_scores_xla` with the
    same `reduce`.
  """
  _check(q_window, k, lengths)
  require(reduce in WINDOW_REDUCE, f"reduce must be one of {list(WINDOW_REDUCE)}, got {reduce!r}")
  b, hq, w, d = q_window.shape
  hkv, l = k.shape[1], k.shape[2]
  g = hq // hkv
  rows = g * w
  mp, dp = padded_dim(rows), padded_dim(d)
  bm = min(mp, max(16, next_pow2(block_m)))
  nrb = mp // bm
  if block_l is None:
    block_l = max(16, min(64, 8192 // bm))
  bl = max(16, min(next_pow2(block_l), next_pow2(l)))
  if num_warps is None:
    num_warps = 8 if bm * bl > 4096 else 4
  nlb = cdiv(l, bl)
  if num_splits is None:
    num_splits = cdiv(_TARGET_PROGRAMS, b * hkv * nrb)
  ns = max(1, min(num_splits, nlb))
  split_len = cdiv(nlb, ns) * bl
  ns = cdiv(l, split_len)

  cdt = jnp.promote_types(q_window.dtype, k.dtype)
  q = q_window.reshape(b, hkv, rows, d).astype(cdt)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, mp - rows), (0, dp - d)))
  if dp != d:  # head dim not a power of two >= 16: padded copy of the keys (slow path)
    k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, dp - d)))
  lengths = lengths.astype(jnp.int32)

  kw = dict(split_len=split_len, window=w, rows=rows, block_l=bl, scale=1.0 / math.sqrt(d),
            precision=dot_precision(cdt))
  grid = (b, hkv, nrb, ns)
  len_spec = pl.BlockSpec((None,), lambda i, h, rb, s: (i,))
  q_spec = pl.BlockSpec((None, None, bm, dp), lambda i, h, rb, s: (i, h, rb, 0))
  k_spec = pl.BlockSpec((None, None, l, dp), lambda i, h, rb, s: (i, h, 0, 0))
  part_spec = pl.BlockSpec((None, None, None, None, bm), lambda i, h, rb, s: (i, h, s, rb, 0))
  params = compiler_params(num_warps, num_stages)
  part = jax.ShapeDtypeStruct((b, hkv, ns, nrb, bm), jnp.float32)
  m, lsum = pl.pallas_call(
      functools.partial(_stats_kernel, **kw), grid=grid,
      in_specs=[len_spec, q_spec, k_spec], out_specs=[part_spec, part_spec],
      out_shape=[part, part], compiler_params=params, interpret=interpret,
      name="rocketkv_window_row_stats",
  )(lengths, q, k)
  mx = jnp.max(m, axis=2)  # merge the L splits: [B, Hkv, nrb, bm]
  lsum = jnp.sum(lsum * jnp.exp(m - safe_max(mx)[:, :, None]), axis=2)

  stat_spec = pl.BlockSpec((None, None, None, bm), lambda i, h, rb, s: (i, h, rb, 0))
  out = pl.pallas_call(
      functools.partial(_colsum_kernel, reduce=reduce, **kw), grid=grid,
      in_specs=[len_spec, q_spec, k_spec, stat_spec, stat_spec],
      out_specs=pl.BlockSpec((None, None, None, split_len), lambda i, h, rb, s: (i, h, rb, s)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, nrb, ns * split_len), jnp.float32),
      compiler_params=params, interpret=interpret, name="rocketkv_window_col_sums",
  )(lengths, q, k, mx, lsum)
  return (jnp.max if reduce == "max" else jnp.sum)(out, axis=2)[:, :, :l]
