"""`Rerank(factor=1.5)`: chunk bounds pick candidates, per-token scores pick `top_k`.

The chunk scores shortlist `Rerank.candidates(top_k)` slots (`ceil(factor * top_k)`); each
candidate is scored on its own key on the same r dims, and the best `top_k` are attended
(`decode_attend` reuses the candidate K rows). Design and measurements: docs/stage2_variants.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax._checks import require
from rocketkv_jax.attend import softmax_combine
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import KVCache, valid_slots
from rocketkv_jax.methods.stage2.base import Stage2
from rocketkv_jax.ops import bound_rows_and_query, group_queries, group_softmax_sum
from rocketkv_jax.select import approx_scores, check_chunks, top_chunk_slots


@dataclasses.dataclass(frozen=True)
class Rerank(Stage2):
  """Attributes:
    factor: candidates per selected slot (>= 1): the chunk bounds shortlist
      `ceil(factor * top_k)` slots, re-scored per token.
  """

  name = "rerank"
  factor: float = 1.5

  def __post_init__(self):
    f = self.factor
    require(isinstance(f, (int, float)) and not isinstance(f, bool) and f >= 1,
            f"Rerank.factor must be a number >= 1, got {f!r}")

  def candidates(self, top_k: int) -> int:
    """M: slots the chunk bounds shortlist for `top_k` (capped at the capacity when selecting)."""
    return max(top_k, math.ceil(self.factor * top_k))

  def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
    require(isinstance(state, KVCache),
            f"a stage2={self.name!r} plan needs a KVCache, got a {type(state).__name__}")
    check_chunks(state, plan.chunk_size)
    chunk = approx_scores(q, state, plan.r, group_dims=plan.group_dims, impl=impl)
    return select_rerank(q, state, plan, chunk, valid_slots(state, sliding_window),
                         sliding_window)

  def attend(self, q, state, plan, *, sliding_window=None, impl="auto"):
    # Attends from the candidate K rows it already read (`decode_attend`).
    return decode_attend(q, state, plan, sliding_window=sliding_window, impl=impl)


def top_dims(q: jax.Array, hkv: int, r: int, group_dims: str = "sum"):
  """The r dims stage 2 scores on, and the scaled query on them.

  Args:
    q: [B, Hq, D] decode query.
    hkv: KV heads.
    r: dims kept.
    group_dims: how the group's heads weigh in the choice (`ops.GROUP_DIMS`).
  Returns:
    (ridx [B, Hkv, r] int32 dims of `ops.top_r_dims`,
     q_r [B, Hkv, G, r] float32 q on those dims times 1 / sqrt(D * sum|q_r| / sum|q|)).
  """
  qg = group_queries(q, hkv).astype(jnp.float32)
  ridx, _, q_r = bound_rows_and_query(qg, r, group_dims=group_dims)
  return ridx, q_r


def _logits_of_rows(q: jax.Array, rows: jax.Array, r: int, group_dims: str = "sum"):
  """q [B, Hq, D], rows [B, Hkv, M, D] float32 -> (approximate logits q_r . k_r, SparQ-scaled,
  and exact logits q . k / sqrt(D)), each [B, Hkv, G, M] float32, from one product.

  q_r . k_r is a [G, D] x [D, M] product with q zeroed outside its r dims: exactly the r-dim
  product, from whole rows (one row gather is much cheaper on XLA:CPU than an element gather of
  r scattered dims, and the exact logits for the attention come from the same rows)."""
  b, hkv, _, d = rows.shape
  g = q.shape[1] // hkv
  ridx, q_r = top_dims(q, hkv, r, group_dims)
  # q_r scattered back to [B, Hkv, G, D]: one-hot [r, D] masks summed (r distinct dims).
  onehot = (ridx[..., None] == jnp.arange(d)).astype(jnp.float32)  # [B, Hkv, r, D]
  q_masked = jnp.einsum("bhgr,bhrd->bhgd", q_r, onehot)
  q_full = q.reshape(b, hkv, g, d).astype(jnp.float32) * lax.rsqrt(jnp.float32(d))
  logits = jnp.einsum("bhgd,bhmd->bhgm", jnp.concatenate([q_masked, q_full], axis=2), rows)
  return logits[:, :, :g], logits[:, :, g:]


def scores_of_rows(q: jax.Array, rows: jax.Array, ok: jax.Array, r: int,
                   group_dims: str = "sum") -> jax.Array:
  """Per-token approximate scores of gathered key rows.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    rows: [B, Hkv, M, D] float32 candidate keys.
    ok: [B, Hkv, M] bool, candidate is a valid slot.
    r: head dims kept (as for the chunk score).
    group_dims: as for the chunk score (`ops.GROUP_DIMS`).
  Returns:
    [B, Hkv, M] float32: softmax over the valid candidates of q_r . k_r (SparQ-scaled) per query
    head, summed over the group; 0 where not `ok`.
  """
  return group_softmax_sum(_logits_of_rows(q, rows, r, group_dims)[0], ok)


def candidate_scores_xla(q: jax.Array, k: jax.Array, cand: jax.Array, cand_ok: jax.Array,
                         r: int, group_dims: str = "sum") -> jax.Array:
  """`scores_of_rows` of the candidate slots `cand [B, Hkv, M]` (in [0, C)) of `k [B, Hkv, C,
  D]`; `cand_ok [B, Hkv, M]` marks the valid ones. Returns [B, Hkv, M] float32."""
  rows = jnp.take_along_axis(k, cand[..., None], axis=2).astype(jnp.float32)
  return scores_of_rows(q, rows, cand_ok, r, group_dims)


def _rerank(q, cache, plan, chunk_scores, valid, sliding_window):
  """Returns (cand [B, Hkv, M] candidate slots, ok [B, Hkv, M] valid, best [B, Hkv, k] positions
  of the top_k among them, exact logits [B, Hkv, G, M] of the candidates)."""
  c = cache.capacity
  k = min(plan.top_k, c)
  m = min(max(plan.stage2.candidates(plan.top_k), k), c)
  cand = top_chunk_slots(chunk_scores, cache, m, sliding_window)
  # Candidates past the valid slots (only when fewer than m are valid) may be >= C.
  safe = jnp.minimum(cand, c - 1)
  ok = jnp.take_along_axis(valid, safe, axis=-1) & (cand < c)
  rows = jnp.take_along_axis(cache.k, safe[..., None], axis=2).astype(jnp.float32)
  approx, exact = _logits_of_rows(q, rows, plan.r, plan.group_dims)
  scores = group_softmax_sum(approx, ok)
  _, best = lax.top_k(jnp.where(ok, scores, -jnp.inf), k)  # ties: the lower (better) candidate
  return cand, ok, best, exact


def select_rerank(q: jax.Array, cache: KVCache, plan: Plan, chunk_scores: jax.Array,
                  valid: jax.Array, sliding_window: int | None) -> jax.Array:
  """The `top_k` slots per KV head, re-ranked from the chunk scores' candidates.

  Args:
    q: [B, Hq, D] decode query.
    cache: the cache (holding the query's own token).
    plan: a "rerank" plan.
    chunk_scores: [B, Hkv, NC] the min/max chunk scores.
    valid: [B, Hkv, C] `valid_slots(cache, sliding_window)`.
    sliding_window: as in `select`.
  Returns:
    int32 [B, Hkv, min(top_k, C)], as `select`: no slot twice; when fewer slots than that are
    valid, every valid slot and distinct invalid ones.
  """
  cand, _, best, _ = _rerank(q, cache, plan, chunk_scores, valid, sliding_window)
  return jnp.take_along_axis(cand, best, axis=-1)


def decode_attend(q: jax.Array, cache: KVCache, plan: Plan, *,
                  sliding_window: int | None = None, impl: str = "auto") -> jax.Array:
  """Stage 2 + attention of one decode step for a "rerank" plan: `attend(q, cache,
  select(q, cache, plan))`, with the attention logits of the selected slots taken from the
  candidate K rows already read (K is read once, for the M candidates; V for the top_k).
  XLA path (the Pallas kernels score the chunks). Returns [B, Hq, D] in q's dtype."""
  check_chunks(cache, plan.chunk_size)
  valid = valid_slots(cache, sliding_window)
  chunk = approx_scores(q, cache, plan.r, group_dims=plan.group_dims, impl=impl)
  cand, ok, best, exact = _rerank(q, cache, plan, chunk, valid, sliding_window)
  c = cache.capacity
  slots = jnp.minimum(jnp.take_along_axis(cand, best, axis=-1), c - 1)
  sel_ok = jnp.take_along_axis(ok, best, axis=-1)  # [B, Hkv, k]
  logits = jnp.take_along_axis(exact, best[:, :, None, :], axis=-1)  # [B, Hkv, G, k]
  v_sel = jnp.take_along_axis(cache.v, slots[..., None], axis=2).astype(jnp.float32)
  out = softmax_combine(logits, sel_ok, v_sel)
  b, hq, d = q.shape
  return out.reshape(b, hq, d).astype(q.dtype)
