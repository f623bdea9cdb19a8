"""Sparse decode attention for TPU (Pallas Mosaic): DMA only the selected pages of K / V.

One query token per sequence attends to the `K` cache slots stage 2 selected. The XLA wrapper
turns the slot list into the pages of `page_size` (P) consecutive slots that hold them, sorted,
each with a bitmask of its selected rows; the kernel, grid (batch, KV head), walks those pages
with a dynamic trip count (only the pages that hold a selected slot are read), `pages_per_block`
pages per step: it DMAs each page's [P, D] rows of K and of V from HBM straight into a VMEM
buffer (one descriptor per page and tensor), double-buffered so the next block's DMAs run while
this one is attended, and keeps an online softmax for all G query heads of its KV head in fp32.

Per (b, h) the page starts and bitmasks arrive as SMEM blocks (Pallas pipelines them per grid
step: SMEM holds O(pages) words, not O(B * Hkv * pages)); the page counts are scalar-prefetched.
Block shapes: q / out [G, D] (full dims), VMEM buffers [2, bp * P, D] in the cache's dtype; D is
the whole last dim (a full-dim block: D = 64 leaves half of each 128-lane tile unused in VMEM,
D = 256 spans two). Design, tiling and the bytes per step: docs/tpu.md.

The reference is `rocketkv_jax.attend.sparse_attention_xla` (same arguments, same result).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rocketkv_jax._checks import require
from rocketkv_jax.ops import group_queries

from ._util import check_decode_qkv
from .tpu_common import NEG_INF, interpret_params, softmax_block


def page_table(idx: jax.Array, valid: jax.Array, capacity: int, page_size: int,
               num_pages: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The pages holding the valid selected slots, as the kernel reads them.

  Args:
    idx: [B, Hkv, K] int32 slots in [0, C); valid: [B, Hkv, K] bool (no valid slot twice).
    capacity: C; page_size: P <= min(32, C); num_pages: NP >= the most pages a row can need.
  Returns:
    (starts [B, Hkv, NP] int32 first row of each page, clamped so the page ends by C,
     bits [B, Hkv, NP] int32 bitmask of the selected rows (bit i: row start + i),
     count [B, Hkv] int32 pages in use; entries past count are start 0, bits 0).
  """
  b, h, k = idx.shape
  s = jnp.sort(jnp.where(valid, idx, capacity), axis=-1)  # [B, Hkv, K], invalid last
  ok = s < capacity
  page = s // page_size
  prev = jnp.concatenate([jnp.full((b, h, 1), -1, page.dtype), page[..., :-1]], axis=-1)
  new = ok & (page != prev)
  pos = jnp.cumsum(new, axis=-1) - 1  # [B, Hkv, K] position of each slot's page
  count = jnp.sum(new, axis=-1).astype(jnp.int32)
  start = jnp.minimum(page * page_size, capacity - page_size)  # the last page may overhang C
  shift = page * page_size - start  # rows the clamped start moved down
  bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
  drop = num_pages  # out of range: dropped by the scatters
  starts = jnp.zeros((b, h, num_pages), jnp.int32).at[bi, hi, jnp.where(new, pos, drop)].set(
      start.astype(jnp.int32), mode="drop")
  # Distinct rows of one page are distinct bits: their sum is their OR (bit 31 wraps to the sign).
  bit = jnp.left_shift(jnp.int32(1), (s % page_size + shift).astype(jnp.int32))
  bits = jnp.zeros((b, h, num_pages), jnp.int32).at[bi, hi, jnp.where(ok, pos, drop)].add(
      bit, mode="drop")
  return starts, bits, count


def _table_size(pages: int, pages_per_block: int) -> int:
  """Entries per (b, h) of the flat page table: whole blocks of pages (the tail ones are start 0,
  bits 0), and a size Mosaic takes for a 1-D SMEM block: a power of two >= 128 or a multiple of
  1024."""
  n = max(128, 1 << (pages - 1).bit_length())
  if n % pages_per_block:
    m = math.lcm(pages_per_block, 1024)
    n = -(-pages // m) * m
  return n


def _kernel(count_ref, q_ref, starts_ref, bits_ref, k_hbm, v_hbm, o_ref, kbuf, vbuf, sem, *,
            page_size: int, pages_per_block: int, num_kv_heads: int, scale: float):
  """count [B * Hkv] (SMEM, prefetched); q [G, D]; starts, bits [NP] (SMEM); k_hbm, v_hbm
  [B, Hkv, C, D] (HBM); o [G, D]; kbuf, vbuf [2, bp * P, D] VMEM; sem DMA [2 (k, v), 2 (slot)]."""
  b, h = pl.program_id(0), pl.program_id(1)
  p, bp = page_size, pages_per_block
  n = count_ref[b * num_kv_heads + h]
  num_blocks = (n + bp - 1) // bp

  def copies(blk, slot):  # the 2 * bp DMAs of block `blk` into buffer `slot`
    out = []
    for j in range(bp):
      start = starts_ref[blk * bp + j]
      for t, (src, dst) in enumerate(((k_hbm, kbuf), (v_hbm, vbuf))):
        out.append(pltpu.make_async_copy(src.at[b, h, pl.ds(start, p)],
                                         dst.at[slot, pl.ds(j * p, p)], sem.at[t, slot]))
    return out

  @pl.when(num_blocks > 0)
  def _():
    for c in copies(0, 0):
      c.start()

  q = q_ref[...].astype(jnp.float32)  # [G, D]
  rows = lax.broadcasted_iota(jnp.int32, (1, bp * p), 1)  # [1, bp * P]

  def body(i, carry):
    slot = i % 2

    @pl.when(i + 1 < num_blocks)
    def _():
      for c in copies(i + 1, 1 - slot):
        c.start()

    for c in copies(i, slot):
      c.wait()
    kb = kbuf[slot].astype(jnp.float32)  # [bp * P, D]
    vb = vbuf[slot].astype(jnp.float32)
    # Which rows are selected: bit (row % P) of their page's mask.
    mask_bits = jnp.zeros((1, bp * p), jnp.int32)
    for j in range(bp):
      mask_bits = jnp.where(rows // p == j, bits_ref[i * bp + j], mask_bits)
    sel = (jnp.right_shift(mask_bits, rows % p) & 1) == 1  # [1, bp * P]
    return softmax_block(q, kb, vb, sel, scale, carry)  # over the bp * P rows

  g, d = q.shape
  init = (jnp.full((g, 1), NEG_INF, jnp.float32), jnp.zeros((g, 1), jnp.float32),
          jnp.zeros((g, d), jnp.float32))
  _, l, acc = lax.fori_loop(0, num_blocks, body, init)
  o_ref[...] = (acc / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


def _check(q, k, v, idx, valid, page_size, pages_per_block):
  b, hkv, c, d = check_decode_qkv(q, k, v)
  require(getattr(idx, "ndim", None) == 3 and idx.shape[:2] == (b, hkv) and idx.shape[2] >= 1,
          f"idx must have shape [B={b}, Hkv={hkv}, K>=1], got {getattr(idx, 'shape', None)}")
  require(valid.shape == idx.shape, f"valid must have idx's shape {idx.shape}, got {valid.shape}")
  require(jnp.issubdtype(idx.dtype, jnp.integer), f"idx must be integer, got {idx.dtype}")
  require(isinstance(page_size, int) and 1 <= page_size <= 32,
          f"page_size must be an int in [1, 32], got {page_size!r}")
  require(isinstance(pages_per_block, int) and pages_per_block >= 1,
          f"pages_per_block must be an int >= 1, got {pages_per_block!r}")


@functools.partial(jax.jit, static_argnames=("interpret", "page_size", "pages_per_block"))
def tpu_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, idx: jax.Array,
                         valid: jax.Array, *, interpret: bool = False, page_size: int = 16,
                         pages_per_block: int = 8) -> jax.Array:
  """Exact softmax attention of one decode query over the selected cache slots, on TPU.

  Args:
    q: [B, Hq, D] query (Hq = G * Hkv).
    k, v: [B, Hkv, C, D] cache keys / values (bf16 or fp32), left in HBM.
    idx: [B, Hkv, K] int32 slots, already clipped into [0, C); valid: [B, Hkv, K] bool, no
      valid slot twice; masked entries contribute nothing.
    interpret: run in Pallas TPU interpret mode (`pltpu.InterpretParams`: simulated HBM / VMEM,
      DMAs and semaphores) on any backend.
    page_size: P, rows per DMA (<= 32: a page's selected rows are one int32 bitmask); 16 rows
      of bf16 are one (16, 128) tile. 1 reads single rows.
    pages_per_block: bp, pages attended per step (bp * P rows per product).
  Returns:
    [B, Hq, D] in q's dtype, scale 1/sqrt(D), fp32 math; zeros where no slot is valid. Equals
    `rocketkv_jax.attend.sparse_attention_xla`.
  """
  _check(q, k, v, idx, valid, page_size, pages_per_block)
  b, hq, d = q.shape
  hkv, c = k.shape[1], k.shape[2]
  g = hq // hkv
  p = min(page_size, c)
  bp = pages_per_block
  num_pages = _table_size(min(idx.shape[2], -(-c // p)), bp)
  starts, bits, count = page_table(idx.astype(jnp.int32), valid, c, p, num_pages)

  kernel = functools.partial(_kernel, page_size=p, pages_per_block=bp, num_kv_heads=hkv,
                             scale=1.0 / math.sqrt(d))
  smem = pl.BlockSpec((num_pages,), lambda i, h, cnt: (i * hkv + h,), memory_space=pltpu.SMEM)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b, hkv),
      in_specs=[pl.BlockSpec((None, None, g, d), lambda i, h, cnt: (i, h, 0, 0)), smem, smem,
                pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((None, None, g, d), lambda i, h, cnt: (i, h, 0, 0)),
      scratch_shapes=[pltpu.VMEM((2, bp * p, d), k.dtype), pltpu.VMEM((2, bp * p, d), v.dtype),
                      pltpu.SemaphoreType.DMA((2, 2))])
  out = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=interpret_params(interpret), name="rocketkv_tpu_sparse_attention",
  )(count.reshape(-1), group_queries(q, hkv), starts.reshape(-1), bits.reshape(-1), k, v)
  return out.reshape(b, hq, d)
