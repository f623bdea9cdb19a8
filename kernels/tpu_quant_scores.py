"""Stage 2 `stage2="quant"` per-slot logits from the packed key codes, for TPU (Pallas Mosaic).

The math is `kernels/quant_scores.py`'s (module doc there): per KV head the r dims stage 2 reads
and the query scaled by each dim's grid step are picked in XLA (`ops.coded_query`, shared with
`slot_logits_xla`); the logits of slot i are the sum over those r dims of q_d * code_d(i).

Whole blocks, not the r picked rows: grid (batch, KV head, block of code bytes), each step gets
a [D, bn] block of the codes `[B, Hkv, D, Nb]` uint8 through a plain BlockSpec (one DMA of whole
(32, 128) uint8 tiles, double-buffered by Pallas) and forms the G logit rows of each of the
`8 / bits` code planes as one MXU product [3 * Gp, D] x [D, bn]. The query is scattered to all D
dims in XLA with zeros off the r it reads, so the unread rows add exact zeros: the block reads
D / r times the codes' bytes of the r rows, in one DMA per block instead of r (docs/tpu.md says
why that trade).

Exact fp32 logits from bf16 MXU passes: a code (< 256) is exact in bf16, and the fp32 query is
split in XLA into three bf16 parts, hi + mid + lo == q (8 significand bits each), stacked as
rows [hi; mid; lo], each part padded to Gp = G rounded up to 8 rows (sublane-aligned slices of
the f32 result). Each product code * part is exact in the MXU's fp32 accumulator; the kernel
adds the three row groups. One bf16 pass of 3 * Gp <= 24 rows costs what one pass of G rows
does (the MXU's rows are 128 wide), where an fp32-precision product takes several.

Layout (`methods/stage2/quant.py` module doc): slot i is byte i % Nb at bit (i // Nb) * bits,
so plane j of a byte block holds slots j * Nb + [the block's columns]. The kernel writes
[B, Hkv, per, G, Nb] (plane j's [G, bn] logits as one leading-dim store); XLA moves the plane
axis behind G and reshapes to slot order. A byte block is a multiple of 128 lanes or all Nb
bytes; the last block may run past Nb (its extra columns are computed on whatever the edge
block holds, all finite codes, and dropped when written back).

The reference is `rocketkv_jax.methods.stage2.quant.slot_logits_xla` (its `slot_logits` calls
this kernel on TPU; same arguments as `kernels.quant_slot_logits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rocketkv_jax._checks import require
from rocketkv_jax.ops import coded_query, group_queries

from .quant_scores import _check
from .tpu_common import interpret_params

SUBLANES = 8  # f32 rows per vreg tile: each query part starts on a tile row


def _kernel(q_ref, codes_ref, o_ref, *, bits: int, group: int, part_rows: int):
  """q [3 * Gp, D] bf16 (hi; mid; lo parts of the scaled query, zero off the r dims);
  codes [D, bn] uint8 -> o [per, G, bn] f32 logits of each code plane."""
  x = codes_ref[...].astype(jnp.int32)  # [D, bn]
  q = q_ref[...]
  gp = part_rows
  for j in range(8 // bits):  # static: 1 to 8 planes
    plane = x if bits == 8 else (x >> (j * bits)) & (2 ** bits - 1)
    plane = plane.astype(jnp.float32).astype(jnp.bfloat16)  # codes < 256: exact in bf16
    part = jnp.dot(q, plane, preferred_element_type=jnp.float32)  # [3 * Gp, bn]
    acc = part[:gp] + (part[gp:2 * gp] + part[2 * gp:])  # hi + (mid + lo), [Gp, bn]
    o_ref[j] = acc[:group]


def split_query(qs: jax.Array, ridx: jax.Array, head_dim: int) -> jax.Array:
  """The kernel's query rows.

  Args:
    qs: [B, Hkv, G, r] float32 query on the r dims read, scaled (`ops.coded_query`).
    ridx: [B, Hkv, r] int32 those dims (distinct per (b, h)).
    head_dim: D.
  Returns:
    [B, Hkv, 3 * Gp, D] bfloat16: rows [hi; mid; lo] (Gp = G rounded up to 8, zero padding
    rows), hi + mid + lo == qs exactly on the r dims, 0 on the other D - r.
  """
  b, hkv, g, _ = qs.shape
  bi, hi = jnp.arange(b)[:, None, None], jnp.arange(hkv)[None, :, None]
  qd = jnp.zeros((b, hkv, head_dim, g), jnp.float32)
  qd = jnp.swapaxes(qd.at[bi, hi, ridx].set(jnp.swapaxes(qs, -1, -2)), -1, -2)  # [B, Hkv, G, D]
  parts, rest = [], qd
  for _ in range(3):  # 8 significand bits each: 3 x 8 covers fp32's 24
    p = rest.astype(jnp.bfloat16)
    rest = rest - p.astype(jnp.float32)  # exact in fp32
    parts.append(p)
  gp = -(-g // SUBLANES) * SUBLANES
  pad = ((0, 0), (0, 0), (0, gp - g), (0, 0))
  return jnp.concatenate([jnp.pad(p, pad) for p in parts], axis=2)


def byte_block(num_bytes: int, block_n: int) -> int:
  """Code bytes per grid step: all Nb when it fits one block, else Nb spread evenly over
  ceil(Nb / block_n) blocks, rounded up to 128 lanes (the last block's overhang stays small)."""
  if num_bytes <= block_n:
    return num_bytes
  per_block = -(-num_bytes // -(-num_bytes // block_n))
  return -(-per_block // 128) * 128


@functools.partial(jax.jit, static_argnames=("r", "bits", "capacity", "group_dims", "interpret",
                                             "block_n"))
def tpu_quant_slot_logits(q: jax.Array, codes: jax.Array, step: jax.Array, *, r: int, bits: int,
                          capacity: int, group_dims: str = "sum", interpret: bool = False,
                          block_n: int = 2048) -> jax.Array:
  """Approximate logits of every slot from its key codes, on TPU.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    codes: [B, Hkv, D, Nb] uint8 packed codes, dim-major (`QuantState.codes`); left where it is,
      read block by block.
    step: [B, Hkv, D] float32 per-channel grid step (`QuantState.step`).
    r: head dims read (static).
    bits: bits per code (static; one of `ops.CODE_BITS`).
    capacity: the cache's slots C (static; C <= Nb * 8 / bits).
    group_dims: how the group picks the r dims, `ops.GROUP_DIMS` (static).
    interpret: run in Pallas TPU interpret mode on any backend.
    block_n: most code bytes per grid step (a multiple of 128; all Nb when Nb is smaller).
  Returns:
    [B, Hkv, G, C] float32; equals `rocketkv_jax.methods.stage2.quant.slot_logits_xla` up to the
    order of the fp32 sums.
  """
  b, hkv, d, nb = _check(q, codes, step, r, bits, capacity)
  require(isinstance(block_n, int) and block_n >= 128 and block_n % 128 == 0,
          f"block_n must be a multiple of 128, got {block_n!r}")
  per = 8 // bits
  g = q.shape[1] // hkv
  # ridx [B, Hkv, r], qs [B, Hkv, G, r] -> q rows [B, Hkv, 3 * Gp, D] bf16
  ridx, qs = coded_query(group_queries(q, hkv).astype(jnp.float32), step, r, group_dims)
  q3 = split_query(qs, ridx.astype(jnp.int32), d)
  rows = q3.shape[2]
  bn = byte_block(nb, block_n)
  nbb = -(-nb // bn)

  kernel = functools.partial(_kernel, bits=bits, group=g, part_rows=rows // 3)
  logits = pl.pallas_call(
      kernel, grid=(b, hkv, nbb),
      in_specs=[pl.BlockSpec((None, None, rows, d), lambda i, h, c: (i, h, 0, 0)),
                pl.BlockSpec((None, None, d, bn), lambda i, h, c: (i, h, 0, c))],
      out_specs=pl.BlockSpec((None, None, per, g, bn), lambda i, h, c: (i, h, 0, 0, c)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, per, g, nb), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=interpret_params(interpret), name="rocketkv_tpu_quant_slot_logits",
  )(q3, codes)  # [B, Hkv, per, G, Nb]
  return jnp.swapaxes(logits, 2, 3).reshape(b, hkv, g, per * nb)[..., :capacity]
