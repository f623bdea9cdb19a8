"""RocketKV / SparQ approximate chunk scores for TPU (Pallas Mosaic).

The math is `kernels/approx_scores.py`'s (module doc there): per KV head the r kept dims and
their summary rows (kmin row d, or kmax row D + d where the group-summed q_d > 0) are picked in
XLA (`lax.top_k` over [B, Hkv, D], tiny); the kernel reads just those r rows of `bounds
[B, Hkv, 2D, NC]` and forms the G logit rows; the masked softmax and the group sum stay in XLA.

A plain blocked kernel, grid (batch, KV head, chunk block): the row ids are scalar-prefetched,
and each step DMAs its r rows, [1, bc] strips of `block_c` chunks, from HBM into a VMEM buffer
[2, r, 1, bc] (one leading-dim tile per row: no sublane-offset DMA into a packed bf16 tile),
double-buffered along the chunk blocks of one (b, h). The logits are r multiply-adds of
[G, 1] x [1, bc] in fp32 on the VPU (G <= 8 rows would fill an MXU pass by G / 128 anyway).
A chunk block is a multiple of 128 lanes or all NC chunks; the last block is shifted back to end
at NC (its first chunks recomputed) so no DMA reads past the summaries.

The reference is `rocketkv_jax.select.approx_bounds_scores_xla` (same arguments and result).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rocketkv_jax._checks import require
from rocketkv_jax.ops import bound_rows_and_query, chunk_valid, group_queries, group_softmax_sum
from rocketkv_jax.ops import two_sided

from .approx_scores import _check
from .tpu_common import interpret_params


def _kernel(rows_ref, q_ref, b_hbm, o_ref, buf, sem, *, r: int, num_kv_heads: int, bc: int,
            num_chunks: int):
  """rows [B * Hkv * r] (SMEM, prefetched); q [G, r] f32; b_hbm [B, Hkv, 2D, NC] (HBM);
  o [G, bc] f32 logits; buf [2, r, 1, bc] VMEM in the bounds' dtype; sem DMA [2 (slot)]."""
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  nblocks = pl.num_programs(2)
  base = (b * num_kv_heads + h) * r

  def copies(blk, slot):  # block `blk`'s r row strips, its start clamped to end by NC
    start = jnp.minimum(blk * bc, num_chunks - bc)
    return [pltpu.make_async_copy(b_hbm.at[b, h, pl.ds(rows_ref[base + j], 1), pl.ds(start, bc)],
                                  buf.at[slot, j], sem.at[slot]) for j in range(r)]

  slot = c % 2

  @pl.when(c == 0)  # the first block of this (b, h): nothing prefetched it
  def _():
    for cp in copies(c, slot):
      cp.start()

  @pl.when(c + 1 < nblocks)
  def _():
    for cp in copies(c + 1, 1 - slot):
      cp.start()

  for cp in copies(c, slot):
    cp.wait()
  acc = jnp.zeros(o_ref.shape, jnp.float32)  # [G, bc]
  for j in range(r):
    acc = acc + q_ref[:, j:j + 1] * buf[slot, j].astype(jnp.float32)  # [G, 1] * [1, bc]
  o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("chunk_size", "r", "group_dims", "interpret",
                                             "block_c"))
def tpu_approx_bounds_scores(q: jax.Array, bounds: jax.Array, length: jax.Array, *,
                             chunk_size: int, r: int, group_dims: str = "sum",
                             interpret: bool = False, block_c: int = 2048) -> jax.Array:
  """Group-summed softmax of RocketKV's approximate chunk logits, on TPU.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    bounds: [B, Hkv, 2D, NC] chunk summaries (`KVCache.bounds`, bf16 or fp32), or with
      chunk_size 1 the keys' one copy [B, Hkv, D, C]; left in HBM.
    length: [B] int32 valid slots.
    chunk_size, r, group_dims: as `select.approx_bounds_scores_xla` (static).
    interpret: run in Pallas TPU interpret mode on any backend.
    block_c: chunks per grid step (a multiple of 128; all NC when NC is smaller).
  Returns:
    [B, Hkv, NC] float32; 0 for chunks with no valid slot. Equals
    `rocketkv_jax.select.approx_bounds_scores_xla`.
  """
  _check(q, bounds, length, chunk_size, r)
  require(isinstance(block_c, int) and block_c >= 128 and block_c % 128 == 0,
          f"block_c must be a multiple of 128, got {block_c!r}")
  b, hq, d = q.shape
  hkv, nc = bounds.shape[1], bounds.shape[3]
  g = hq // hkv
  qg = group_queries(q, hkv).astype(jnp.float32)
  # rows [B, Hkv, r] of bounds, q_r [B, Hkv, G, r]
  _, rows, q_r = bound_rows_and_query(qg, r, two_sided(bounds, d), group_dims)
  bc = nc if nc <= block_c else block_c
  ncb = -(-nc // bc)

  kernel = functools.partial(_kernel, r=r, num_kv_heads=hkv, bc=bc, num_chunks=nc)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b, hkv, ncb),
      in_specs=[pl.BlockSpec((None, None, g, r), lambda i, h, c, rw: (i, h, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((None, None, g, bc), lambda i, h, c, rw: (i, h, 0, c)),
      scratch_shapes=[pltpu.VMEM((2, r, 1, bc), bounds.dtype), pltpu.SemaphoreType.DMA((2,))])
  logits = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, hkv, g, ncb * bc), jnp.float32),
      # the chunk axis carries the prefetch of the next block: sequential
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret_params(interpret), name="rocketkv_tpu_approx_chunk_logits",
  )(rows.astype(jnp.int32).reshape(-1), q_r, bounds)
  if ncb > 1:  # the last block ends at NC: keep its last NC - (ncb - 1) * bc chunks
    tail = nc - (ncb - 1) * bc
    logits = jnp.concatenate([logits[..., :(ncb - 1) * bc], logits[..., ncb * bc - tail:]], -1)
  return group_softmax_sum(logits, chunk_valid(length.astype(jnp.int32), nc, chunk_size))
