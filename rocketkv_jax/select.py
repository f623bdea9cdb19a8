"""Stage 2 selection: which cache slots each KV head attends to for one decode query.

RocketKV's hybrid approximation, per KV head (G query heads in its group):
1. pick the `r` head dims with the largest |q| summed over the group;
2. per dim, take the chunk's kmax where the group-summed q is positive, else its kmin, and
   score each chunk as q_r . k_bound_r for every query head;
3. softmax over valid chunks per head with scale 1 / sqrt(D * sum|q_r| / sum|q|) (SparQ's
   temperature correction), sum over the group;
4. every slot takes its chunk's score; the `top_k` best valid slots are selected (`top_slots`).

The other methods plug their own scores into the same top-k (see `METHODS` in config.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax import _impl
from rocketkv_jax._checks import group_size, require, require_rank
from rocketkv_jax.cache import KVCache, bounds_of, valid_slots
from rocketkv_jax.config import DENSE_METHODS, Plan


def _chunk_valid(length: jax.Array, num_chunks: int, chunk_size: int) -> jax.Array:
  """[B, 1, NC] bool: chunk holds at least one valid slot."""
  return (jnp.arange(num_chunks) * chunk_size < length[:, None])[:, None, :]


def _group_softmax_sum(logits: jax.Array, chunk_ok: jax.Array) -> jax.Array:
  """[B, Hkv, G, NC] logits -> [B, Hkv, NC] softmax over chunks, summed over the group."""
  logits = jnp.where(chunk_ok[:, :, None, :], logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(mx), mx, 0.0))
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  # The group sum as G elementwise adds (one loop fusion): XLA:CPU hands a reduce over this
  # short axis to a library call that costs more than all of the rest of the softmax.
  return functools.reduce(jnp.add, [p[:, :, i] for i in range(p.shape[2])])


def approx_bounds_scores_xla(q: jax.Array, bounds: jax.Array, length: jax.Array,
                             chunk_size: int, r: int) -> jax.Array:
  """`approx_chunk_scores_xla` on the cache's summary layout.

  Reads only the r rows it needs: dim d's kmax row (d + D) where the group-summed q_d > 0, else
  its kmin row (d): one gather of r contiguous rows of NC values per KV head, then a small
  [G, r] x [r, NC] product (faster on XLA:CPU than masked products over all 2D rows, which
  read ~4x more).

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    bounds: [B, Hkv, 2D, NC] chunk summaries (`KVCache.bounds`: kmin rows, then kmax rows).
    length, chunk_size, r: as in `approx_chunk_scores_xla`.
  Returns:
    [B, Hkv, NC] float32 group-summed softmax scores; 0 for chunks with no valid slot.
  """
  b, hq, d = q.shape
  hkv, nc = bounds.shape[1], bounds.shape[3]
  g = hq // hkv
  qg = q.reshape(b, hkv, g, d).astype(jnp.float32)
  qabs = jnp.abs(qg)
  _, ridx = lax.top_k(jnp.sum(qabs, axis=2), r)  # [B, Hkv, r]
  pos = jnp.take_along_axis(jnp.sum(qg, axis=2) > 0, ridx, axis=-1)  # sign of the group sum
  rows = ridx + d * pos.astype(ridx.dtype)  # [B, Hkv, r] rows of bounds
  q_r = jnp.take_along_axis(qg, ridx[:, :, None, :], axis=-1)  # [B, Hkv, G, r]
  # 1 / sqrt(D * sum|q_r| / sum|q|) (SparQ's temperature correction), folded into q_r.
  frac = jnp.sum(jnp.abs(q_r), axis=-1) / jnp.maximum(jnp.sum(qabs, axis=-1), 1e-30)
  q_r = q_r * lax.rsqrt(jnp.float32(d) * jnp.where(frac > 0, frac, 1.0))[..., None]
  # The gathered rows in fp32 (the convert fuses into the gather): XLA:CPU has no bf16 x bf16
  # -> f32 kernel for every dot shape.
  k_r = jnp.take_along_axis(bounds, rows[..., None], axis=2).astype(jnp.float32)  # [B,Hkv,r,NC]
  logits = jnp.einsum("bhgr,bhrc->bhgc", q_r, k_r)
  return _group_softmax_sum(logits, _chunk_valid(length, nc, chunk_size))


def approx_chunk_scores_xla(q: jax.Array, kmin: jax.Array, kmax: jax.Array, length: jax.Array,
                            chunk_size: int, r: int) -> jax.Array:
  """RocketKV / SparQ approximate scores per chunk.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    kmin, kmax: [B, Hkv, NC, D] chunk summaries.
    length: [B] valid slots.
    chunk_size: slots per chunk.
    r: head dims kept.
  Returns:
    [B, Hkv, NC] float32 group-summed softmax scores; 0 for chunks with no valid slot.
  """
  return approx_bounds_scores_xla(q, bounds_of(kmin, kmax), length, chunk_size, r)


def quest_bounds_scores_xla(q: jax.Array, bounds: jax.Array, length: jax.Array,
                            chunk_size: int) -> jax.Array:
  """`quest_chunk_scores_xla` on the cache's summary layout `bounds [B, Hkv, 2D, NC]`.

  Since kmax >= kmin, sum_d max(q_d kmin_d, q_d kmax_d) = min(q, 0) . kmin + max(q, 0) . kmax:
  one [G, 2D] x [2D, NC] product per KV head.
  """
  b, hq, d = q.shape
  hkv, nc = bounds.shape[1], bounds.shape[3]
  qg = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
  q2 = jnp.concatenate([jnp.minimum(qg, 0.0), jnp.maximum(qg, 0.0)], axis=-1)  # [B, Hkv, G, 2D]
  logits = jnp.einsum("bhgd,bhdc->bhgc", q2, bounds.astype(jnp.float32))
  return _group_softmax_sum(logits, _chunk_valid(length, nc, chunk_size))


def quest_chunk_scores_xla(q: jax.Array, kmin: jax.Array, kmax: jax.Array, length: jax.Array,
                           chunk_size: int) -> jax.Array:
  """Quest's per-page upper bound sum_d max(q_d kmin_d, q_d kmax_d) for every query head,
  softmax over pages (scale 1/sqrt(D)) and summed over the group. kmin, kmax [B, Hkv, NC, D]
  -> [B, Hkv, NC]."""
  return quest_bounds_scores_xla(q, bounds_of(kmin, kmax), length, chunk_size)


def exact_slot_scores_xla(q: jax.Array, k: jax.Array, valid: jax.Array) -> jax.Array:
  """Oracle: exact softmax(q k^T / sqrt(D)) over valid slots, summed over the group.
  q [B, Hq, D], k [B, Hkv, C, D], valid [B, Hkv, C] -> [B, Hkv, C]."""
  b, hq, d = q.shape
  hkv = k.shape[1]
  qg = q.reshape(b, hkv, hq // hkv, d)
  logits = jnp.einsum("bhgd,bhcd->bhgc", qg, k, preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(jnp.float32(d))
  return _group_softmax_sum(logits, valid)


def top_slots(chunk_scores: jax.Array, valid: jax.Array, chunk_size: int, k: int) -> jax.Array:
  """The k best valid slots when every slot takes its chunk's score.

  Equivalent to a top-k over per-slot scores (ties to the lower slot), but the top-k runs over
  chunks: the best ceil(k / chunk_size) + 1 chunks with a valid slot always hold the k best valid
  slots (only one chunk can be partly valid), and the first k valid slots among them, in chunk-
  score order, are kept. On CPU this is ~4x faster than a slot-level top-k at large budgets.

  Args:
    chunk_scores: [B, Hkv, NC] scores.
    valid: [B, Hkv, C] bool, C <= NC * chunk_size.
    chunk_size: slots per chunk.
    k: slots to select, <= C.
  Returns:
    int32 [B, Hkv, k], no slot twice. When fewer than k slots are valid, the rest of the row
    holds distinct invalid slots (possibly >= C: `attend` masks those too).
  """
  b, h, nc = chunk_scores.shape
  c = valid.shape[-1]
  pad = nc * chunk_size - c
  valid_p = jnp.pad(valid, ((0, 0), (0, 0), (0, pad)))
  chunk_ok = jnp.any(valid_p.reshape(b, h, nc, chunk_size), axis=-1)
  kc = min(nc, -(-k // chunk_size) + 1)
  _, top_c = lax.top_k(jnp.where(chunk_ok, chunk_scores, -jnp.inf), kc)  # [B, Hkv, kc]
  slots = (top_c[..., None] * chunk_size + jnp.arange(chunk_size)).reshape(b, h, -1)
  ok = jnp.take_along_axis(valid_p, slots, axis=-1)
  # Stable partition of the candidates: valid ones first (in chunk-score order), then the rest.
  rank = jnp.cumsum(ok, axis=-1) - 1
  rank_bad = jnp.cumsum(~ok, axis=-1) - 1 + jnp.sum(ok, axis=-1, keepdims=True)
  dest = jnp.where(ok, rank, rank_bad)
  dest = jnp.where(dest < k, dest, k)  # k: dropped
  bi = jnp.arange(b)[:, None, None]
  hi = jnp.arange(h)[None, :, None]
  out = jnp.zeros((b, h, k), jnp.int32)
  return out.at[bi, hi, dest].set(slots.astype(jnp.int32), mode="drop")


def top_prefix_slots(chunk_scores: jax.Array, length: jax.Array, chunk_size: int,
                     k: int) -> jax.Array:
  """`top_slots` for the common case where the valid slots are a prefix, `[0, length)` (no
  sliding window): fewer ops, no per-slot validity mask. In the 32K / B=256 decode step it
  took the op count from 55 to 51; the step time did not change measurably.

  Only the chunk holding slot `length - 1` can be partly valid. Its `d` invalid slots are skipped
  by arithmetic on the output position: output o takes candidate o before that chunk's valid
  slots end and candidate o + d after. A gather then, instead of top_slots' two cumsums and
  scatter.

  Args:
    chunk_scores: [B, Hkv, NC] scores.
    length: [B] valid slots, >= 1.
    chunk_size: slots per chunk.
    k: slots to select, <= NC * chunk_size.
  Returns:
    int32 [B, Hkv, k], no slot twice; the same valid slots as `top_slots` (ties aside). When
    fewer than k slots are valid, the rest of the row holds distinct invalid slots (>= length).
  """
  b, h, nc = chunk_scores.shape
  cs = chunk_size
  kc = min(nc, -(-k // cs) + 1)
  length = length.astype(jnp.int32)[:, None, None]  # [B, 1, 1]
  chunk_ok = jnp.arange(nc, dtype=jnp.int32) * cs < length
  _, top_c = lax.top_k(jnp.where(chunk_ok, chunk_scores, -jnp.inf), kc)  # [B, Hkv, kc]
  part = (length - 1) // cs  # the last valid chunk
  v = length - part * cs  # its valid slots, 1..cs
  rank = jnp.arange(kc, dtype=jnp.int32)
  p = jnp.min(jnp.where(top_c == part, rank, kc), axis=-1, keepdims=True)  # its rank, or kc
  o = jnp.arange(k, dtype=jnp.int32)
  cand = o + jnp.where(o >= p * cs + v, cs - v, 0)  # [B, Hkv, k]
  in_range = cand < kc * cs
  cand = jnp.minimum(cand, kc * cs - 1)
  chunk = jnp.take_along_axis(top_c, cand // cs, axis=-1)
  # past the candidates (only when k > length): distinct slots beyond every chunk
  return jnp.where(in_range, chunk * cs + cand % cs, nc * cs + o).astype(jnp.int32)


def _streaming_indices(cache: KVCache, plan: Plan, k: int) -> jax.Array:
  """Sinks + most recent slots; all of [0, k) while the sequence holds <= k slots."""
  b, h = cache.k.shape[:2]
  s = min(plan.sink_size, k)
  j = jnp.arange(k)
  n = cache.length[:, None]
  idx = jnp.where((j < s) | (n <= k), j, n - (k - s) + (j - s))
  return jnp.broadcast_to(idx[:, None, :], (b, h, k)).astype(jnp.int32)


def check_query(q: jax.Array, cache: KVCache, name: str = "q") -> None:
  require_rank(name, q, 3, "[B, Hq, D]")
  b, hkv, _, d = cache.k.shape
  require(q.shape[0] == b and q.shape[2] == d,
          f"{name} must have shape [B={b}, Hq, D={d}], got {q.shape}")
  group_size(q.shape[1], hkv, name)


def chunk_scores(q: jax.Array, cache: KVCache, plan: Plan, impl: str = "auto") -> jax.Array:
  """[B, Hkv, NC] chunk scores of the summary methods: Quest's bounds, else RocketKV's."""
  require(plan.chunk_size == cache.chunk_size,
          f"plan.chunk_size={plan.chunk_size} must match the cache's {cache.chunk_size}")
  which, interpret = _impl.resolve(impl)
  if plan.method == "quest":
    return quest_bounds_scores_xla(q, cache.bounds, cache.length, cache.chunk_size)
  if which == "pallas":
    from rocketkv_jax import kernels
    return kernels.approx_bounds_scores(q, cache.bounds, cache.length,
                                        chunk_size=cache.chunk_size, r=plan.r,
                                        interpret=interpret)
  return approx_bounds_scores_xla(q, cache.bounds, cache.length, cache.chunk_size, plan.r)


def select(q: jax.Array, cache: KVCache, plan: Plan, *, sliding_window: int | None = None,
           impl: str = "auto") -> jax.Array:
  """Stage 2: the slots each KV head attends to.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    cache: the cache (already holding the query's own token); for `plan.stage2 == "lowrank"`
      the `LowRankState` holding it.
    plan: from `rocketkv.plan`; `plan.method` (and `plan.stage2`) choose the scoring.
    sliding_window: Mistral v0.1 window, or None.
    impl: "auto" | "xla" | "pallas" for the approximate scoring.
  Returns:
    int32 [B, Hkv, K] slot indices, K = min(plan.top_k, C) (K = C for dense methods). Only valid
    slots are picked while there are enough of them; when K >= valid slots every valid slot is
    picked, and the rest of the row points at invalid slots, which `attend` masks.
  """
  require(isinstance(plan, Plan), f"plan must be a Plan from rocketkv.plan(), got {type(plan)}")
  if plan.stage2 == "lowrank":  # its own summaries, in a LowRankState (stage2_lowrank.py)
    from rocketkv_jax import stage2_lowrank
    return stage2_lowrank.select_lowrank(q, cache, plan, sliding_window=sliding_window)
  require(isinstance(cache, KVCache), f"cache must be a KVCache, got {type(cache)}")
  check_query(q, cache)
  b, hkv, c, _ = cache.k.shape
  m = plan.method
  if m in DENSE_METHODS:
    return jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, hkv, c))
  k = min(plan.top_k, c)
  if m == "streamingllm":
    return _streaming_indices(cache, plan, k)
  valid = valid_slots(cache, sliding_window)
  if m == "exact_topk":
    return top_slots(exact_slot_scores_xla(q, cache.k, valid), valid, 1, k)
  chunk = chunk_scores(q, cache, plan, impl)
  if plan.stage2 == "rerank":  # per-token scores of the chunks' candidates (stage2_rerank.py)
    from rocketkv_jax import stage2_rerank
    return stage2_rerank.select_rerank(q, cache, plan, chunk, valid, sliding_window)
  if sliding_window is None:
    return top_prefix_slots(chunk, cache.length, cache.chunk_size, k)
  return top_slots(chunk, valid, cache.chunk_size, k)
