"""RocketKV / SparQ approximate chunk scores from the per-chunk key min / max summaries.

Per KV head (G query heads in its group): keep the `r` head dims with the largest |q| summed
over the group; per kept dim take the chunk's kmax where the group-summed q is positive, else
its kmin; logit = q_r . k_bound_r scaled by 1/sqrt(D * sum|q_r| / sum|q|) per query head;
softmax over the valid chunks per query head; sum over the group.

The summaries come in the cache's layout, `bounds [B, Hkv, 2D, NC]` (kmin rows, then kmax rows, see
`rocketkv_jax.cache`; one copy of the keys, D rows, for chunks of one slot). The top-r dims and
their rows (d, or D + d where the sign picks kmax) are picked in XLA (`lax.top_k` over [B, Hkv, D],
tiny). The kernel, grid (batch, KV head, chunk block), gathers just those r rows of `block_c`
chunks straight from the cache ([R, block_c], R = r padded to a power of two >= 16, padding rows
masked: no HBM traffic) and computes the G logit rows in fp32 as elementwise products summed over
the rows (no tensor-core dot: a [G, R] x [R, block_c] fp32 product would pad G to 16 rows and run
on Triton's slow IEEE-fp32 FMA path). The logits, [B, Hkv, G, NC] fp32 (G * 4 bytes per chunk, far
less than the 2r * 2 bytes of summaries read), then go through the masked softmax and group sum in
XLA (two small fusions).

Why this shape and not dots over all 2D rows: docs/kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rocketkv_jax._checks import group_size, require, require_rank
from rocketkv_jax.ops import (bound_rows_and_query, bounds_of, chunk_valid, group_queries,
                              group_softmax_sum, two_sided)

from ._util import cdiv, compiler_params, load_rows, next_pow2, padded_dim


def padded_rows_and_query(qg, r: int, bounds2, group_dims: str):
  """The r bound rows each KV head reads and the query on them, padded to rp = `padded_dim(r)`
  for Triton: qg [B, Hkv, G, D] float32, bounds2 the two-sided bounds -> (rows [B, Hkv, rp]
  int32, -1 past r; q_r [B, Hkv, G, rp], 0 past r; rp)."""
  rp = padded_dim(r)
  _, rows, q_r = bound_rows_and_query(qg, r, bounds2, group_dims)
  rows = jnp.pad(rows.astype(jnp.int32), ((0, 0), (0, 0), (0, rp - r)), constant_values=-1)
  q_r = jnp.pad(q_r, ((0, 0), (0, 0), (0, 0), (0, rp - r)))
  return rows, q_r, rp


def _kernel(rows_ref, q_ref, b_ref, o_ref, *, num_chunks: int, group: int, block_c: int):
  """rows [R] int32 (-1: padding), q [G, R] f32, bounds [2D, NC] -> logits o [G, block_c] f32."""
  tile = load_rows(b_ref, rows_ref[...], block_c, num_chunks).astype(jnp.float32)  # [R, block_c]
  for g in range(group):  # static: G is 1..8 for the models we run
    qg = q_ref[g, :]  # [R]
    o_ref[g, :] = jnp.sum(tile * qg[:, None], axis=0)


def _check(q, bounds, length, chunk_size, r):
  require_rank("q", q, 3, "[B, Hq, D]")
  require_rank("bounds", bounds, 4, "[B, Hkv, 2D, NC]")
  b, hkv, d2, nc = bounds.shape
  d = q.shape[2]
  require(q.shape[0] == b and d2 in (d, 2 * d),
          f"q [B, Hq, D] and bounds [B, Hkv, 2D or D, NC] disagree: {q.shape} and "
          f"{bounds.shape}")
  group_size(q.shape[1], hkv, "q")
  require(getattr(length, "shape", None) == (b,),
          f"length must have shape [B]={(b,)}, got {getattr(length, 'shape', None)}")
  require(isinstance(chunk_size, int) and chunk_size >= 1,
          f"chunk_size must be an int >= 1, got {chunk_size!r}")
  require(isinstance(r, int) and 1 <= r <= d, f"r must be an int in [1, D={d}], got {r!r}")
  require(nc >= 1, "the bounds must hold at least one chunk")


@functools.partial(jax.jit, static_argnames=("chunk_size", "r", "group_dims", "interpret",
                                             "block_c", "num_warps", "num_stages"))
def approx_bounds_scores(q: jax.Array, bounds: jax.Array, length: jax.Array, *,
                         chunk_size: int, r: int, group_dims: str = "sum",
                         interpret: bool = False, block_c: int = 64, num_warps: int = 4,
                         num_stages: int = 2) -> jax.Array:
  """Group-summed softmax of RocketKV's approximate chunk logits.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    bounds: [B, Hkv, 2D, NC] per-chunk key min rows then max rows (`KVCache.bounds`; bf16 or
      fp32), or with chunk_size 1 the keys' one copy [B, Hkv, D, C].
    length: [B] int32 valid slots; chunk c is valid when c * chunk_size < length.
    chunk_size: slots per chunk (static).
    r: head dims kept (static).
    group_dims: how the group picks the r dims, `ops.GROUP_DIMS` (static).
    interpret: run the kernel in Pallas interpret mode (CPU testing).
    block_c: chunks per program (power of two >= 16).
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
  qg = group_queries(q, hkv).astype(jnp.float32)
  rows, q_r, rp = padded_rows_and_query(qg, r, two_sided(bounds, d), group_dims)

  bc = max(16, min(block_c, next_pow2(nc)))
  ncb = cdiv(nc, bc)
  kernel = functools.partial(_kernel, num_chunks=nc, group=g, block_c=bc)
  logits = pl.pallas_call(
      kernel, grid=(b, hkv, ncb),
      in_specs=[pl.BlockSpec((None, None, rp), lambda i, h, c: (i, h, 0)),
                pl.BlockSpec((None, None, g, rp), lambda i, h, c: (i, h, 0, 0)),
                pl.BlockSpec((None, None, bounds.shape[2], nc), lambda i, h, c: (i, h, 0, 0))],
      out_specs=pl.BlockSpec((None, None, g, bc), lambda i, h, c: (i, h, 0, c)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, g, ncb * bc), jnp.float32),
      compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
      name="rocketkv_approx_chunk_logits",
  )(rows, q_r, bounds)
  # The epilogue of the XLA path, the same function (rocketkv_jax/ops.py).
  return group_softmax_sum(logits[..., :nc],
                           chunk_valid(length.astype(jnp.int32), nc, chunk_size))


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
  return approx_bounds_scores(q, bounds_of(kmin, kmax), length, chunk_size=chunk_size, r=r,
                              **kwargs)
