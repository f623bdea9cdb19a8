"""Sparse decode attention: one query token per sequence attends to `K` gathered cache rows.

Flash-decoding over the rows selected by stage 2. Grid: (batch, KV head, split). Each program
takes all G query heads of its KV head at once (padded to 16 rows for the tensor-core dot),
walks its share of the `K` slot indices in blocks of `block_k`, gathers those K/V rows straight
from the cache inside the kernel (no gathered [B, Hkv, K, D] copy in HBM) and keeps an online
softmax with fp32 running max / sum. With more than one split, the per-split (o, max, sum)
partials of the G real rows are merged in XLA (a few [B, Hkv, S, G, D] float32 ops);
padding rows of the 16-row tile are never stored.

Masked slots are encoded as index -1 (they read row 0 and are masked to -inf before the softmax);
a query whose slots are all masked gets zeros, as in `rocketkv_jax.attend.sparse_attention_xla`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rocketkv_jax._checks import require, require_rank
from rocketkv_jax.ops import group_queries

from ._util import (NEG_INF, cdiv, check_decode_qkv, compiler_params, dot_precision, next_pow2,
                    padded_dim, safe_max)

# Aim for about this many programs per call (an H200 has 132 SMs); splits are capped so each
# still has at least one block of slots.
_TARGET_PROGRAMS = 256


def gathered_attention(q, k_ref, v_ref, idx_ref, out_refs, *, rows_of, block_k: int,
                       num_blocks: int, scale: float, qk_precision, pv_precision,
                       normalize: bool, group: int):
  """One program's flash-decoding over the slots of idx_ref [Ks] (-1: masked), `block_k` at a
  time: q [Gp, Dp]; `rows_of(slots [bk]) -> rows [bk]` of k_ref, v_ref to gather (the paged
  kernel maps slots through its page table). Writes the normalised output, or the unnormalised
  (o, m, l) of a split; only the `group` real query rows (masked stores)."""
  gp, dp = q.shape

  def body(i, carry):
    o, m, l = carry
    ids = idx_ref[pl.ds(i * block_k, block_k)]  # [bk]
    ok = ids >= 0
    rows = rows_of(jnp.maximum(ids, 0))
    kb = k_ref[rows].astype(q.dtype)  # [bk, Dp] gathered rows
    vb = v_ref[rows]
    s = plgpu.dot(q, kb, trans_b=True, precision=qk_precision) * scale  # [Gp, bk] float32
    s = jnp.where(ok[None, :], s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = safe_max(m_new)
    corr = jnp.exp(m - m_use)
    p = jnp.exp(s - m_use[:, None])
    l = corr * l + jnp.sum(p, axis=1)
    o = corr[:, None] * o + plgpu.dot(p.astype(vb.dtype), vb, precision=pv_precision)
    return o, m_new, l

  o = jnp.zeros((gp, dp), jnp.float32)
  m = jnp.full((gp,), NEG_INF, jnp.float32)
  l = jnp.zeros((gp,), jnp.float32)
  o, m, l = lax.fori_loop(0, num_blocks, body, (o, m, l))
  real = jnp.arange(gp) < group
  if normalize:  # single split: write the final output
    (o_ref,) = out_refs
    out = (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
    plgpu.store(o_ref, out, mask=real[:, None])
  else:
    o_ref, m_ref, l_ref = out_refs
    plgpu.store(o_ref, o, mask=real[:, None])
    plgpu.store(m_ref, m, mask=real)
    plgpu.store(l_ref, l, mask=real)


def split_outputs(b: int, hkv: int, ns: int, gp: int, dp: int, dtype):
  """(out_shape, out_specs) of a grid (B, Hkv, S) of `gathered_attention` programs: with one
  split the output [B, Hkv, Gp, Dp]; with S > 1 the partials o [B, Hkv, S, Gp, Dp] and m, l
  [B, Hkv, S, Gp] in float32 (`merge_splits`)."""
  if ns == 1:
    return ([jax.ShapeDtypeStruct((b, hkv, gp, dp), dtype)],
            [pl.BlockSpec((None, None, gp, dp), lambda i, h, s: (i, h, 0, 0))])
  return ([jax.ShapeDtypeStruct((b, hkv, ns, gp, dp), jnp.float32),
           jax.ShapeDtypeStruct((b, hkv, ns, gp), jnp.float32),
           jax.ShapeDtypeStruct((b, hkv, ns, gp), jnp.float32)],
          [pl.BlockSpec((None, None, None, gp, dp), lambda i, h, s: (i, h, s, 0, 0)),
           pl.BlockSpec((None, None, None, gp), lambda i, h, s: (i, h, s, 0)),
           pl.BlockSpec((None, None, None, gp), lambda i, h, s: (i, h, s, 0))])


def merge_splits(outs, g: int, d: int, dtype) -> jax.Array:
  """The outputs of `split_outputs` -> [B, Hkv, G, D] in `dtype`: the one split sliced, or the
  split-K partials merged (rows past G were never written: sliced off first)."""
  if len(outs) == 1:
    return outs[0][:, :, :g, :d]
  o, m, l = outs[0][:, :, :, :g, :d], outs[1][..., :g], outs[2][..., :g]
  # Barrier as in jax's decode_attention: keep the max materialised before exp(m - max).
  mx = lax.optimization_barrier(jnp.max(m, axis=2, keepdims=True))
  w = jnp.exp(m - jnp.where(jnp.isfinite(mx), mx, 0.0))  # [B, Hkv, S, G]
  denom = jnp.maximum(jnp.sum(w * l, axis=2), 1e-30)
  return (jnp.sum(w[..., None] * o, axis=2) / denom[..., None]).astype(dtype)


def _kernel(q_ref, k_ref, v_ref, idx_ref, *out_refs, block_k: int, num_blocks: int,
            scale: float, qk_precision, pv_precision, normalize: bool, group: int):
  """q_ref [Gp, Dp]; k_ref, v_ref [C, Dp] (this KV head's whole cache); idx_ref [Ks]."""
  gathered_attention(q_ref[...], k_ref, v_ref, idx_ref, out_refs, rows_of=lambda slot: slot,
                     block_k=block_k, num_blocks=num_blocks, scale=scale,
                     qk_precision=qk_precision, pv_precision=pv_precision,
                     normalize=normalize, group=group)


def _check(q, k, v, idx, valid):
  b, hkv, c, d = check_decode_qkv(q, k, v)
  require_rank("idx", idx, 3, "[B, Hkv, K]")
  require(idx.shape[:2] == (b, hkv) and idx.shape[2] >= 1,
        f"idx must have shape [B={b}, Hkv={hkv}, K>=1], got {idx.shape}")
  require(valid.shape == idx.shape, f"valid must have idx's shape {idx.shape}, got {valid.shape}")
  require(jnp.issubdtype(idx.dtype, jnp.integer), f"idx must be integer, got {idx.dtype}")
  require(c >= 1, "the cache must have at least one slot")
  for name, x in (("q", q), ("k", k), ("v", v)):
    require(jnp.issubdtype(x.dtype, jnp.floating), f"{name} must be floating, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "num_splits", "num_warps",
                                             "num_stages"))
def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, idx: jax.Array, valid: jax.Array,
                     *, interpret: bool = False, block_k: int = 32, num_splits: int | None = None,
                     num_warps: int = 4, num_stages: int = 2) -> jax.Array:
  """Exact softmax attention of one decode query over gathered cache rows.

  Args:
    q: [B, Hq, D] query (Hq = G * Hkv).
    k, v: [B, Hkv, C, D] cache keys / values (bf16 or fp32).
    idx: [B, Hkv, K] int32 slot indices, already clipped into [0, C).
    valid: [B, Hkv, K] bool; masked slots contribute nothing.
    interpret: run the kernel in Pallas interpret mode (CPU testing).
    block_k: slots gathered per inner step (power of two >= 16).
    num_splits: split-K partitions per (batch, KV head); None picks one from the grid size.
    num_warps, num_stages: Triton launch parameters.
  Returns:
    [B, Hq, D] in q's dtype, softmax scale 1/sqrt(D), fp32 accumulation; zeros for a query
    with no valid slot. Equals `rocketkv_jax.attend.sparse_attention_xla`.
  """
  _check(q, k, v, idx, valid)
  require(block_k >= 16 and block_k == next_pow2(block_k),
        f"block_k must be a power of two >= 16, got {block_k}")
  b, hq, d = q.shape
  hkv, c = k.shape[1], k.shape[2]
  kk = idx.shape[2]
  g = hq // hkv
  gp, dp = padded_dim(g), padded_dim(d)
  cdt = jnp.promote_types(q.dtype, k.dtype)

  qg = group_queries(q, hkv).astype(cdt)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, dp - d)))
  if dp != d:  # head dim not a power of two >= 16: padded copy of the cache (slow path)
    pad = ((0, 0), (0, 0), (0, 0), (0, dp - d))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)

  bk = max(16, min(block_k, next_pow2(kk)))
  if num_splits is None:
    num_splits = cdiv(_TARGET_PROGRAMS, b * hkv)
  ns = max(1, min(num_splits, cdiv(kk, bk)))
  ks = cdiv(cdiv(kk, ns), bk) * bk  # slots per split, a multiple of bk
  ns = cdiv(kk, ks)
  enc = jnp.where(valid, idx.astype(jnp.int32), -1)
  enc = jnp.pad(enc, ((0, 0), (0, 0), (0, ns * ks - kk)), constant_values=-1)
  enc = enc.reshape(b, hkv, ns, ks)

  normalize = ns == 1
  kernel = functools.partial(
      _kernel, block_k=bk, num_blocks=ks // bk, scale=1.0 / math.sqrt(d),
      qk_precision=dot_precision(cdt), pv_precision=dot_precision(v.dtype), normalize=normalize,
      group=g)
  kv_spec = pl.BlockSpec((None, None, c, dp), lambda i, h, s: (i, h, 0, 0))
  in_specs = [pl.BlockSpec((None, None, gp, dp), lambda i, h, s: (i, h, 0, 0)), kv_spec, kv_spec,
              pl.BlockSpec((None, None, None, ks), lambda i, h, s: (i, h, s, 0))]
  out_shape, out_specs = split_outputs(b, hkv, ns, gp, dp, q.dtype)
  outs = pl.pallas_call(
      kernel, grid=(b, hkv, ns), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
      name="rocketkv_sparse_attention",
  )(qg, k, v, enc)
  return merge_splits(outs, g, d, q.dtype).reshape(b, hq, d)
