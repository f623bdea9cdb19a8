"""Stage 2 `stage2="quant"` per-slot logits from a paged pool's packed key codes, for TPU
(Pallas Mosaic): one DMA per page of codes.

The pool keeps each page's codes beside its K / V, `codes_pages [N, Hkv, D, Wb]` uint8 (each
page packed alone: slot i of a page is byte i % Wb at bit (i // Wb) * bits, Wb = P * bits / 8),
and sequence b's logical page j at `table[b, j]`. The math is `kernels/tpu_quant_scores.py`'s
(module doc there): XLA picks the r dims and scatters the scaled fp32 query to all D dims as
three bf16 parts `[3 * Gp, D]` (`split_query`, exact); the kernel, grid (batch, KV head, block of
`pages_per_block` pages), gets the page table scalar-prefetched, copies each page's whole
`[D, Wb]` code block from HBM into a VMEM buffer `[2, bp, D, Wb]` (the next block's pages
prefetched along the block axis, `paged_tpu_approx_scores.fetch_pages`) and forms each code
plane's logits as one MXU product `[3 * Gp, D] x [D, Wb]`, adding the three row groups. XLA puts
each page's planes in slot order.

`paged_quant_logits_reference` (kernels/paged_quant_scores.py) is the jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rocketkv_jax.ops import coded_query, group_queries

from .paged_quant_scores import check_paged_codes
from .paged_tpu_approx_scores import fetch_pages, page_blocks
from .tpu_common import interpret_params
from .tpu_quant_scores import split_query


def _kernel(table_ref, q_ref, codes_hbm, o_ref, buf, sem, *, bits: int, group: int,
            part_rows: int, pages_per_block: int, pages_per_seq: int):
  """table [B * NP] (SMEM, prefetched); q [3 * Gp, D] bf16 (hi; mid; lo); codes_hbm
  [N, Hkv, D, Wb] uint8 (HBM); o [bp, per, G, Wb] f32; buf [2, bp, D, Wb] VMEM; sem DMA [2]."""
  slot = fetch_pages(table_ref, codes_hbm, buf, sem, pages_per_block=pages_per_block,
                     pages_per_seq=pages_per_seq)
  q = q_ref[...]
  gp = part_rows
  for j in range(pages_per_block):
    x = buf[slot, j].astype(jnp.int32)  # [D, Wb]
    for k in range(8 // bits):  # static: 1 to 8 planes
      plane = x if bits == 8 else (x >> (k * bits)) & (2 ** bits - 1)
      plane = plane.astype(jnp.float32).astype(jnp.bfloat16)  # codes < 256: exact in bf16
      part = jnp.dot(q, plane, preferred_element_type=jnp.float32)  # [3 * Gp, Wb]
      o_ref[j, k] = (part[:gp] + (part[gp:2 * gp] + part[2 * gp:]))[:group]


@functools.partial(jax.jit, static_argnames=("r", "bits", "group_dims", "interpret",
                                             "pages_per_block"))
def tpu_paged_quant_slot_logits(q: jax.Array, codes_pages: jax.Array, step: jax.Array,
                                table: jax.Array, *, r: int, bits: int, group_dims: str = "sum",
                                interpret: bool = False,
                                pages_per_block: int | None = None) -> jax.Array:
  """Approximate logits of every slot of a paged cache from its key codes, on TPU.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    codes_pages: [N, Hkv, D, Wb] uint8 the pool's code pages, left in HBM.
    step: [B, Hkv, D] float32 per-channel grid step.
    table: [B, NP] int32 page ids of each sequence.
    r, bits, group_dims: as `kernels.quant_slot_logits` (static).
    interpret: run in Pallas TPU interpret mode on any backend.
    pages_per_block: pages per grid step (None: 16).
  Returns:
    [B, Hkv, G, NP * P] float32 (slot order); equals `quant.slot_logits_xla` on the paged state
    up to the order of the fp32 sums.
  """
  b, hkv, d, _, npg, wb = check_paged_codes(q, codes_pages, step, table, r, bits)
  bp = page_blocks(npg, pages_per_block, 16)
  per = 8 // bits
  g = q.shape[1] // hkv
  ridx, qs = coded_query(group_queries(q, hkv).astype(jnp.float32), step, r, group_dims)
  q3 = split_query(qs, ridx.astype(jnp.int32), d)  # [B, Hkv, 3 * Gp, D] bf16
  rows = q3.shape[2]
  nblk = -(-npg // bp)

  kernel = functools.partial(_kernel, bits=bits, group=g, part_rows=rows // 3,
                             pages_per_block=bp, pages_per_seq=npg)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b, hkv, nblk),
      in_specs=[pl.BlockSpec((None, None, rows, d), lambda i, h, c, tbl: (i, h, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((None, None, bp, per, g, wb),
                             lambda i, h, c, tbl: (i, h, c, 0, 0, 0)),
      scratch_shapes=[pltpu.VMEM((2, bp, d, wb), codes_pages.dtype),
                      pltpu.SemaphoreType.DMA((2,))])
  logits = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, hkv, nblk * bp, per, g, wb), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret_params(interpret), name="rocketkv_tpu_paged_quant_slot_logits",
  )(table.astype(jnp.int32).reshape(-1), q3, codes_pages)  # [B, Hkv, NP', per, G, Wb]
  logits = jnp.moveaxis(logits[:, :, :npg], 4, 2)  # [B, Hkv, G, NP, per, Wb]: slot order
  return logits.reshape(b, hkv, g, npg * per * wb)
