"""Sparse decode attention over a paged KV pool (GPU, Pallas Triton): the selected rows read
through the page table.

The serving engine keeps K / V in pages shared by the sequences, `[N, Hkv, P, D]`, and sequence
b's logical slot s at page `table[b, s // P]`, row `s % P` (`rocketkv_jax/pages.py`). This is
`kernels/sparse_attention.py` (flash-decoding over the `K` slots stage 2 selected; module doc
there) with the gather moved into the pages: each program holds its sequence's page table
`[NP]`, looks up the page of each selected slot in it and gathers those K / V rows straight from
the pool (seen as rows `[N * Hkv * P, D]`: row `(page * Hkv + h) * P + s % P`), so no logical copy
of the sequence and no gathered `[B, Hkv, K, D]` copy reach HBM.

`paged_sparse_attention_reference` is the same math in jnp on the rows gathered by
`pages.gather_slots` (what the tests compare the kernel with, beside the XLA path of
`attend.paged_sparse_attention_xla` and the contiguous cache's).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from rocketkv_jax import pages
from rocketkv_jax._checks import group_size, require, require_rank
from rocketkv_jax.ops import group_queries

from ._util import cdiv, compiler_params, dot_precision, next_pow2, padded_dim
from .sparse_attention import gathered_attention, merge_splits, split_outputs

_TARGET_PROGRAMS = 256  # as kernels/sparse_attention.py


def check_paged_qkv(q, k_pages, v_pages, table, page_size) -> tuple[int, int, int, int, int]:
  """One-line ValueErrors unless q is [B, Hq, D], the pages [N, Hkv, P, D] and table [B, NP]
  int; returns (B, Hkv, N, NP, D). Shared with the TPU kernel."""
  require_rank("q", q, 3, "[B, Hq, D]")
  require_rank("k_pages", k_pages, 4, "[N, Hkv, P, D]")
  require(k_pages.shape == v_pages.shape,
          f"k_pages and v_pages must have the same shape, got {k_pages.shape} and "
          f"{v_pages.shape}")
  n, hkv, p, d = k_pages.shape
  require(isinstance(page_size, int) and page_size == p,
          f"page_size must be the pages' P={p}, got {page_size!r}")
  require_rank("table", table, 2, "[B, NP]")
  require(jnp.issubdtype(table.dtype, jnp.integer), f"table must be integer, got {table.dtype}")
  b, npg = table.shape
  require(q.shape[0] == b and q.shape[2] == d,
          f"q must have shape [B={b}, Hq, D={d}], got {q.shape}")
  group_size(q.shape[1], hkv, "q")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    require(jnp.issubdtype(x.dtype, jnp.floating), f"{name} must be floating, got {x.dtype}")
  return b, hkv, n, npg, d


def check_selection(idx, valid, b, hkv) -> None:
  """`idx [B, Hkv, K>=1]` integer slots and `valid` of its shape."""
  require(getattr(idx, "ndim", None) == 3 and idx.shape[:2] == (b, hkv) and idx.shape[2] >= 1,
          f"idx must have shape [B={b}, Hkv={hkv}, K>=1], got {getattr(idx, 'shape', None)}")
  require(jnp.issubdtype(idx.dtype, jnp.integer), f"idx must be integer, got {idx.dtype}")
  require(getattr(valid, "shape", None) == idx.shape,
          f"valid must have idx's shape {idx.shape}, got {getattr(valid, 'shape', None)}")


def paged_sparse_attention_reference(q, k_pages, v_pages, table, idx, valid, page_size):
  """jnp reference: q [B, Hq, D]; k_pages, v_pages [N, Hkv, P, D]; table [B, NP]; idx, valid
  [B, Hkv, K] (slots in [0, NP * P)) -> [B, Hq, D] in q's dtype; zeros where nothing is valid."""
  b, hq, d = q.shape
  hkv = k_pages.shape[1]
  k = pages.gather_slots(k_pages, table, idx, page_size).astype(jnp.float32)  # [B, Hkv, K, D]
  v = pages.gather_slots(v_pages, table, idx, page_size).astype(jnp.float32)
  qg = group_queries(q, hkv).astype(jnp.float32)  # [B, Hkv, G, D]
  s = jnp.einsum("bhgd,bhkd->bhgk", qg, k, precision=lax.Precision.HIGHEST) / math.sqrt(d)
  s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  out = jnp.einsum("bhgk,bhkd->bhgd", e, v, precision=lax.Precision.HIGHEST)
  out = out / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
  return out.reshape(b, hq, d).astype(q.dtype)


def _kernel(q_ref, tbl_ref, idx_ref, k_ref, v_ref, *out_refs, block_k: int, num_blocks: int,
            page_size: int, num_kv_heads: int, scale: float, qk_precision, pv_precision,
            normalize: bool, group: int):
  """q_ref [Gp, Dp]; tbl_ref [NP] this sequence's pages; idx_ref [Ks] slots (-1: masked);
  k_ref, v_ref [N * Hkv * P, Dp] the whole pool as rows. Writes the `group` real rows only."""
  h = pl.program_id(1)

  def rows_of(slot):  # [bk] logical slots -> their rows in the pool, through the table
    page = tbl_ref[slot // page_size]
    return (page * num_kv_heads + h) * page_size + slot % page_size

  gathered_attention(q_ref[...], k_ref, v_ref, idx_ref, out_refs, rows_of=rows_of,
                     block_k=block_k, num_blocks=num_blocks, scale=scale,
                     qk_precision=qk_precision, pv_precision=pv_precision,
                     normalize=normalize, group=group)


@functools.partial(jax.jit, static_argnames=("page_size", "interpret", "block_k", "num_splits",
                                             "num_warps", "num_stages"))
def paged_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           table: jax.Array, idx: jax.Array, valid: jax.Array, *,
                           page_size: int, interpret: bool = False, block_k: int = 32,
                           num_splits: int | None = None, num_warps: int = 4,
                           num_stages: int = 2) -> jax.Array:
  """Exact softmax attention of one decode query over selected rows of a paged cache.

  Args:
    q: [B, Hq, D] query (Hq = G * Hkv).
    k_pages, v_pages: [N, Hkv, P, D] the pool's key / value pages (bf16 or fp32).
    table: [B, NP] int32 page ids of each sequence (logical slot s at page table[b, s // P]).
    idx: [B, Hkv, K] int32 logical slots, already clipped into [0, NP * P).
    valid: [B, Hkv, K] bool; masked slots contribute nothing.
    page_size: P (static; the pages' axis 2).
    interpret: run the kernel in Pallas interpret mode (CPU testing).
    block_k, num_splits, num_warps, num_stages: as `kernels.sparse_attention`.
  Returns:
    [B, Hq, D] in q's dtype, scale 1/sqrt(D), fp32 accumulation; zeros where no slot is valid.
    Equals `rocketkv_jax.attend.paged_sparse_attention_xla`.
  """
  b, hkv, n, npg, d = check_paged_qkv(q, k_pages, v_pages, table, page_size)
  check_selection(idx, valid, b, hkv)
  require(block_k >= 16 and block_k == next_pow2(block_k),
          f"block_k must be a power of two >= 16, got {block_k}")
  hq = q.shape[1]
  kk = idx.shape[2]
  g = hq // hkv
  gp, dp = padded_dim(g), padded_dim(d)
  cdt = jnp.promote_types(q.dtype, k_pages.dtype)

  qg = group_queries(q, hkv).astype(cdt)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, dp - d)))
  k_rows = k_pages.reshape(n * hkv * page_size, d)  # free: the pool's own row order
  v_rows = v_pages.reshape(n * hkv * page_size, d)
  if dp != d:  # head dim not a power of two >= 16: a padded copy of the pool (slow path)
    k_rows, v_rows = (jnp.pad(x, ((0, 0), (0, dp - d))) for x in (k_rows, v_rows))

  bk = max(16, min(block_k, next_pow2(kk)))
  if num_splits is None:
    num_splits = cdiv(_TARGET_PROGRAMS, b * hkv)
  ns = max(1, min(num_splits, cdiv(kk, bk)))
  ks = cdiv(cdiv(kk, ns), bk) * bk
  ns = cdiv(kk, ks)
  enc = jnp.where(valid, idx.astype(jnp.int32), -1)
  enc = jnp.pad(enc, ((0, 0), (0, 0), (0, ns * ks - kk)), constant_values=-1)
  enc = enc.reshape(b, hkv, ns, ks)

  normalize = ns == 1
  kernel = functools.partial(
      _kernel, block_k=bk, num_blocks=ks // bk, page_size=page_size, num_kv_heads=hkv,
      scale=1.0 / math.sqrt(d), qk_precision=dot_precision(cdt),
      pv_precision=dot_precision(v_pages.dtype), normalize=normalize, group=g)
  pool_spec = pl.BlockSpec((n * hkv * page_size, dp), lambda i, h, s: (0, 0))
  in_specs = [pl.BlockSpec((None, None, gp, dp), lambda i, h, s: (i, h, 0, 0)),
              pl.BlockSpec((None, npg), lambda i, h, s: (i, 0)),
              pl.BlockSpec((None, None, None, ks), lambda i, h, s: (i, h, s, 0)),
              pool_spec, pool_spec]
  out_shape, out_specs = split_outputs(b, hkv, ns, gp, dp, q.dtype)
  outs = pl.pallas_call(
      kernel, grid=(b, hkv, ns), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
      name="rocketkv_paged_sparse_attention",
  )(qg, table.astype(jnp.int32), enc, k_rows, v_rows)
  return merge_splits(outs, g, d, q.dtype).reshape(b, hq, d)
