"""RocketKV / SparQ approximate chunk scores from a paged pool's min / max summaries (GPU, Pallas
Triton).

In the serving engine's pool the chunk summaries live in pages beside K / V,
`bounds_pages [N, Hkv, 2D, W]` (kmin rows, then kmax rows; W = P / chunk_size chunks per page;
one copy of the keys, D rows, for chunks of one slot), and sequence b's logical chunk c at page
`table[b, c // W]`, column `c % W` (`rocketkv_jax/pages.py`). The math is
`kernels/approx_scores.py`'s (module doc there): the r dims and their rows are picked in XLA, the
kernel, grid (batch, KV head, block of `block_c` logical chunks), looks up each chunk's page in
the sequence's table and gathers just those r rows of the block from the pool (seen as rows
`[N * Hkv * 2D, W]`), then forms the G logit rows as fp32 elementwise products summed over the
rows. The masked softmax and the group sum run in XLA.

`paged_approx_scores_reference` is the same math in jnp on the pages gathered into slot order
(`pages.logical_cols`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rocketkv_jax import pages
from rocketkv_jax._checks import group_size, require, require_rank
from rocketkv_jax.ops import (bound_rows_and_query, chunk_valid, group_queries,
                              group_softmax_sum, two_sided)

from ._util import cdiv, compiler_params, next_pow2
from .approx_scores import padded_rows_and_query


def check_paged_bounds(q, bounds_pages, table, length, chunk_size, r):
  """One-line ValueErrors unless the arguments fit `paged_approx_bounds_scores`' contract
  (shared with the TPU kernel); returns (B, Hkv, N, NP, W)."""
  require_rank("q", q, 3, "[B, Hq, D]")
  require_rank("bounds_pages", bounds_pages, 4, "[N, Hkv, 2D, W]")
  n, hkv, rows, w = bounds_pages.shape
  d = q.shape[2]
  require(rows in (d, 2 * d), f"q [B, Hq, D] and bounds_pages [N, Hkv, 2D or D, W] disagree: "
          f"{q.shape} and {bounds_pages.shape}")
  require_rank("table", table, 2, "[B, NP]")
  require(jnp.issubdtype(table.dtype, jnp.integer), f"table must be integer, got {table.dtype}")
  b, npg = table.shape
  require(q.shape[0] == b, f"q must have shape [B={b}, Hq, D], got {q.shape}")
  group_size(q.shape[1], hkv, "q")
  require(getattr(length, "shape", None) == (b,),
          f"length must have shape [B]={(b,)}, got {getattr(length, 'shape', None)}")
  require(isinstance(chunk_size, int) and chunk_size >= 1,
          f"chunk_size must be an int >= 1, got {chunk_size!r}")
  require(isinstance(r, int) and 1 <= r <= d, f"r must be an int in [1, D={d}], got {r!r}")
  require(w >= 1, "the pages must hold at least one chunk each")
  return b, hkv, n, npg, w


def paged_approx_scores_reference(q, bounds_pages, table, length, chunk_size, r,
                                  group_dims="sum"):
  """jnp reference: [B, Hkv, NP * W] float32 group-summed softmax scores of the chunks, from
  every summary row of each sequence's pages in slot order (0 for chunks with no valid slot)."""
  hkv, d = bounds_pages.shape[1], q.shape[2]
  logical = pages.logical_cols(bounds_pages, table).astype(jnp.float32)  # [B, Hkv, 2D, NC]
  qg = group_queries(q, hkv).astype(jnp.float32)
  _, rows, q_r = bound_rows_and_query(qg, r, two_sided(bounds_pages, d), group_dims)
  k_r = jnp.take_along_axis(logical, rows[..., None], axis=2)  # [B, Hkv, r, NC]
  logits = jnp.sum(q_r[..., None] * k_r[:, :, None], axis=3)  # [B, Hkv, G, NC]
  return group_softmax_sum(logits, chunk_valid(length, logical.shape[-1], chunk_size))


def gather_tile(pool_ref, tbl_ref, rows, cols, *, num_kv_heads: int, num_rows: int,
                cols_per_page: int, num_cols: int):
  """[R, bc] of `pool_ref [N * Hkv * num_rows, W]` (pages [N, Hkv, num_rows, W] as rows): rows
  `rows [R]` (-1: padding, loads 0) of this program's KV head at logical columns `cols [bc]`
  (past num_cols: load 0), each column's page from the sequence's table `tbl_ref [NP]`."""
  h = pl.program_id(1)
  col = jnp.minimum(cols, num_cols - 1)
  page = tbl_ref[col // cols_per_page]  # [bc]
  base = (page * num_kv_heads + h) * num_rows  # [bc] first row of each column's page
  at = (base[None, :] + jnp.maximum(rows, 0)[:, None], (col % cols_per_page)[None, :])
  return plgpu.load(pool_ref.at[at], mask=(rows >= 0)[:, None] & (cols < num_cols)[None, :],
                    other=0)


def _kernel(rows_ref, q_ref, tbl_ref, b_ref, o_ref, *, num_kv_heads: int, num_rows: int,
            cols_per_page: int, num_chunks: int, group: int, block_c: int):
  """rows [R] int32 (-1: padding), q [G, R] f32, tbl [NP], pool [N * Hkv * 2D, W] -> o [G, bc]."""
  cols = pl.program_id(2) * block_c + jnp.arange(block_c)
  tile = gather_tile(b_ref, tbl_ref, rows_ref[...], cols, num_kv_heads=num_kv_heads,
                     num_rows=num_rows, cols_per_page=cols_per_page,
                     num_cols=num_chunks).astype(jnp.float32)  # [R, bc]
  for g in range(group):  # static: G is 1..8 for the models we run
    o_ref[g, :] = jnp.sum(tile * q_ref[g, :][:, None], axis=0)


@functools.partial(jax.jit, static_argnames=("chunk_size", "r", "group_dims", "interpret",
                                             "block_c", "num_warps", "num_stages"))
def paged_approx_bounds_scores(q: jax.Array, bounds_pages: jax.Array, table: jax.Array,
                               length: jax.Array, *, chunk_size: int, r: int,
                               group_dims: str = "sum", interpret: bool = False,
                               block_c: int = 64, num_warps: int = 4,
                               num_stages: int = 2) -> jax.Array:
  """Group-summed softmax of RocketKV's approximate chunk logits, read through a page table.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    bounds_pages: [N, Hkv, 2D, W] the pool's summary pages (`KVCache.bounds_raw` of a paged
      cache in its logical dtype; W = P / chunk_size), or with chunk_size 1 [N, Hkv, D, P].
    table: [B, NP] int32 page ids of each sequence.
    length: [B] int32 valid slots.
    chunk_size, r, group_dims: as `kernels.approx_bounds_scores` (static).
    interpret: run the kernel in Pallas interpret mode (CPU testing).
    block_c, num_warps, num_stages: as `kernels.approx_bounds_scores`.
  Returns:
    [B, Hkv, NP * W] float32; 0 for chunks with no valid slot. Equals
    `rocketkv_jax.select.paged_approx_scores_xla`.
  """
  b, hkv, n, npg, w = check_paged_bounds(q, bounds_pages, table, length, chunk_size, r)
  require(block_c >= 16 and block_c == next_pow2(block_c),
          f"block_c must be a power of two >= 16, got {block_c}")
  d = q.shape[2]
  g = q.shape[1] // hkv
  nrows, nc = bounds_pages.shape[2], npg * w
  qg = group_queries(q, hkv).astype(jnp.float32)
  rows, q_r, rp = padded_rows_and_query(qg, r, two_sided(bounds_pages, d), group_dims)

  bc = max(16, min(block_c, next_pow2(nc)))
  ncb = cdiv(nc, bc)
  kernel = functools.partial(_kernel, num_kv_heads=hkv, num_rows=nrows, cols_per_page=w,
                             num_chunks=nc, group=g, block_c=bc)
  logits = pl.pallas_call(
      kernel, grid=(b, hkv, ncb),
      in_specs=[pl.BlockSpec((None, None, rp), lambda i, h, c: (i, h, 0)),
                pl.BlockSpec((None, None, g, rp), lambda i, h, c: (i, h, 0, 0)),
                pl.BlockSpec((None, npg), lambda i, h, c: (i, 0)),
                pl.BlockSpec((n * hkv * nrows, w), lambda i, h, c: (0, 0))],
      out_specs=pl.BlockSpec((None, None, g, bc), lambda i, h, c: (i, h, 0, c)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, g, ncb * bc), jnp.float32),
      compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
      name="rocketkv_paged_approx_chunk_logits",
  )(rows, q_r, table.astype(jnp.int32), bounds_pages.reshape(n * hkv * nrows, w))
  return group_softmax_sum(logits[..., :nc], chunk_valid(length.astype(jnp.int32), nc,
                                                         chunk_size))
