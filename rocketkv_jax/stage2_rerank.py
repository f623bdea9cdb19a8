"""Stage 2, `stage2="rerank"`: chunk bounds pick candidates, per-token scores pick `top_k`.

The paper's min/max chunk score gives every slot of a chunk the same score, so with chunks of 3
slots on 64-dim heads the top-k reads whole chunks around a few strong tokens and misses others
(issue #13). Here the chunk scores only shortlist `M = plan.rerank_candidates` slots (about
`rerank_factor * top_k`); each candidate is then scored on its own key, on the same r dims:

1. r dims, the sign choice and SparQ's temperature exactly as the chunk score (`select.py`);
2. candidate scores q_r . k_r from one gather of those r dims of the M candidate keys (`cache.k`);
3. softmax over the candidates per query head (invalid candidates masked), summed over the group;
4. the `top_k` best candidates (ties to the better chunk score).

Extra read per step over "minmax": M * r key values per KV head. M = ceil(1.5 * top_k) keeps the
step at <= 1.2x minmax's bytes at 32K / B=256 / D=128 (see README, "Stage-2 variants").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax.cache import KVCache
from rocketkv_jax.config import Plan
from rocketkv_jax.select import _group_softmax_sum, top_prefix_slots, top_slots


def top_dims(q: jax.Array, hkv: int, r: int):
  """The r dims stage 2 scores on, and the scaled query on them.

  Args:
    q: [B, Hq, D] decode query.
    hkv: KV heads.
    r: dims kept.
  Returns:
    (ridx [B, Hkv, r] int32 dims with the largest |q| summed over the group,
     q_r [B, Hkv, G, r] float32 q on those dims times 1 / sqrt(D * sum|q_r| / sum|q|)).
  """
  b, hq, d = q.shape
  qg = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32)
  qabs = jnp.abs(qg)
  _, ridx = lax.top_k(jnp.sum(qabs, axis=2), r)
  q_r = jnp.take_along_axis(qg, ridx[:, :, None, :], axis=-1)
  frac = jnp.sum(jnp.abs(q_r), axis=-1) / jnp.maximum(jnp.sum(qabs, axis=-1), 1e-30)
  q_r = q_r * lax.rsqrt(jnp.float32(d) * jnp.where(frac > 0, frac, 1.0))[..., None]
  return ridx, q_r


def candidate_scores_xla(q: jax.Array, k: jax.Array, cand: jax.Array, cand_ok: jax.Array,
                         r: int) -> jax.Array:
  """Per-token approximate scores of candidate slots.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    k: [B, Hkv, C, D] cache keys.
    cand: [B, Hkv, M] int32 candidate slots in [0, C).
    cand_ok: [B, Hkv, M] bool, candidate is a valid slot.
    r: head dims kept (as for the chunk score).
  Returns:
    [B, Hkv, M] float32: softmax over the valid candidates of q_r . k_r (SparQ-scaled) per query
    head, summed over the group; 0 where not `cand_ok`.
  """
  b, hkv = k.shape[:2]
  ridx, q_r = top_dims(q, hkv, r)
  bi = jnp.arange(b)[:, None, None, None]
  hi = jnp.arange(hkv)[None, :, None, None]
  # One gather of the r dims of the M candidate keys: [B, Hkv, M, r].
  k_r = k[bi, hi, cand[..., None], ridx[:, :, None, :]].astype(jnp.float32)
  logits = jnp.einsum("bhgr,bhmr->bhgm", q_r, k_r)
  return _group_softmax_sum(logits, cand_ok)


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
  c, cs = cache.capacity, cache.chunk_size
  k = min(plan.top_k, c)
  m = min(max(plan.rerank_candidates, k), c)
  if sliding_window is None:
    cand = top_prefix_slots(chunk_scores, cache.length, cs, m)
  else:
    cand = top_slots(chunk_scores, valid, cs, m)
  # Candidates past the valid slots (only when fewer than m are valid) may be >= C.
  safe = jnp.minimum(cand, c - 1)
  if sliding_window is None:
    ok = cand < cache.length[:, None, None]
  else:
    ok = jnp.take_along_axis(valid, safe, axis=-1) & (cand < c)
  scores = candidate_scores_xla(q, cache.k, safe, ok, plan.r)
  _, best = lax.top_k(jnp.where(ok, scores, -jnp.inf), k)  # ties: the lower (better) candidate
  return jnp.take_along_axis(cand, best, axis=-1)
