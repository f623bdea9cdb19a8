"""Stage 2 `stage2="quant"` per-slot logits from a paged pool's packed key codes (GPU, Pallas
Triton).

In the serving engine's pool the key codes live in pages beside K / V, `codes_pages
[N, Hkv, D, Wb]` uint8, each page packed alone (Wb = P / per bytes, per = 8 / bits codes per
byte): slot i of a page is its byte i % Wb at bit (i // Wb) * bits. Sequence b's logical byte
column c is column `c % Wb` of page `table[b, c // Wb]`. The math is `kernels/quant_scores.py`'s
(module doc there): the r dims and the scaled query are picked in XLA (`ops.coded_query`); the
kernel, grid (batch, KV head, block of `block_n` logical byte columns), looks up each column's
page in the sequence's table, gathers the r code rows of the block from the pool (seen as rows
`[N * Hkv * D, Wb]`), unpacks the code planes in registers and writes each plane's G logit rows.
XLA then puts each page's planes in slot order (plane j of page p holds its slots
j * Wb + [0, Wb)).

`paged_quant_logits_reference` is the same math in jnp on the pages gathered into page order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rocketkv_jax._checks import group_size, require, require_rank
from rocketkv_jax.ops import CODE_BITS, coded_query, group_queries

from ._util import cdiv, compiler_params, next_pow2, padded_dim
from .paged_approx_scores import gather_tile


def check_paged_codes(q, codes_pages, step, table, r, bits):
  """One-line ValueErrors unless the arguments fit `paged_quant_slot_logits`' contract (shared
  with the TPU kernel); returns (B, Hkv, D, N, NP, Wb)."""
  require_rank("q", q, 3, "[B, Hq, D]")
  require_rank("codes_pages", codes_pages, 4, "[N, Hkv, D, Wb]")
  n, hkv, d, wb = codes_pages.shape
  require(q.shape[2] == d, f"q [B, Hq, D] and codes_pages [N, Hkv, D, Wb] disagree: {q.shape} "
          f"and {codes_pages.shape}")
  require(codes_pages.dtype == jnp.uint8, f"codes_pages must be uint8, got {codes_pages.dtype}")
  require_rank("table", table, 2, "[B, NP]")
  require(jnp.issubdtype(table.dtype, jnp.integer), f"table must be integer, got {table.dtype}")
  b, npg = table.shape
  require(q.shape[0] == b, f"q must have shape [B={b}, Hq, D], got {q.shape}")
  group_size(q.shape[1], hkv, "q")
  require(getattr(step, "shape", None) == (b, hkv, d),
          f"step must have shape [B, Hkv, D]={(b, hkv, d)}, got {getattr(step, 'shape', None)}")
  require(bits in CODE_BITS, f"bits must be one of {list(CODE_BITS)}, got {bits!r}")
  require(isinstance(r, int) and 1 <= r <= d, f"r must be an int in [1, D={d}], got {r!r}")
  require(wb >= 1, "the pages must hold at least one code byte each")
  return b, hkv, d, n, npg, wb


def page_order(logits: jax.Array, num_pages: int) -> jax.Array:
  """[B, Hkv, G, per, NP * Wb] logits (plane j of logical byte column c) -> [B, Hkv, G, NP * P]
  in slot order: page by page, its planes in turn."""
  b, hkv, g, per, cols = logits.shape
  x = logits.reshape(b, hkv, g, per, num_pages, cols // num_pages)
  return jnp.swapaxes(x, 3, 4).reshape(b, hkv, g, per * cols)


def paged_quant_logits_reference(q, codes_pages, step, table, r, bits, group_dims="sum"):
  """jnp reference: [B, Hkv, G, NP * P] float32, the sum over the r dims of the scaled query
  times each slot's code, from the sequence's pages gathered in page order."""
  hkv = codes_pages.shape[1]
  g = codes_pages[table]  # [B, NP, Hkv, D, Wb]
  b, npg, _, d, wb = g.shape
  ridx, qs = coded_query(group_queries(q, hkv).astype(jnp.float32), step, r, group_dims)
  x = jnp.moveaxis(g, 1, 3).astype(jnp.int32)  # [B, Hkv, D, NP, Wb]
  x = jnp.take_along_axis(x, ridx[:, :, :, None, None], axis=2)  # [B, Hkv, r, NP, Wb]
  per = 8 // bits
  codes = jnp.stack([(x >> (j * bits)) & (2 ** bits - 1) for j in range(per)], axis=4)
  logits = jnp.einsum("bhgr,bhrpjw->bhgpjw", qs, codes.astype(jnp.float32))
  return logits.reshape(b, hkv, qs.shape[2], npg * per * wb)


def _kernel(rows_ref, q_ref, tbl_ref, codes_ref, o_ref, *, num_kv_heads: int, head_dim: int,
            cols_per_page: int, num_cols: int, group: int, bits: int, block_n: int):
  """rows [R] int32 (-1: padding), q [G, R] f32 (scaled), tbl [NP], pool [N * Hkv * D, Wb]
  uint8 -> logits o [G, per, block_n] f32."""
  cols = pl.program_id(2) * block_n + jnp.arange(block_n)
  tile = gather_tile(codes_ref, tbl_ref, rows_ref[...], cols, num_kv_heads=num_kv_heads,
                     num_rows=head_dim, cols_per_page=cols_per_page,
                     num_cols=num_cols).astype(jnp.int32)  # [R, bn]
  mask = 2 ** bits - 1
  for j in range(8 // bits):  # static: 1 to 8 planes
    plane = ((tile >> (j * bits)) & mask).astype(jnp.float32)
    for g in range(group):
      o_ref[g, j, :] = jnp.sum(plane * q_ref[g, :][:, None], axis=0)


@functools.partial(jax.jit, static_argnames=("r", "bits", "group_dims", "interpret", "block_n",
                                             "num_warps", "num_stages"))
def paged_quant_slot_logits(q: jax.Array, codes_pages: jax.Array, step: jax.Array,
                            table: jax.Array, *, r: int, bits: int, group_dims: str = "sum",
                            interpret: bool = False, block_n: int = 128, num_warps: int = 4,
                            num_stages: int = 2) -> jax.Array:
  """Approximate logits of every slot of a paged cache from its key codes, up to a
  per-query-head constant.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    codes_pages: [N, Hkv, D, Wb] uint8 the pool's code pages (`QuantState.codes` of a paged
      state; Wb = P * bits / 8).
    step: [B, Hkv, D] float32 per-channel grid step (`QuantState.step`).
    table: [B, NP] int32 page ids of each sequence.
    r, bits, group_dims: as `kernels.quant_slot_logits` (static).
    interpret: run the kernel in Pallas interpret mode (CPU testing).
    block_n, num_warps, num_stages: as `kernels.quant_slot_logits`.
  Returns:
    [B, Hkv, G, NP * P] float32 (slot order); equals `quant.slot_logits_xla` on the paged state
    up to the order of the fp32 sums.
  """
  b, hkv, d, n, npg, wb = check_paged_codes(q, codes_pages, step, table, r, bits)
  require(block_n >= 16 and block_n == next_pow2(block_n),
          f"block_n must be a power of two >= 16, got {block_n}")
  per = 8 // bits
  g = q.shape[1] // hkv
  rp = padded_dim(r)
  ridx, qs = coded_query(group_queries(q, hkv).astype(jnp.float32), step, r, group_dims)
  rows = jnp.pad(ridx.astype(jnp.int32), ((0, 0), (0, 0), (0, rp - r)), constant_values=-1)
  qs = jnp.pad(qs, ((0, 0), (0, 0), (0, 0), (0, rp - r)))

  cols = npg * wb
  bn = max(16, min(block_n, next_pow2(cols)))
  nbb = cdiv(cols, bn)
  kernel = functools.partial(_kernel, num_kv_heads=hkv, head_dim=d, cols_per_page=wb,
                             num_cols=cols, group=g, bits=bits, block_n=bn)
  logits = pl.pallas_call(
      kernel, grid=(b, hkv, nbb),
      in_specs=[pl.BlockSpec((None, None, rp), lambda i, h, c: (i, h, 0)),
                pl.BlockSpec((None, None, g, rp), lambda i, h, c: (i, h, 0, 0)),
                pl.BlockSpec((None, npg), lambda i, h, c: (i, 0)),
                pl.BlockSpec((n * hkv * d, wb), lambda i, h, c: (0, 0))],
      out_specs=pl.BlockSpec((None, None, g, per, bn), lambda i, h, c: (i, h, 0, 0, c)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, g, per, nbb * bn), jnp.float32),
      compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
      name="rocketkv_paged_quant_slot_logits",
  )(rows, qs, table.astype(jnp.int32), codes_pages.reshape(n * hkv * d, wb))
  return page_order(logits[..., :cols], npg)
