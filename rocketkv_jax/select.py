"""Stage 2 selection: which cache slots each KV head attends to for one decode query.

RocketKV's hybrid approximation, per KV head (G query heads in its group):
1. pick the `r` head dims with the largest |q| summed over the group;
2. per dim, take the chunk's kmax where the group-summed q is positive, else its kmin, and
   score each chunk as q_r . k_bound_r for every query head;
3. softmax over valid chunks per head with scale 1 / sqrt(D * sum|q_r| / sum|q|) (SparQ's
   temperature correction), sum over the group;
4. every slot takes its chunk's score; the `top_k` best valid slots are selected (`top_slots`).

This module holds the scoring and top-k building blocks; each method's `select`
(rocketkv_jax/methods/) composes them, and `rocketkv.select` dispatches on `plan.method`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax import _impl, pages
from rocketkv_jax._checks import group_size, require, require_layout, require_rank
from rocketkv_jax.cache import KVCache, bounds_of, from_storage, two_sided, valid_slots
from rocketkv_jax.ops import (bound_rows_and_query, chunk_valid, group_queries,
                              group_softmax_sum, sink_recent_indices)


def approx_bounds_scores_xla(q: jax.Array, bounds: jax.Array, length: jax.Array,
                             chunk_size: int, r: int, group_dims: str = "sum") -> jax.Array:
  """`approx_chunk_scores_xla` on the cache's summary layout.

  Reads only the r rows it needs: dim d's kmax row (d + D) where the group-summed q_d > 0, else
  its kmin row (d): one gather of r contiguous rows of NC values per KV head, then a small
  [G, r] x [r, NC] product (it reads less than masked products over all 2D rows:
  docs/cpu_performance.md#what-the-decode-step-looks-like).

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    bounds: [B, Hkv, 2D, NC] chunk summaries (`KVCache.bounds`: kmin rows, then kmax rows), or
      with chunk_size 1 the keys' one copy [B, Hkv, D, C].
    length, chunk_size, r, group_dims: as in `approx_chunk_scores_xla`.
  Returns:
    [B, Hkv, NC] float32 group-summed softmax scores; 0 for chunks with no valid slot.
  """
  def logits_of(q_r, rows):
    # The rows in fp32 (the convert fuses into the gather): XLA:CPU has no bf16 x bf16 -> f32
    # kernel for every dot shape.
    k_r = jnp.take_along_axis(bounds, rows[..., None], axis=2).astype(jnp.float32)
    return jnp.einsum("bhgr,bhrc->bhgc", q_r, k_r)  # k_r [B, Hkv, r, NC]

  return _approx_scores(q, logits_of, bounds.shape[1], bounds.shape[3],
                        two_sided(bounds, q.shape[2]), length, chunk_size, r, group_dims)


def paged_approx_scores_xla(q: jax.Array, cache: KVCache, r: int,
                            group_dims: str = "sum") -> jax.Array:
  """`approx_bounds_scores_xla` on a paged cache: the r rows of every page, read in pool order
  or through the table (`pages.pool_or_table`), the same bytes as the contiguous read."""
  raw, table = cache.bounds_raw, cache.table
  f32 = lambda x: from_storage(x, cache.dtype).astype(jnp.float32)

  def logits_of(q_r, rows):
    def in_place(owner):  # every page against its owner's rows and query
      k_r = f32(jnp.take_along_axis(raw, rows[owner][..., None], axis=2))  # [N, Hkv, r, W]
      return pages.in_table_order(jnp.einsum("nhgr,nhrc->nhgc", q_r[owner], k_r), table)

    def through_table():  # [B, Hkv, r, NP * W]: each page's columns in turn
      return jnp.einsum("bhgr,bhrc->bhgc", q_r, f32(pages.gather_cols(raw, table, rows)))

    return pages.pool_or_table(table, cache.length, cache.page_size, raw.shape[0], in_place,
                               through_table)

  return _approx_scores(q, logits_of, raw.shape[1], cache.num_chunks,
                        two_sided(raw, q.shape[2]), cache.length, cache.chunk_size, r,
                        group_dims)


def _approx_scores(q, logits_of, hkv, nc, two, length, chunk_size, r, group_dims):
  """Steps 1-3 of the module doc; `logits_of(q_r [B, Hkv, G, r], rows [B, Hkv, r]) -> [B, Hkv,
  G, NC]`, the r summary rows times q_r."""
  qg = group_queries(q, hkv).astype(jnp.float32)
  # [B, Hkv, r] rows of bounds, [B, Hkv, G, r]
  _, rows, q_r = bound_rows_and_query(qg, r, two, group_dims)
  return group_softmax_sum(logits_of(q_r, rows), chunk_valid(length, nc, chunk_size))


def approx_chunk_scores_xla(q: jax.Array, kmin: jax.Array, kmax: jax.Array, length: jax.Array,
                            chunk_size: int, r: int, group_dims: str = "sum") -> jax.Array:
  """RocketKV / SparQ approximate scores per chunk.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    kmin, kmax: [B, Hkv, NC, D] chunk summaries.
    length: [B] valid slots.
    chunk_size: slots per chunk.
    r: head dims kept.
    group_dims: how the group's heads weigh in the choice of the r dims (`ops.GROUP_DIMS`).
  Returns:
    [B, Hkv, NC] float32 group-summed softmax scores; 0 for chunks with no valid slot.
  """
  return approx_bounds_scores_xla(q, bounds_of(kmin, kmax), length, chunk_size, r, group_dims)


def quest_bounds_scores_xla(q: jax.Array, bounds: jax.Array, length: jax.Array,
                            chunk_size: int) -> jax.Array:
  """`quest_chunk_scores_xla` on the cache's summary layout `bounds [B, Hkv, 2D, NC]`.

  Since kmax >= kmin, sum_d max(q_d kmin_d, q_d kmax_d) = min(q, 0) . kmin + max(q, 0) . kmax:
  one [G, 2D] x [2D, NC] product per KV head (pages of one slot, one copy of the keys: q . k).
  """
  d = q.shape[2]
  hkv, nc = bounds.shape[1], bounds.shape[3]
  qg = group_queries(q, hkv).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
  q2 = (jnp.concatenate([jnp.minimum(qg, 0.0), jnp.maximum(qg, 0.0)], axis=-1)  # [.., G, 2D]
        if two_sided(bounds, d) else qg)
  logits = jnp.einsum("bhgd,bhdc->bhgc", q2, bounds.astype(jnp.float32))
  return group_softmax_sum(logits, chunk_valid(length, nc, chunk_size))


def quest_chunk_scores_xla(q: jax.Array, kmin: jax.Array, kmax: jax.Array, length: jax.Array,
                           chunk_size: int) -> jax.Array:
  """Quest's per-page upper bound sum_d max(q_d kmin_d, q_d kmax_d) for every query head,
  softmax over pages (scale 1/sqrt(D)) and summed over the group. kmin, kmax [B, Hkv, NC, D]
  -> [B, Hkv, NC]."""
  return quest_bounds_scores_xla(q, bounds_of(kmin, kmax), length, chunk_size)


def exact_slot_scores_xla(q: jax.Array, k: jax.Array, valid: jax.Array) -> jax.Array:
  """Oracle: exact softmax(q k^T / sqrt(D)) over valid slots, summed over the group.
  q [B, Hq, D], k [B, Hkv, C, D], valid [B, Hkv, C] -> [B, Hkv, C]."""
  d = q.shape[2]
  qg = group_queries(q, k.shape[1])
  logits = jnp.einsum("bhgd,bhcd->bhgc", qg, k, preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(jnp.float32(d))
  return group_softmax_sum(logits, valid)


def top_slots(chunk_scores: jax.Array, valid: jax.Array, chunk_size: int, k: int) -> jax.Array:
  """The k best valid slots when every slot takes its chunk's score.

  Equivalent to a top-k over per-slot scores (ties to the lower slot), but the top-k runs over
  chunks: the best ceil(k / chunk_size) + 1 chunks with a valid slot always hold the k best valid
  slots (only one chunk can be partly valid), and the first k valid slots among them, in chunk-
  score order, are kept: a much smaller top-k (docs/cpu_performance.md).

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


def top_scored_slots(scores: jax.Array, ok: jax.Array, k: int, capacity: int,
                     slot_of=None) -> jax.Array:
  """The k best `ok` entries of per-entry scores, as cache slots (the per-token stage-2 variants'
  last step).

  Args:
    scores: [B, Hkv, N] scores.
    ok: [B, Hkv, N] bool, the entries that may be picked.
    k: entries to pick (static, <= N).
    capacity: C, the cache's slots.
    slot_of: maps picked entry indices [B, Hkv, k] to slots (default: the index is the slot).
  Returns:
    int32 [B, Hkv, k], ties to the lower entry; where fewer than k entries are `ok`, distinct
    invalid slots C + j (which `attend` masks).
  """
  _, best = lax.top_k(jnp.where(ok, scores, -jnp.inf), k)
  picked = jnp.take_along_axis(ok, best, axis=-1)
  slot = best if slot_of is None else slot_of(best)
  return jnp.where(picked, slot, capacity + jnp.arange(k)).astype(jnp.int32)


def streaming_slots(cache: KVCache, sink_size: int, k: int) -> jax.Array:
  """StreamingLLM's read: the sink slots and the most recent ones; all of [0, k) while the
  sequence holds <= k slots. Returns int32 [B, Hkv, k]."""
  b, h = cache.k.shape[:2]
  idx = sink_recent_indices(cache.length, k, sink_size)
  return jnp.broadcast_to(idx[:, None, :], (b, h, k)).astype(jnp.int32)


def all_slots(cache: KVCache) -> jax.Array:
  """Every slot, `[B, Hkv, C]` int32: the read of a dense method (`attend` masks invalid ones)."""
  b, hkv, c, _ = cache.k.shape
  return jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, hkv, c))


def check_query(q: jax.Array, cache: KVCache, name: str = "q") -> None:
  """`q` must be `[B, Hq, D]` for the cache's B, D, with Hq a multiple of its Hkv."""
  require(isinstance(cache, KVCache), f"cache must be a KVCache, got {type(cache).__name__} "
          f"(a method's state: read its cache with methods.get(plan.method).view(state))")
  shape = getattr(q, "shape", ())
  if len(shape) == 4 and 1 in shape[1:3]:  # the prompt's [B, Hq, T, D] (or [B, T, Hq, D]) at T=1
    at = "[:, :, 0]" if shape[2] == 1 else "[:, 0]"
    require_layout(False, name, "[B, Hq, D] (one token per row)", shape,
                   "[B, Hq, 1, D]" if shape[2] == 1 else "[B, 1, Hq, D]",
                   f"take the token with {name}{at}")
  require_rank(name, q, 3, "[B, Hq, D]")
  b, hkv, _, d = cache.k.shape
  require(q.shape[0] == b and q.shape[2] == d,
          f"{name} must have shape [B={b}, Hq, D={d}], got {q.shape}")
  group_size(q.shape[1], hkv, name)


def check_chunks(cache: KVCache, chunk_size: int) -> None:
  require(chunk_size == cache.chunk_size,
          f"plan.chunk_size={chunk_size} must match the cache's {cache.chunk_size}")


def approx_scores(q: jax.Array, cache: KVCache, r: int, *, group_dims: str = "sum",
                  impl: str = "auto") -> jax.Array:
  """RocketKV / SparQ chunk scores `[B, Hkv, NC]` of the cache's summaries (kernel or XLA)."""
  if cache.paged:  # the summary pages read through the table (kernels/paged_approx_scores.py)
    impl = _impl.for_pages(impl)
    return _impl.dispatch(
        impl, lambda: paged_approx_scores_xla(q, cache, r, group_dims),
        "paged_approx_bounds_scores", q, from_storage(cache.bounds_raw, cache.dtype),
        cache.table, cache.length, chunk_size=cache.chunk_size, r=r, group_dims=group_dims,
        tpu="tpu_paged_approx_bounds_scores")
  return _impl.dispatch(
      impl, lambda: approx_bounds_scores_xla(q, cache.bounds, cache.length, cache.chunk_size, r,
                                             group_dims),
      "approx_bounds_scores", q, cache.bounds, cache.length, chunk_size=cache.chunk_size, r=r,
      group_dims=group_dims, tpu="tpu_approx_bounds_scores")


def top_chunk_slots(chunk_scores: jax.Array, cache: KVCache, k: int,
                    sliding_window: int | None = None) -> jax.Array:
  """The k best valid slots of `cache` when every slot takes its chunk's score `[B, Hkv, NC]`."""
  return top_slots(chunk_scores, valid_slots(cache, sliding_window), cache.chunk_size, k)


def approx_select(q: jax.Array, cache: KVCache, plan, *, sliding_window: int | None = None,
                  impl: str = "auto") -> jax.Array:
  """The `plan.top_k` best slots by RocketKV / SparQ's approximate chunk scores (steps 1-4 of
  the module doc): the select of SparQ and of RocketKV's stage2="minmax"."""
  check_chunks(cache, plan.chunk_size)
  chunk = approx_scores(q, cache, plan.r, group_dims=plan.group_dims, impl=impl)
  return top_chunk_slots(chunk, cache, min(plan.top_k, cache.capacity), sliding_window)
