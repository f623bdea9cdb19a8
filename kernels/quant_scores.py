"""Stage 2 `stage2="quant"`: per-slot logits from the packed low-bit key codes, on the r dims.

Per KV head (G query heads in its group), the r dims stage 2 reads and the query scaled by each
dim's grid step are picked in XLA (`lax.top_k` over [B, Hkv, D], tiny; `ops.coded_query`, shared
with `slot_logits_xla`). The kernel, grid (batch, KV head, block of code bytes), gathers just
those r rows of `block_n` bytes straight from the codes `[B, Hkv, D, Nb]` uint8 ([R, block_n], R
= r padded to a power of two >= 16, padding rows masked), unpacks each of the `8 / bits` code
planes in registers and computes the G logit rows of each plane in fp32 as elementwise products
summed over the rows (no tensor-core dot, as `approx_scores`: a [G, R] x [R, block_n] fp32
product would pad G to 16 rows on Triton's IEEE-fp32 FMA path).
The unpacked codes never reach HBM: the step reads r * C * bits / 8 bytes of codes and writes
G * 4 bytes of logits per slot. The masked softmax over slots, the group sum and `top_k` run in
XLA (`select_quant`).

Layout (`methods/stage2/quant.py` module doc): slot i is byte i % Nb at bit (i // Nb) * bits, so
plane j of
a byte block holds slots j * Nb + [columns of the block]: the kernel writes logits as
[B, Hkv, G, per, Nb], which reshapes to slot order with no shuffle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rocketkv_jax._checks import group_size, require, require_rank
from rocketkv_jax.ops import CODE_BITS, coded_query, group_queries

from ._util import cdiv, compiler_params, load_rows, next_pow2, padded_dim



def _kernel(rows_ref, q_ref, codes_ref, o_ref, *, num_bytes: int, group: int, bits: int,
            block_n: int):
  """rows [R] int32 (-1: padding), q [G, R] f32 (scaled by the grid steps), codes [D, Nb] uint8
  -> logits o [G, per, block_n] f32."""
  tile = load_rows(codes_ref, rows_ref[...], block_n, num_bytes).astype(jnp.int32)  # [R, block_n]
  mask = 2 ** bits - 1
  for j in range(8 // bits):  # static: 1 to 8 planes
    plane = ((tile >> (j * bits)) & mask).astype(jnp.float32)
    for g in range(group):  # static: G is 1..8 for the models we run
      o_ref[g, j, :] = jnp.sum(plane * q_ref[g, :][:, None], axis=0)


def _check(q, codes, step, r, bits, capacity) -> tuple[int, int, int, int]:
  """One-line ValueErrors unless the arguments fit `quant_slot_logits`' contract (shared with
  `tpu_quant_slot_logits`); returns (B, Hkv, D, Nb)."""
  require_rank("q", q, 3, "[B, Hq, D]")
  require_rank("codes", codes, 4, "[B, Hkv, D, Nb]")
  b, hkv, d, nb = codes.shape
  require(q.shape[0] == b and q.shape[2] == d,
          f"q [B, Hq, D] and codes [B, Hkv, D, Nb] disagree: {q.shape} and {codes.shape}")
  group_size(q.shape[1], hkv, "q")
  require(codes.dtype == jnp.uint8, f"codes must be uint8, got {codes.dtype}")
  require(getattr(step, "shape", None) == (b, hkv, d),
          f"step must have shape [B, Hkv, D]={(b, hkv, d)}, got {getattr(step, 'shape', None)}")
  require(bits in CODE_BITS, f"bits must be one of {list(CODE_BITS)}, got {bits!r}")
  per = 8 // bits
  require(isinstance(capacity, int) and 1 <= capacity <= nb * per,
          f"capacity must be an int in [1, Nb * 8 / bits = {nb * per}], got {capacity!r}")
  require(isinstance(r, int) and 1 <= r <= d, f"r must be an int in [1, D={d}], got {r!r}")
  return b, hkv, d, nb


@functools.partial(jax.jit, static_argnames=("r", "bits", "capacity", "group_dims", "interpret",
                                             "block_n", "num_warps", "num_stages"))
def quant_slot_logits(q: jax.Array, codes: jax.Array, step: jax.Array, *, r: int, bits: int,
                      capacity: int, group_dims: str = "sum", interpret: bool = False,
                      block_n: int = 128, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
  """Approximate logits of every slot from its key codes, up to a per-query-head constant.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    codes: [B, Hkv, D, Nb] uint8 packed codes, dim-major (`QuantState.codes`).
    step: [B, Hkv, D] float32 per-channel grid step (`QuantState.step`).
    r: head dims read (static).
    bits: bits per code (static; one of 1, 2, 4, 8).
    capacity: the cache's slots C (static; C <= Nb * 8 / bits).
    group_dims: how the group picks the r dims, `ops.GROUP_DIMS` (static).
    interpret: run the kernel in Pallas interpret mode (CPU testing).
    block_n: code bytes per program (power of two >= 16).
    num_warps, num_stages: Triton launch parameters.
  Returns:
    [B, Hkv, G, C] float32; equals `rocketkv_jax.methods.stage2.quant.slot_logits_xla` up to the
    order
    of the fp32 sums.
  """
  b, hkv, d, nb = _check(q, codes, step, r, bits, capacity)
  per = 8 // bits
  require(block_n >= 16 and block_n == next_pow2(block_n),
          f"block_n must be a power of two >= 16, got {block_n}")
  g = q.shape[1] // hkv
  rp = padded_dim(r)

  ridx, qs = coded_query(group_queries(q, hkv).astype(jnp.float32), step, r, group_dims)
  rows = jnp.pad(ridx.astype(jnp.int32), ((0, 0), (0, 0), (0, rp - r)), constant_values=-1)
  qs = jnp.pad(qs, ((0, 0), (0, 0), (0, 0), (0, rp - r)))

  bn = max(16, min(block_n, next_pow2(nb)))
  nbb = cdiv(nb, bn)
  kernel = functools.partial(_kernel, num_bytes=nb, group=g, bits=bits, block_n=bn)
  logits = pl.pallas_call(
      kernel, grid=(b, hkv, nbb),
      in_specs=[pl.BlockSpec((None, None, rp), lambda i, h, c: (i, h, 0)),
                pl.BlockSpec((None, None, g, rp), lambda i, h, c: (i, h, 0, 0)),
                pl.BlockSpec((None, None, d, nb), lambda i, h, c: (i, h, 0, 0))],
      out_specs=pl.BlockSpec((None, None, g, per, bn), lambda i, h, c: (i, h, 0, 0, c)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, g, per, nbb * bn), jnp.float32),
      compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
      name="rocketkv_quant_slot_logits",
  )(rows, qs, codes)
  return logits[..., :nb].reshape(b, hkv, g, per * nb)[..., :capacity]
