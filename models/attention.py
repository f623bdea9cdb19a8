"""Blockwise causal attention for long-prompt prefill (flash-attention style, pure JAX).

Queries are processed one block of `block_size` rows at a time (`lax.map`), and for each query
block only the key blocks that can be visible are visited (`lax.fori_loop` with traced bounds):
blocks strictly above the causal diagonal are skipped, and with a sliding window so are blocks
entirely older than the window. Without a window only the diagonal tile is masked, by adding a
constant triangular bias. An online softmax (running max / running sum, float32) combines the
visited blocks, so the largest intermediate is `[B, Hkv, G, block, block]` and an `[L, L]` score
matrix is never materialised: an 8K prompt costs O(L * block) memory per layer.

On XLA:CPU q is scaled once rather than every score tile, tiles are 512 rows, and the
diagonal tile is visited first (`one_query_block`); why: docs/roofline.md#prefill.

Right-padded batches need no extra mask: a padded query at index p >= length still sees the
valid keys (and itself), so no row is ever fully masked, and padded rows are ignored downstream.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30  # finite "minus infinity": keeps fully-masked tiles NaN-free.


def blockwise_causal_attention(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    *,
    sliding_window: int | None = None,
    block_size: int = 512,
) -> jnp.ndarray:
  """Causal GQA attention without an `[L, L]` matrix.

  Args:
    q: `[B, Hq, L, Dh]` post-RoPE queries (query index = absolute position).
    k: `[B, Hkv, L, Dh]` post-RoPE keys.
    v: `[B, Hkv, L, Dh]` values.
    sliding_window: None, or W: query i sees keys j with i - W < j <= i (Mistral v0.1).
    block_size: query and key tile length (clamped to L); static.

  Returns:
    `[B, Hq, L, Dh]` attention output in `q.dtype` (softmax scale 1/sqrt(Dh)).
  """
  b, hq, length, d = q.shape
  hkv = k.shape[1]
  g = hq // hkv
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  if b > 1 and jax.default_backend() == "cpu":
    # On CPU, one sequence at a time: the score tiles stay [1, Hkv, G, bs, bs] and in cache
    # (batched tiles are slower per layer: docs/roofline.md#prefill).
    # The outputs overwrite the queries row by row (row b is read before it is written): a
    # loop that makes its own output buffer starts it as a constant, which XLA may schedule at
    # the start of the program -- in an unrolled prompt pass, one per layer, all live at once.
    def one(i, out):
      row = lambda x: lax.dynamic_slice_in_dim(x, i, 1, axis=0)
      o = blockwise_causal_attention(row(out), row(k), row(v), sliding_window=sliding_window,
                                     block_size=block_size)
      return lax.dynamic_update_slice_in_dim(out, o, i, axis=0)
    return lax.fori_loop(0, b, one, q)
  bs = min(block_size, length)
  n = -(-length // bs)
  padded = n * bs
  pad = [(0, 0), (0, 0), (0, padded - length), (0, 0)]
  q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  # Scaling q once ([L, Dh] multiplies) instead of every score tile ([L, L] / 2 multiplies):
  # a separate pass over each tile that costs more than the exp. Exact for Dh = 64 / 256
  # (power-of-two scale); one extra rounding of q otherwise.
  q = q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
  # [n, B, Hkv, G, bs, Dh]
  q_blocks = q.reshape(b, hkv, g, n, bs, d).transpose(3, 0, 1, 2, 4, 5)
  offsets = jnp.arange(bs, dtype=jnp.int32)
  causal_bias = jnp.where(offsets[None, :] <= offsets[:, None], 0.0, _NEG).astype(jnp.float32)

  def one_query_block(args):
    i, qb = args
    q_pos = i * bs + offsets  # [bs]
    if sliding_window is None:
      first = jnp.int32(0)
    else:
      first = jnp.maximum(0, (i * bs - (sliding_window - 1)) // bs)

    def visit(j, carry, masked=True):
      m, l, acc = carry
      kb = lax.dynamic_slice_in_dim(k, j * bs, bs, axis=2)  # [B, Hkv, bs, Dh]
      vb = lax.dynamic_slice_in_dim(v, j * bs, bs, axis=2)
      s = jnp.einsum("bhgqd,bhkd->bhgqk", qb, kb, preferred_element_type=jnp.float32)
      if masked and sliding_window is None:
        s = s + causal_bias  # the diagonal tile: a constant triangle, cheaper than a select
      elif masked:
        k_pos = j * bs + offsets
        mask = k_pos[None, :] <= q_pos[:, None]
        mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        s = jnp.where(mask, s, _NEG)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])  # masked entries: exp(-1e30 - m) = 0
      if sliding_window is not None:
        # a row with no visible key in this tile has m_new = -1e30 and p = 1 on masked
        # entries; zero them (without a window every row of a visited tile sees a key)
        p = jnp.where(mask, p, 0.0)
      alpha = jnp.exp(m - m_new)
      l = l * alpha + p.sum(-1)
      acc = acc * alpha[..., None] + jnp.einsum(
          "bhgqk,bhkd->bhgqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
      return m_new, l, acc

    init = (jnp.full((b, hkv, g, bs), _NEG, jnp.float32),
            jnp.zeros((b, hkv, g, bs), jnp.float32),
            jnp.zeros((b, hkv, g, bs, d), jnp.float32))
    if sliding_window is None:
      # the diagonal tile first (the online softmax is order-free), then the blocks strictly
      # below it, which are fully visible: no mask work at all. (Diagonal last let XLA:CPU fuse
      # that tile's max, exp, sum, product and the final divide into one slower library call:
      # docs/roofline.md#prefill.)
      carry = visit(i, init)
      _, l, acc = lax.fori_loop(first, i, lambda j, c: visit(j, c, masked=False), carry)
    else:
      _, l, acc = lax.fori_loop(first, i + 1, visit, init)
    return (acc / l[..., None]).astype(q.dtype)

  out = lax.map(one_query_block, (jnp.arange(n, dtype=jnp.int32), q_blocks))
  out = out.transpose(1, 2, 3, 0, 4, 5).reshape(b, hq, padded, d)
  return out[:, :, :length]


def reference_attention(q, k, v, *, sliding_window=None):
  """Dense `[L, L]` reference (tests only): same contract as `blockwise_causal_attention`."""
  b, hq, length, d = q.shape
  g = hq // k.shape[1]
  k = jnp.repeat(k, g, axis=1)
  v = jnp.repeat(v, g, axis=1)
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
  i = jnp.arange(length)[:, None]
  j = jnp.arange(length)[None, :]
  mask = j <= i
  if sliding_window is not None:
    mask &= (i - j) < sliding_window
  s = jnp.where(mask, s, _NEG)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v).astype(q.dtype)
