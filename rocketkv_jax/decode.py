"""`prefill` and `decode_step`: every method behind one interface, chosen by `plan.method`.

    state = prefill(k, v, q_window, plan, lengths=lengths)   # once per layer after the prompt
    out, state = decode_step(q, k_new, v_new, state, plan)   # every generated token

`decode_step` = `append` (write the new token, update its chunk's min/max) -> `select` (stage 2)
-> `attend` (exact attention over the selected slots). Dense methods skip the selection.
`stage2="lowrank"` plans carry their key summaries next to the cache (`LowRankState`).
"""

from __future__ import annotations

import jax

from rocketkv_jax import stage2_rerank
from rocketkv_jax._checks import require
from rocketkv_jax.attend import attend, attend_dense_before_append
from rocketkv_jax.cache import KVCache, append, full_cache
from rocketkv_jax.config import DENSE_METHODS, Plan
from rocketkv_jax.evict import _check as _check_prefill
from rocketkv_jax.evict import evict, evict_streaming
from rocketkv_jax.multiturn import MTState, mt_prefill
from rocketkv_jax.select import check_query, select
from rocketkv_jax.stage2_lowrank import LowRankState, attach


def prefill(k: jax.Array, v: jax.Array, q_window: jax.Array, plan: Plan, *,
            lengths: jax.Array | None = None, impl: str = "auto"):
  """Builds the decode state of one layer from its prompt K/V.

  Args:
    k, v: [B, Hkv, L, D] prompt keys (post-RoPE) and values, right-padded.
    q_window: [B, Hq, W, D] post-RoPE queries of the last W valid prompt tokens
      (W = min(plan.window_size, L)); only methods with stage 1 read them.
    plan: from `rocketkv.plan`.
    lengths: [B] valid prompt lengths (None: all L).
  Returns:
    A `KVCache` (an `MTState` for "rocketkv_mt"; for `plan.stage2 == "lowrank"` the compressed
    cache comes in a `LowRankState`).
  """
  require(isinstance(plan, Plan), f"plan must be a Plan from rocketkv.plan(), got {type(plan)}")
  _check_prefill(k, v, q_window, plan, lengths)
  m = plan.method
  if m in ("rocketkv", "snapkv"):
    return attach(evict(k, v, q_window, plan, lengths=lengths, impl=impl), plan)
  if m == "rocketkv_mt":
    return mt_prefill(k, v, q_window, plan, lengths=lengths, impl=impl)
  if m == "streamingllm":
    return evict_streaming(k, v, plan, lengths=lengths)
  return full_cache(k, v, plan.capacity, plan.chunk_size, lengths)


def decode_step(q: jax.Array, k_new: jax.Array, v_new: jax.Array, cache, plan: Plan, *,
                sliding_window: int | None = None, impl: str = "auto"):
  """One decode step of one layer.

  Args:
    q: [B, Hq, D] the new token's query (post-RoPE).
    k_new, v_new: [B, Hkv, 1, D] its key (post-RoPE) and value; dtype of the cache.
    cache: the state `prefill` / a previous step returned (a `KVCache`, an `MTState` for
      "rocketkv_mt", a `LowRankState` for stage2="lowrank").
    plan: the static plan (pass it as a static jit argument).
    sliding_window: Mistral v0.1 window, or None.
    impl: "auto" | "xla" | "pallas".
  Returns:
    (out [B, Hq, D] attention output in q's dtype, new cache).
  """
  require(isinstance(plan, Plan), f"plan must be a Plan from rocketkv.plan(), got {type(plan)}")
  if sliding_window is not None:
    require(isinstance(sliding_window, int) and sliding_window >= 1,
            f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
  if isinstance(cache, MTState):
    require(plan.method == "rocketkv_mt", "an MTState needs a 'rocketkv_mt' plan")
    full = append(cache.full, k_new, v_new)
    out, view = decode_step(q, k_new, v_new, cache.view, plan,
                            sliding_window=sliding_window, impl=impl)
    return out, MTState(full=full, view=view)
  lowrank = None
  if isinstance(cache, LowRankState):  # stage2="lowrank": the cache with its key summaries
    lowrank, cache = cache, cache.cache
  require((lowrank is not None) == (plan.stage2 == "lowrank"),
          f"a stage2={plan.stage2!r} plan needs the state its prefill built, got {type(cache)}")
  require(isinstance(cache, KVCache), f"cache must be a KVCache, got {type(cache)}")
  check_query(q, cache)
  require(q.dtype == cache.k.dtype or q.dtype == jax.numpy.float32,
          f"q dtype {q.dtype} must match the cache dtype {cache.k.dtype} (or be float32)")
  new = append(cache, k_new, v_new)
  if plan.method in DENSE_METHODS:  # read before the write: see attend_dense_before_append
    return attend_dense_before_append(q, cache, k_new, v_new, sliding_window=sliding_window), new
  # Selection and attention read the cache after the append: reads after an in-place write
  # need no copy (16-bit caches are stored as bits so that the write is in place: cache.py).
  if plan.stage2 == "rerank":  # attends from the candidate K rows it read (stage2_rerank.py)
    return stage2_rerank.decode_attend(q, new, plan, sliding_window=sliding_window,
                                       impl=impl), new
  state = new if lowrank is None else lowrank.replace(cache=new)
  idx = select(q, state, plan, sliding_window=sliding_window, impl=impl)
  return attend(q, new, idx, sliding_window=sliding_window, impl=impl), state


def decoding_cache(state) -> KVCache:
  """The `KVCache` that decode steps read inside a layer state from `prefill`: the cache itself,
  an `MTState`'s compressed view, or a `LowRankState`'s cache."""
  if isinstance(state, MTState):
    state = state.view
  if isinstance(state, LowRankState):
    state = state.cache
  require(isinstance(state, KVCache), f"state must hold a KVCache, got {type(state)}")
  return state
