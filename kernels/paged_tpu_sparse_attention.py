"""Sparse decode attention over a paged KV pool for TPU (Pallas Mosaic): one DMA per pool page
that holds a selected slot.

The pool keeps K / V pages first, `[N, Hkv, P, D]`, and sequence b's logical slot s at page
`table[b, s // P]`, row `s % P` (`rocketkv_jax/pages.py`). XLA turns the `[B, Hkv, K]` selected
slots into, per (b, h), the sorted logical pages that hold one and a bitmask of the selected rows
of each (`ceil(P / 32)` int32 words, rounded up to a power of two, per page), and their count.
The kernel, grid (batch, KV head), gets the page table `[B * NP]` and the counts as
scalar-prefetched SMEM, its own page list and bitmasks as SMEM blocks, and K / V left in HBM:
a loop with a dynamic trip count (only the pages in use) takes `pages_per_block` pages per step,
looks up each page's id in the table and copies the whole page, `[P, D]` of K and of V, from the
pool into a VMEM buffer `[2, bp * P, D]` (double-buffered: the next block's DMAs start before this
one is waited on), then forms the G query heads' logits, masks the unselected rows from the
bitmasks and keeps an online softmax in fp32, as `kernels/tpu_sparse_attention.py` does for a
contiguous cache (there the pages are cut out of the sequence; here they are the pool's own).

`paged_sparse_attention_reference` (kernels/paged_sparse_attention.py) is the jnp reference.
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

from ._util import next_pow2
from .paged_sparse_attention import check_paged_qkv, check_selection
from .tpu_common import NEG_INF, interpret_params, softmax_block
from .tpu_sparse_attention import _table_size


def mask_words(page_size: int) -> int:
  """int32 bitmask words per page: ceil(P / 32), rounded up to a power of two (SMEM block
  sizes)."""
  return next_pow2(-(-page_size // 32))


def page_list(idx: jax.Array, valid: jax.Array, page_size: int, num_entries: int
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The logical pages holding the valid selected slots, as the kernel reads them.

  Args:
    idx: [B, Hkv, K] int32 logical slots in [0, NP * P); valid: [B, Hkv, K] bool (no valid slot
      twice).
    page_size: P; num_entries: E >= the most pages a row can need.
  Returns:
    (pages [B, Hkv, E] int32 logical page numbers, sorted; 0 past the count,
     bits [B, Hkv, E * words] int32 bitmasks of the selected rows (row i of page e: bit i % 32
       of word e * words + i // 32; `mask_words`),
     count [B, Hkv] int32 pages in use).
  """
  b, h, _ = idx.shape
  words = mask_words(page_size)
  big = jnp.iinfo(jnp.int32).max
  s = jnp.sort(jnp.where(valid, idx, big), axis=-1)  # [B, Hkv, K], invalid last
  ok = s < big
  page = s // page_size
  prev = jnp.concatenate([jnp.full((b, h, 1), -1, page.dtype), page[..., :-1]], axis=-1)
  new = ok & (page != prev)
  pos = jnp.cumsum(new, axis=-1) - 1  # [B, Hkv, K] entry of each slot's page
  count = jnp.sum(new, axis=-1).astype(jnp.int32)
  bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
  pages = jnp.zeros((b, h, num_entries), jnp.int32).at[
      bi, hi, jnp.where(new, pos, num_entries)].set(page.astype(jnp.int32), mode="drop")
  row = (s % page_size).astype(jnp.int32)
  # Distinct rows of one page are distinct bits: their sum is their OR (bit 31 wraps to the sign).
  bit = jnp.left_shift(jnp.int32(1), row % 32)
  at = jnp.where(ok, pos * words + row // 32, num_entries * words)
  bits = jnp.zeros((b, h, num_entries * words), jnp.int32).at[bi, hi, at].add(bit, mode="drop")
  return pages, bits, count


def _kernel(count_ref, table_ref, q_ref, pages_ref, bits_ref, k_hbm, v_hbm, o_ref, kbuf, vbuf,
            sem, *, page_size: int, pages_per_block: int, num_kv_heads: int, pages_per_seq: int,
            words: int, scale: float):
  """count [B * Hkv], table [B * NP] (SMEM, prefetched); q [G, D]; pages [E], bits [E * words]
  (SMEM); k_hbm, v_hbm [N, Hkv, P, D] (HBM, the pool); o [G, D]; kbuf, vbuf [2, bp * P, D]
  VMEM; sem DMA [2 (k, v), 2 (slot)]."""
  b, h = pl.program_id(0), pl.program_id(1)
  p, bp = page_size, pages_per_block
  n = count_ref[b * num_kv_heads + h]
  num_blocks = (n + bp - 1) // bp

  def copies(blk, slot):  # the 2 * bp page DMAs of block `blk` into buffer `slot`
    out = []
    for j in range(bp):
      page = table_ref[b * pages_per_seq + pages_ref[blk * bp + j]]  # the pool's page id
      for t, (src, dst) in enumerate(((k_hbm, kbuf), (v_hbm, vbuf))):
        out.append(pltpu.make_async_copy(src.at[page, h], dst.at[slot, pl.ds(j * p, p)],
                                         sem.at[t, slot]))
    return out

  @pl.when(num_blocks > 0)
  def _():
    for c in copies(0, 0):
      c.start()

  q = q_ref[...].astype(jnp.float32)  # [G, D]
  rows = lax.broadcasted_iota(jnp.int32, (1, bp * p), 1)  # [1, bp * P]
  in_page = rows % p

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
    # Which rows are selected: bit (row % 32) of their page's word (row % P) // 32.
    mask_bits = jnp.zeros((1, bp * p), jnp.int32)
    for j in range(bp):
      for w in range(words):
        mask_bits = jnp.where((rows // p == j) & (in_page // 32 == w),
                              bits_ref[(i * bp + j) * words + w], mask_bits)
    sel = (jnp.right_shift(mask_bits, in_page % 32) & 1) == 1  # [1, bp * P]
    return softmax_block(q, kb, vb, sel, scale, carry)  # over the bp * P rows

  g, d = q.shape
  init = (jnp.full((g, 1), NEG_INF, jnp.float32), jnp.zeros((g, 1), jnp.float32),
          jnp.zeros((g, d), jnp.float32))
  _, l, acc = lax.fori_loop(0, num_blocks, body, init)
  o_ref[...] = (acc / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("page_size", "interpret", "pages_per_block"))
def tpu_paged_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               table: jax.Array, idx: jax.Array, valid: jax.Array, *,
                               page_size: int, interpret: bool = False,
                               pages_per_block: int | None = None) -> jax.Array:
  """Exact softmax attention of one decode query over selected rows of a paged cache, on TPU.

  Args:
    q: [B, Hq, D] query (Hq = G * Hkv).
    k_pages, v_pages: [N, Hkv, P, D] the pool's pages (bf16 or fp32), left in HBM.
    table: [B, NP] int32 page ids of each sequence.
    idx: [B, Hkv, K] int32 logical slots, already clipped into [0, NP * P); valid: [B, Hkv, K]
      bool, no valid slot twice; masked entries contribute nothing.
    page_size: P (static; the pages' axis 2).
    interpret: run in Pallas TPU interpret mode (`pltpu.InterpretParams`) on any backend.
    pages_per_block: bp, pages attended per step (None: max(1, 128 // P)).
  Returns:
    [B, Hq, D] in q's dtype, scale 1/sqrt(D), fp32 math; zeros where no slot is valid. Equals
    `rocketkv_jax.attend.paged_sparse_attention_xla`.
  """
  b, hkv, _, npg, d = check_paged_qkv(q, k_pages, v_pages, table, page_size)
  check_selection(idx, valid, b, hkv)
  bp = max(1, 128 // page_size) if pages_per_block is None else pages_per_block
  require(isinstance(bp, int) and bp >= 1,
          f"pages_per_block must be None or an int >= 1, got {pages_per_block!r}")
  g = q.shape[1] // hkv
  p = page_size
  words = mask_words(p)
  entries = _table_size(min(idx.shape[2], npg), bp)
  pages, bits, count = page_list(idx.astype(jnp.int32), valid, p, entries)

  kernel = functools.partial(_kernel, page_size=p, pages_per_block=bp, num_kv_heads=hkv,
                             pages_per_seq=npg, words=words, scale=1.0 / math.sqrt(d))
  smem = lambda n: pl.BlockSpec((n,), lambda i, h, cnt, tbl: (i * hkv + h,),
                                memory_space=pltpu.SMEM)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b, hkv),
      in_specs=[pl.BlockSpec((None, None, g, d), lambda i, h, cnt, tbl: (i, h, 0, 0)),
                smem(entries), smem(entries * words),
                pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((None, None, g, d), lambda i, h, cnt, tbl: (i, h, 0, 0)),
      scratch_shapes=[pltpu.VMEM((2, bp * p, d), k_pages.dtype),
                      pltpu.VMEM((2, bp * p, d), v_pages.dtype),
                      pltpu.SemaphoreType.DMA((2, 2))])
  out = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=interpret_params(interpret), name="rocketkv_tpu_paged_sparse_attention",
  )(count.reshape(-1), table.astype(jnp.int32).reshape(-1), group_queries(q, hkv),
    pages.reshape(-1), bits.reshape(-1), k_pages, v_pages)
  return out.reshape(b, q.shape[1], d)
