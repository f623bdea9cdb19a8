"""RocketKV-MT: multi-turn decoding that keeps the full cache across turns.

`MTState` pairs the uncompressed cache (`full`, every token of every turn) with the compressed
view that decoding reads (`view`). Each turn appends its prompt to `full` and re-runs stage 1 on
it with that turn's window queries (`begin_turn`), so tokens evicted for one question can come
back for the next. Decode steps append every new token to both caches (the method:
rocketkv_jax/methods/rocketkv_mt.py).
"""

from __future__ import annotations

import jax
from flax import struct

from rocketkv_jax._checks import require
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import KVCache, extend, grow, state_nbytes
from rocketkv_jax.evict import evict


@struct.dataclass
class MTState:
  """full: every token so far ([B, Hkv, C_full, D]); view: the stage-1 compressed cache (a
  `LowRankState` / `QuantState` around it for stage2="lowrank" / "quant"), or None in a dense
  layer (`skip_layers`), which reads `full`."""

  full: KVCache
  view: KVCache | None

  # The `rocketkv.State` questions: `length` of the cache decoding reads (the view, else `full`),
  # `seen` and `overflow` of both caches.
  @property
  def length(self) -> jax.Array:
    return (self.full if self.view is None else self.view).length

  @property
  def seen(self) -> jax.Array:
    return self.full.seen

  @property
  def overflow(self) -> jax.Array:
    return self.full.overflow | (False if self.view is None else self.view.overflow)

  @property
  def nbytes(self) -> int:
    return state_nbytes(self)


def begin_turn(state: MTState, k_turn: jax.Array, v_turn: jax.Array, q_window: jax.Array,
               plan: Plan, *, turn_lengths: jax.Array | None = None,
               impl: str = "auto") -> MTState:
  """Starts a new turn.

  Args:
    state: the state after the previous turn.
    k_turn, v_turn: [B, Hkv, T, D] this turn's prompt keys (post-RoPE, positions continuing
      from `state.full.seen`) and values, right-padded.
    q_window: [B, Hq, W, D] queries of the last W valid tokens of this turn's prompt.
    plan: `rocketkv.plan(config, prompt_len=context so far + T, max_new_tokens, D)` for this
      turn (method "rocketkv_mt"); a new plan per turn compiles once per turn, never per step.
    turn_lengths: [B] valid tokens of this turn (None: all T).
  Returns:
    The state with `full` grown to hold the turn plus `plan.max_new_tokens`, and a fresh `view`
    (a dense layer's state, without a view, stays without one: it keeps reading `full`).
  """
  require(isinstance(state, MTState), f"state must be an MTState, got {type(state)}")
  full = state.full
  need = full.capacity + k_turn.shape[2] + plan.max_new_tokens
  full = grow(full, max(need, full.capacity))
  full = extend(full, k_turn, v_turn, turn_lengths)
  if state.view is None:
    return MTState(full=full, view=None)
  view = evict(full.k, full.v, q_window, plan, lengths=full.length, impl=impl)
  # evict() numbers slots by their index in `full`, which is the absolute position there.
  return MTState(full=full, view=plan.stage2.prefill(
      view.replace(seen=full.seen, method=full.method), plan))
