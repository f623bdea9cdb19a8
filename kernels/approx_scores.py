"""RocketKV / SparQ approximate chunk scores from the per-chunk key min / max summaries.

Per KV head (G query heads in its group): keep the `r` head dims with the largest |q| summed
over the group; per kept dim take the chunk's kmax where the group-summed q is positive, else
its kmin; logit = q_r . k_bound_r scaled by 1/sqrt(D * sum|q_r| / sum|q|) per query head;
softmax over the valid chunks per query head; sum over the group.

The summaries come in the cache's layout, `bounds [B, Hkv, 2D, NC]` (kmin rows, then kmax rows,
see `rocketkv_jax.cache`). The top-r dims are picked in XLA (`lax.top_k` over [B, Hkv, D], tiny)
and folded into two zero-masked queries, q_hi (kept dims where the sign picks kmax) and q_lo
(the others), so the kernel computes q_hi . kmax + q_lo . kmin with two dense [G, D] x [D, bc]
dots on column blocks of the bounds. Grid: (batch, KV head); the chunk axis is walked in blocks
twice (online max / sum, then the normalised, group-summed scores), so no [G, NC] matrix is ever
held whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rocketkv_jax._checks import group_size, require, require_rank
from rocketkv_jax.ops import approx_scale, group_queries, top_r_dims

from ._util import (NEG_INF, cdiv, compiler_params, dot_precision, next_pow2, padded_dim,
                    safe_max)


def _kernel(len_ref, qhi_ref, qlo_ref, scale_ref, b_ref, o_ref, *, chunk_size: int,
            num_chunks: int, group: int, block_c: int):
  """qhi/qlo [Gp, Dp] f32, scale [Gp], bounds [2Dp, NC] (kmin rows, kmax rows), o [NCp] f32."""
  qhi = qhi_ref[...]
  qlo = qlo_ref[...]
  scale = scale_ref[...]
  gp, dp = qhi.shape
  n_valid = jnp.minimum(cdiv_dyn(len_ref[()], chunk_size), num_chunks)  # chunks with a slot
  row_ok = jnp.arange(gp) < group
  prec = dot_precision(jnp.float32)

  def logits(i):
    cpos = i * block_c + jnp.arange(block_c)
    ok = cpos < n_valid
    cols = pl.ds(i * block_c, block_c)
    kmn = plgpu.load(b_ref.at[pl.ds(0, dp), cols], mask=ok[None, :], other=0)
    kmx = plgpu.load(b_ref.at[pl.ds(dp, dp), cols], mask=ok[None, :], other=0)
    s = (plgpu.dot(qhi, kmx.astype(jnp.float32), precision=prec)
         + plgpu.dot(qlo, kmn.astype(jnp.float32), precision=prec)) * scale[:, None]  # [Gp, bc]
    return jnp.where(ok[None, :], s, NEG_INF), ok

  def stats(i, carry):
    m, l = carry
    s, _ = logits(i)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = safe_max(m_new)
    l = jnp.exp(m - m_use) * l + jnp.sum(jnp.exp(s - m_use[:, None]), axis=1)
    return m_new, l

  m = jnp.full((gp,), NEG_INF, jnp.float32)
  l = jnp.zeros((gp,), jnp.float32)
  m, l = lax.fori_loop(0, cdiv_dyn(n_valid, block_c), stats, (m, l))
  m_use = safe_max(m)
  inv_l = jnp.where(row_ok, 1.0 / jnp.maximum(l, 1e-30), 0.0)

  def write(i, carry):
    s, ok = logits(i)
    p = jnp.exp(s - m_use[:, None]) * inv_l[:, None]
    o_ref[pl.ds(i * block_c, block_c)] = jnp.where(ok, jnp.sum(p, axis=0), 0.0)
    return carry

  lax.fori_loop(0, o_ref.shape[0] // block_c, write, 0)


def cdiv_dyn(a, b: int):
  """ceil(a / b) for a traced non-negative int and a static positive int."""
  return (a + (b - 1)) // b


def _check(q, bounds, length, chunk_size, r):
  require_rank("q", q, 3, "[B, Hq, D]")
  require_rank("bounds", bounds, 4, "[B, Hkv, 2D, NC]")
  b, hkv, d2, nc = bounds.shape
  d = q.shape[2]
  require(q.shape[0] == b and d2 == 2 * d,
        f"q [B, Hq, D] and bounds [B, Hkv, 2D, NC] disagree: {q.shape} and {bounds.shape}")
  group_size(q.shape[1], hkv, "q")
  require(getattr(length, "shape", None) == (b,),
        f"length must have shape [B]={(b,)}, got {getattr(length, 'shape', None)}")
  require(isinstance(chunk_size, int) and chunk_size >= 1,
        f"chunk_size must be an int >= 1, got {chunk_size!r}")
  require(isinstance(r, int) and 1 <= r <= d, f"r must be an int in [1, D={d}], got {r!r}")
  require(nc >= 1, "the bounds must hold at least one chunk")


@functools.partial(jax.jit, static_argnames=("chunk_size", "r", "interpret", "block_c",
                                             "num_warps", "num_stages"))
def approx_bounds_scores(q: jax.Array, bounds: jax.Array, length: jax.Array, *,
                         chunk_size: int, r: int, interpret: bool = False, block_c: int = 64,
                         num_warps: int = 4, num_stages: int = 2) -> jax.Array:
  """Group-summed softmax of RocketKV's approximate chunk logits.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    bounds: [B, Hkv, 2D, NC] per-chunk key min rows then max rows (`KVCache.bounds`; bf16 or
      fp32).
    length: [B] int32 valid slots; chunk c is valid when c * chunk_size < length.
    chunk_size: slots per chunk (static).
    r: head dims kept (static).
    interpret: run the kernel in Pallas interpret mode (CPU testing).
    block_c: chunks per inner step (power of two >= 16).
    num_warps, num_stages: Triton launch parameters.
  Returns:
    [B, Hkv, NC] float32; 0 for chunks with no valid slot. Equals
    `rocketkv_jax.select.approx_chunk_scores_xla`.
  """
  _check(q, bounds, length, chunk_size, r)
  require(block_c >= 16 and block_c == next_pow2(block_c),
        f"block_c must be a power of two >= 16, got {block_c}")
  b, hq, d = q.shape
  hkv, nc = bounds.shape[1], bounds.shape[3]
  g = hq // hkv
  gp, dp = padded_dim(g), padded_dim(d)

  qg = group_queries(q, hkv).astype(jnp.float32)
  ridx, positive = top_r_dims(qg, r)  # [B, Hkv, r], [B, Hkv, D]
  keep = jnp.any(ridx[..., None] == jnp.arange(d), axis=2)[:, :, None, :]  # [B, Hkv, 1, D]
  hi = positive[:, :, None, :]
  q_r = jnp.where(keep, qg, 0.0)
  scale = approx_scale(q_r, qg)  # [B, Hkv, G]
  pad_q = ((0, 0), (0, 0), (0, gp - g), (0, dp - d))
  q_hi = jnp.pad(jnp.where(hi, q_r, 0.0), pad_q)
  q_lo = jnp.pad(jnp.where(hi, 0.0, q_r), pad_q)
  scale = jnp.pad(scale, ((0, 0), (0, 0), (0, gp - g)))
  if dp != d:  # head dim not a power of two >= 16: padded copy of the summaries
    pad = ((0, 0), (0, 0), (0, dp - d), (0, 0))
    bounds = jnp.concatenate([jnp.pad(bounds[:, :, :d], pad), jnp.pad(bounds[:, :, d:], pad)],
                             axis=2)

  bc = max(16, min(block_c, next_pow2(nc)))
  ncp = cdiv(nc, bc) * bc
  kernel = functools.partial(_kernel, chunk_size=chunk_size, num_chunks=nc, group=g, block_c=bc)
  q_spec = pl.BlockSpec((None, None, gp, dp), lambda i, h: (i, h, 0, 0))
  b_spec = pl.BlockSpec((None, None, 2 * dp, nc), lambda i, h: (i, h, 0, 0))
  out = pl.pallas_call(
      kernel, grid=(b, hkv),
      in_specs=[pl.BlockSpec((None,), lambda i, h: (i,)), q_spec, q_spec,
                pl.BlockSpec((None, None, gp), lambda i, h: (i, h, 0)), b_spec],
      out_specs=pl.BlockSpec((None, None, ncp), lambda i, h: (i, h, 0)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, ncp), jnp.float32),
      compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
      name="rocketkv_approx_chunk_scores",
  )(length.astype(jnp.int32), q_hi, q_lo, scale, bounds)
  return out[:, :, :nc]


def approx_chunk_scores(q: jax.Array, kmin: jax.Array, kmax: jax.Array, length: jax.Array, *,
                        chunk_size: int, r: int, **kwargs) -> jax.Array:
  """`approx_bounds_scores` for summaries given as kmin, kmax [B, Hkv, NC, D] (a transposed
  copy is made; a `KVCache` already holds `bounds`). Equals
  `rocketkv_jax.select.approx_chunk_scores_xla`."""
  require_rank("kmin", kmin, 4, "[B, Hkv, NC, D]")
  require(kmin.shape == kmax.shape,
        f"kmin and kmax must have the same shape, got {kmin.shape} and {kmax.shape}")
  require(kmin.shape[2] >= 1, "kmin / kmax must hold at least one chunk")
  require(getattr(q, "ndim", None) == 3 and q.shape[-1] == kmin.shape[-1],
        f"q must have shape [B, Hq, D={kmin.shape[-1]}], got {getattr(q, 'shape', None)}")
  from rocketkv_jax.cache import bounds_of
  return approx_bounds_scores(q, bounds_of(kmin, kmax), length, chunk_size=chunk_size, r=r,
                              **kwargs)
