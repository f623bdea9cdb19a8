"""RocketKV / SparQ approximate chunk scores from a paged pool's summaries, for TPU (Pallas
Mosaic): one DMA per page of summaries.

The pool keeps each page's chunk summaries beside its K / V, `bounds_pages [N, Hkv, 2D, W]`
(W = P / chunk_size chunks per page; one copy of the keys, D rows, for chunks of one slot), and
sequence b's logical chunk c at page `table[b, c // W]`, column `c % W`. The math is
`kernels/approx_scores.py`'s: the r dims and their rows (d, or D + d where the group-summed q_d
> 0) are picked in XLA, and the query on them is scattered to all 2D rows with zeros elsewhere,
`[G, 2D]`. The kernel, grid (batch, KV head, block of `pages_per_block` pages of the sequence),
gets the page table scalar-prefetched and, per step, copies each page's whole `[2D, W]` summary
block (contiguous in the pool) from HBM into a VMEM buffer `[2, bp, 2D, W]`, the next block's
pages prefetched along the block axis ("arbitrary"), and forms each page's `[G, W]` logits as one
fp32 product `[G, 2D] x [2D, W]` (the zero rows add exact zeros). Whole pages, not the r rows:
one DMA per page where the rows would take r (the 2D / r extra bytes: docs/tpu.md). The masked
softmax and the group sum stay in XLA.

`paged_approx_scores_reference` (kernels/paged_approx_scores.py) is the jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rocketkv_jax._checks import require
from rocketkv_jax.ops import (bound_rows_and_query, chunk_valid, group_queries,
                              group_softmax_sum, two_sided)

from .paged_approx_scores import check_paged_bounds
from .tpu_common import interpret_params


def fetch_pages(table_ref, src_hbm, buf, sem, *, pages_per_block: int, pages_per_seq: int):
  """The pipelined page DMAs of grid (batch, KV head, page block): this step's `pages_per_block`
  pages of `src_hbm [N, Hkv, ...]` (ids from `table_ref [B * NP]`; past NP, the last page
  again) land in `buf[slot]` `[bp, ...]`; the next block's copies start before this one's are
  waited on. Returns slot."""
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bp = pages_per_block

  def copies(blk, slot):
    out = []
    for j in range(bp):
      page = table_ref[b * pages_per_seq + jnp.minimum(blk * bp + j, pages_per_seq - 1)]
      out.append(pltpu.make_async_copy(src_hbm.at[page, h], buf.at[slot, j], sem.at[slot]))
    return out

  slot = c % 2

  @pl.when(c == 0)  # the first block of this (b, h): nothing prefetched it
  def _():
    for cp in copies(c, slot):
      cp.start()

  @pl.when(c + 1 < pl.num_programs(2))
  def _():
    for cp in copies(c + 1, 1 - slot):
      cp.start()

  for cp in copies(c, slot):
    cp.wait()
  return slot


def _kernel(table_ref, q_ref, b_hbm, o_ref, buf, sem, *, pages_per_block: int,
            pages_per_seq: int):
  """table [B * NP] (SMEM, prefetched); q [G, 2D] f32 (zero off the r rows); b_hbm
  [N, Hkv, 2D, W] (HBM); o [bp, G, W] f32 logits; buf [2, bp, 2D, W] VMEM; sem DMA [2]."""
  slot = fetch_pages(table_ref, b_hbm, buf, sem, pages_per_block=pages_per_block,
                     pages_per_seq=pages_per_seq)
  q = q_ref[...]
  for j in range(pages_per_block):
    o_ref[j] = jnp.dot(q, buf[slot, j].astype(jnp.float32), precision=lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)  # [G, W]


def scatter_rows(q_r: jax.Array, rows: jax.Array, num_rows: int) -> jax.Array:
  """q_r [B, Hkv, G, r] on rows `rows [B, Hkv, r]` (distinct) -> [B, Hkv, G, num_rows], zeros on
  the other rows."""
  b, hkv, g, _ = q_r.shape
  bi, hi = jnp.arange(b)[:, None, None], jnp.arange(hkv)[None, :, None]
  out = jnp.zeros((b, hkv, num_rows, g), q_r.dtype).at[bi, hi, rows].set(jnp.swapaxes(q_r, 2, 3))
  return jnp.swapaxes(out, 2, 3)


def page_blocks(num_pages: int, pages_per_block: int | None, default: int) -> int:
  """Pages per grid step: `pages_per_block` (None: `default`), at most NP."""
  bp = default if pages_per_block is None else pages_per_block
  require(isinstance(bp, int) and bp >= 1,
          f"pages_per_block must be None or an int >= 1, got {pages_per_block!r}")
  return min(bp, num_pages)


@functools.partial(jax.jit, static_argnames=("chunk_size", "r", "group_dims", "interpret",
                                             "pages_per_block"))
def tpu_paged_approx_bounds_scores(q: jax.Array, bounds_pages: jax.Array, table: jax.Array,
                                   length: jax.Array, *, chunk_size: int, r: int,
                                   group_dims: str = "sum", interpret: bool = False,
                                   pages_per_block: int | None = None) -> jax.Array:
  """Group-summed softmax of RocketKV's approximate chunk logits, read through a page table on
  TPU.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    bounds_pages: [N, Hkv, 2D, W] the pool's summary pages (or [N, Hkv, D, P] with chunk_size
      1), left in HBM.
    table: [B, NP] int32 page ids of each sequence.
    length: [B] int32 valid slots.
    chunk_size, r, group_dims: as `select.approx_bounds_scores_xla` (static).
    interpret: run in Pallas TPU interpret mode on any backend.
    pages_per_block: pages per grid step (None: 16).
  Returns:
    [B, Hkv, NP * W] float32; 0 for chunks with no valid slot. Equals
    `rocketkv_jax.select.paged_approx_scores_xla`.
  """
  b, hkv, _, npg, w = check_paged_bounds(q, bounds_pages, table, length, chunk_size, r)
  bp = page_blocks(npg, pages_per_block, 16)
  d = q.shape[2]
  g = q.shape[1] // hkv
  nrows = bounds_pages.shape[2]
  qg = group_queries(q, hkv).astype(jnp.float32)
  _, rows, q_r = bound_rows_and_query(qg, r, two_sided(bounds_pages, d), group_dims)
  q2 = scatter_rows(q_r, rows, nrows)  # [B, Hkv, G, 2D]
  nblk = -(-npg // bp)

  kernel = functools.partial(_kernel, pages_per_block=bp, pages_per_seq=npg)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b, hkv, nblk),
      in_specs=[pl.BlockSpec((None, None, g, nrows), lambda i, h, c, tbl: (i, h, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((None, None, bp, g, w), lambda i, h, c, tbl: (i, h, c, 0, 0)),
      scratch_shapes=[pltpu.VMEM((2, bp, nrows, w), bounds_pages.dtype),
                      pltpu.SemaphoreType.DMA((2,))])
  logits = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, hkv, nblk * bp, g, w), jnp.float32),
      # the block axis carries the prefetch of the next block: sequential
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret_params(interpret), name="rocketkv_tpu_paged_approx_chunk_logits",
  )(table.astype(jnp.int32).reshape(-1), q2, bounds_pages)  # [B, Hkv, NP', G, W]
  logits = jnp.swapaxes(logits[:, :, :npg], 2, 3).reshape(b, hkv, g, npg * w)
  return group_softmax_sum(logits, chunk_valid(length.astype(jnp.int32), npg * w, chunk_size))
