"""RocketKV-MT: RocketKV that keeps the full cache so that each turn re-runs stage 1.

Its state is an `MTState` (rocketkv_jax/multiturn.py): the uncompressed cache of every token
(`full`, capacity `plan.full_capacity`) and the stage-1 view that decoding reads, as RocketKV's
state (a `LowRankState` around the cache for stage2="lowrank"). Each decode
step appends the new token to both; `rocketkv.begin_turn` re-runs stage 1 for a new turn.

A skipped layer (`RocketConfig.skip_layers`, `dense_layers`) has no view (`view=None`): decoding
reads `full` densely, and `begin_turn` only appends the turn to it.
"""

from __future__ import annotations

import dataclasses

from rocketkv_jax._checks import require
from rocketkv_jax.attend import attend_dense_before_append
from rocketkv_jax.cache import append, full_cache
from rocketkv_jax.methods.base import checked_append
from rocketkv_jax.methods.rocketkv import RocketKV
from rocketkv_jax.multiturn import MTState


@dataclasses.dataclass(frozen=True)
class RocketKVMT(RocketKV):
  name = "rocketkv_mt"
  summary = "rocketkv that keeps the full cache so each turn re-runs stage 1"
  keeps_full_cache = True

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    return dict(super().split(config, prompt_len, max_new_tokens, head_dim),
                full_capacity=prompt_len + max_new_tokens)

  def prefill(self, k, v, q_window, plan, *, lengths=None, impl="auto", dense=False):
    """First turn: `full` keeps every prompt token, `view` is stage 1 of it (None for a dense
    layer, which reads `full`)."""
    require(plan.full_capacity > 0, "plan must come from a 'rocketkv_mt' config")
    full = full_cache(k, v, max(plan.full_capacity, k.shape[2]), 0, lengths)  # no summaries
    if dense:
      return MTState(full=full, view=None)
    view = super().prefill(k, v, q_window, plan, lengths=lengths, impl=impl)
    return MTState(full=full, view=view)

  def view(self, state):
    """The cache decoding reads: the compressed one inside `state.view`'s stage-2 state, or
    `state.full` in a dense layer (no view)."""
    if isinstance(state, MTState):
      return state.full if state.view is None else super().view(state.view)
    return super().view(state)

  def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
    return super().select(q, state.view if isinstance(state, MTState) else state, plan,
                          sliding_window=sliding_window, impl=impl)

  def decode_step(self, q, k_new, v_new, state, plan, *, dense=False, sliding_window=None,
                  impl="auto"):
    require(isinstance(state, MTState), f"state must be an MTState, got {type(state)}")
    if state.view is None:  # a dense layer: `full` is the cache it reads
      require(dense, "an MTState without a view (a dense layer's) needs a dense layer index")
      full = checked_append(q, k_new, v_new, state.full)
      return (attend_dense_before_append(q, state.full, k_new, v_new,
                                         sliding_window=sliding_window),
              MTState(full=full, view=None))
    full = append(state.full, k_new, v_new)
    out, view = super().decode_step(q, k_new, v_new, state.view, plan, dense=dense,
                                    sliding_window=sliding_window, impl=impl)
    return out, MTState(full=full, view=view)
