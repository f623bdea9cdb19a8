"""The decode state each stage-2 variant keeps around its `KVCache`, by `plan.stage2`.

"minmax" and "rerank" read the cache's own chunk bounds: their state is the `KVCache`.
"lowrank" (`LowRankState`) and "quant" (`QuantState`) keep summaries beside it, built from the
prefilled cache (`attach`) and carried through each decode step's append (`after_append`).
"""

from __future__ import annotations

from rocketkv_jax.cache import KVCache
from rocketkv_jax import stage2_lowrank, stage2_quant

STATE_TYPES = {"lowrank": stage2_lowrank.LowRankState, "quant": stage2_quant.QuantState}
_BUILD = {"lowrank": stage2_lowrank.build, "quant": stage2_quant.build}


def state_type(plan) -> type:
  """The state class a decode step of `plan` expects."""
  return STATE_TYPES.get(plan.stage2, KVCache)


def attach(cache: KVCache, plan):
  """The decode state of a prefilled cache for `plan.stage2`."""
  build = _BUILD.get(plan.stage2)
  return cache if build is None else build(cache, plan)


def unwrap(state) -> KVCache:
  """The `KVCache` inside a stage-2 state (the state itself for a cache)."""
  return state.cache if isinstance(state, tuple(STATE_TYPES.values())) else state


def after_append(state, new: KVCache):
  """The state whose cache `append` turned into `new`: summaries kept current ("quant"
  re-codes the new slot; "lowrank" keeps its prompt summaries; a cache is `new`)."""
  if isinstance(state, stage2_quant.QuantState):
    return stage2_quant.append_codes(state, new)
  if isinstance(state, stage2_lowrank.LowRankState):
    return state.replace(cache=new)
  return new
