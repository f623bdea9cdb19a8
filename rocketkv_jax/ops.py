"""Small array rules shared by the core, the methods and the kernels, each written once.

- `group_queries`: GQA regrouping of query heads under their KV head.
- `masked_softmax`: softmax over the last axis where a mask holds, 0 elsewhere: the one masking
  rule of every softmax over keys, slots or chunks (masked entries -inf, empty rows all 0).
- `group_sum`, `group_softmax_sum`, `chunk_valid`: stage 2's per-KV-head score, the softmax of
  each query head of the group summed over the group (the XLA path and the kernels' epilogue).
- `gather_rows`: the rows of `[B, H, L, D]` named by per-head indices (stage 1's kept tokens,
  stage 2's selected slots).
- `sink_recent_indices`: StreamingLLM's sink + most recent positions.
- `top_r_dims`, `approx_scale`: RocketKV / SparQ's choice of the r query dims (`GROUP_DIMS`:
  how the group's query heads weigh in it), the bound each reads (kmax where the group-summed
  q is positive, else kmin), and the softmax temperature correction
  1 / sqrt(D * sum|q_r| / sum|q|); `bound_rows_and_query` applies both (the rows of
  `KVCache.bounds` a score reads and the scaled query on them).
- `bounds_of`, `two_sided`: the cache's chunk-summary layout (kmin rows, then kmax rows; or one
  copy of the keys for chunks of one slot).
- `WINDOW_REDUCE`: stage 1's reductions of the window's scores.
- `CODE_BITS`, `coded_query`: stage2="quant"'s code widths and the query that multiplies the
  codes (the XLA path and the kernel).

The kernels import only this module and `_checks`, so what they share with the core lives here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax._checks import require


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
  """`[B, Hq, ...]` -> `[B, Hkv, G, ...]`, G = Hq // Hkv: query head h serves KV head h // G."""
  b, hq = q.shape[:2]
  return q.reshape(b, num_kv_heads, hq // num_kv_heads, *q.shape[2:])


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis of the entries where `mask` (broadcastable) holds; rows with no
  such entry are all zeros (never NaN)."""
  logits = jnp.where(mask, logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(mx), mx, 0.0))
  return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


def group_sum(p: jax.Array) -> jax.Array:
  """[B, Hkv, G, N] -> [B, Hkv, N], the sum over the group.

  As G elementwise adds (one loop fusion): XLA:CPU hands a reduce over this short axis to a
  library call that costs more than all of the rest of the softmax."""
  return functools.reduce(jnp.add, [p[:, :, i] for i in range(p.shape[2])])


def group_softmax_sum(logits: jax.Array, ok: jax.Array) -> jax.Array:
  """[B, Hkv, G, N] logits, ok [B, Hkv | 1, N] -> [B, Hkv, N]: softmax over the `ok` entries
  per query head, summed over the group."""
  return group_sum(masked_softmax(logits, ok[:, :, None, :]))


def chunk_valid(length: jax.Array, num_chunks: int, chunk_size: int) -> jax.Array:
  """[B, 1, NC] bool: the chunk holds at least one of the `length [B]` valid slots."""
  return (jnp.arange(num_chunks) * chunk_size < length[:, None])[:, None, :]


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x `[B, H, L, D]`, idx `[B, H, K]` (in [0, L)) -> `[B, H, K, D]`, row idx[b, h, j] of head h."""
  return jnp.take_along_axis(x, idx[..., None], axis=2)


def sink_recent_indices(n: jax.Array, k: int, sink: int) -> jax.Array:
  """StreamingLLM's positions: the first min(sink, k) and the last k - sink of n tokens.

  Args:
    n: [B] tokens held.
    k: positions to return (static).
    sink: attention-sink tokens (static).
  Returns:
    [B, k] int32; all of [0, k) while n <= k.
  """
  s = min(sink, k)
  j = jnp.arange(k)
  n = n[:, None]
  return jnp.where((j < s) | (n <= k), j, n - (k - s) + (j - s))


# How the G query heads of a KV head's group weigh in the choice of the r dims: "sum" (SparQ
# and the paper: |q| summed over the group) or "normalized" (each head's |q| divided by its own
# sum over the dims first, so every head counts the same, as the group-summed softmax counts them).
GROUP_DIMS = ("sum", "normalized")


def dim_weights(qg: jax.Array, group_dims: str = "sum") -> jax.Array:
  """Per-dim weights the r dims are the largest of: qg [B, Hkv, G, D] -> [B, Hkv, D] float32."""
  a = jnp.abs(qg)
  if group_dims == "normalized":
    a = a / jnp.maximum(jnp.sum(a, axis=-1, keepdims=True), 1e-30)
  return jnp.sum(a, axis=2)


def top_r_dims(qg: jax.Array, r: int, group_dims: str = "sum") -> tuple[jax.Array, jax.Array]:
  """RocketKV / SparQ's approximate-score dims.

  Args:
    qg: [B, Hkv, G, D] float32 queries grouped by KV head.
    r: dims to keep (static).
    group_dims: one of `GROUP_DIMS` (static).
  Returns:
    (ridx [B, Hkv, r] the r dims with the largest `dim_weights` (ties to the lower dim),
     positive [B, Hkv, D] whether the group-summed q_d > 0: dim d then reads the chunk's kmax,
     else its kmin).
  """
  _, ridx = lax.top_k(dim_weights(qg, group_dims), r)
  return ridx, jnp.sum(qg, axis=2) > 0


def approx_scale(q_r: jax.Array, qg: jax.Array) -> jax.Array:
  """1 / sqrt(D * sum|q_r| / sum|q|) per query head (SparQ's temperature correction).

  q_r: [B, Hkv, G, r] the kept dims (or [B, Hkv, G, D] with the others zeroed); qg:
  [B, Hkv, G, D] the whole query. Returns [B, Hkv, G] float32.
  """
  frac = jnp.sum(jnp.abs(q_r), axis=-1) / jnp.maximum(jnp.sum(jnp.abs(qg), axis=-1), 1e-30)
  return lax.rsqrt(jnp.float32(qg.shape[-1]) * jnp.where(frac > 0, frac, 1.0))


def bound_rows_and_query(qg: jax.Array, r: int, two_sided: bool = True,
                         group_dims: str = "sum") -> tuple[jax.Array, jax.Array, jax.Array]:
  """The r summary rows one RocketKV approximate score reads, and the scaled query on them.

  Args:
    qg: [B, Hkv, G, D] float32 queries grouped by KV head.
    r: dims to keep (static).
    two_sided: the summaries hold kmin and kmax rows (`KVCache.bounds` [.., 2D, NC]); False for
      one copy of the keys ([.., D, C], chunks of one slot: `cache.two_sided`).
    group_dims: one of `GROUP_DIMS`, how the group picks the dims (`top_r_dims`).
  Returns:
    (ridx [B, Hkv, r] the kept dims (`top_r_dims`),
     rows [B, Hkv, r] their rows of `KVCache.bounds`: d + D (kmax) where the group-summed
       q_d > 0, else d (kmin); d with one copy,
     q_r [B, Hkv, G, r] q on those dims times `approx_scale`).
  """
  ridx, positive = top_r_dims(qg, r, group_dims)
  if two_sided:
    pos = jnp.take_along_axis(positive, ridx, axis=-1)
    rows = ridx + qg.shape[-1] * pos.astype(ridx.dtype)
  else:
    rows = ridx
  q_r = jnp.take_along_axis(qg, ridx[:, :, None, :], axis=-1)
  return ridx, rows, q_r * approx_scale(q_r, qg)[..., None]


def bounds_of(kmin: jax.Array, kmax: jax.Array) -> jax.Array:
  """kmin, kmax [B, H, NC, D] -> bounds [B, H, 2D, NC] (the cache's summary layout)."""
  return jnp.concatenate([jnp.swapaxes(kmin, 2, 3), jnp.swapaxes(kmax, 2, 3)], axis=2)


def two_sided(bounds: jax.Array, head_dim: int) -> bool:
  """Whether `bounds [B, H, rows, NC]` holds kmin and kmax rows (2D) or one copy (D rows)."""
  require(bounds.shape[2] in (head_dim, 2 * head_dim),
          f"bounds must have D={head_dim} or 2D={2 * head_dim} rows, got {bounds.shape[2]}")
  return bounds.shape[2] == 2 * head_dim


# Stage 1's reduction of the window queries' scores over the W queries and the group's heads.
WINDOW_REDUCE = ("sum", "max")

# Bits per key code of stage2="quant" (`methods/stage2/quant.py`).
CODE_BITS = (1, 2, 4, 8)


def coded_query(qg: jax.Array, step: jax.Array, r: int,
                group_dims: str = "sum") -> tuple[jax.Array, jax.Array]:
  """The r dims a stage2="quant" step reads and the query that multiplies their codes.

  Args:
    qg: [B, Hkv, G, D] float32 queries grouped by KV head.
    step: [B, Hkv, D] per-channel grid steps.
    r: dims read (static).
    group_dims: how the group's heads weigh in the choice of dims (`GROUP_DIMS`, static).
  Returns:
    (ridx [B, Hkv, r] the dims (`top_r_dims`), qs [B, Hkv, G, r] q on them times SparQ's
     temperature and each dim's grid step).
  """
  ridx, _, q_r = bound_rows_and_query(qg, r, group_dims=group_dims)
  return ridx, q_r * jnp.take_along_axis(step, ridx, axis=-1)[:, :, None, :]
