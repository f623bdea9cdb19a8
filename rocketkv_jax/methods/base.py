"""`Method`: what a KV method is, and the behaviour most methods share.

A method is a frozen, field-less dataclass (hashable, one instance in the registry) that owns
everything specific to it:

    check_config(config)               its RocketConfig rules (ValueError, before tracing)
    split(config, prompt_len, new, D)  its Plan fields: the budget split
    prefill(k, v, q_window, plan)      its per-layer decode state (any pytree); `dense=True`
                                       for a layer of `dense_layers` (keep every token)
    view(state)                        the KVCache inside that state which attention reads
    select(q, state, plan)             its per-step read: int32 [B, Hkv, K] slots of view(state)
    decode_step(q, k, v, state, plan)  one step over its state (default: append -> select ->
                                       attend, or dense attention when `dense`)
    dense_layers(plan)                 layers whose decode steps read every slot
    tokens_read(plan, kept, steps)     the K/V tokens one decode step reads (generate's stats)

and a few class-level facts the harness and `generate` read instead of its name: `summary`
(what B means for it), `dense`, `uses_budget`, `keeps_full_cache`, `replan_per_turn`,
`stage2_variants` (the names of the `RocketConfig.stage2` variants it accepts),
`accepts_skip_layers` (whether `RocketConfig.skip_layers` may be other than 0),
`picks_dims` (it scores on the r query dims of `ops.top_r_dims`: `RocketConfig.group_dims`),
`reads_by_mass` (its read per head and step follows the attention mass: the state counts it,
`rows_read`), `takes_turns` (`rocketkv.Conversation` can add a turn to its state).

Dense layers (`dense_layers`: Quest's first two, RocketKV's `skip_layers`) are chosen by the
method from the layer index that `rocketkv.prefill` / `rocketkv.decode_step` receive as
`layer=i`: their prefill keeps every prompt token (`dense=True`) and every decode step attends
to every cached token. Statistics count their whole cache (`layer_reads`).

The base class is the uncompressed, dense method ("full"): every default below is correct for
it, and a new method overrides only what differs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

import jax

from rocketkv_jax._checks import require
from rocketkv_jax.attend import attend, attend_dense_before_append
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import KVCache, append, full_cache
from rocketkv_jax.select import all_slots, check_query


@dataclasses.dataclass(frozen=True)
class Method:
  """Base of every KV method (see the module docstring)."""

  name: ClassVar[str] = ""
  summary: ClassVar[str] = ""
  dense: ClassVar[bool] = True  # every decode step reads every valid slot (no selection)
  uses_budget: ClassVar[bool] = True  # False: B is ignored (one eval record, budget None)
  keeps_full_cache: ClassVar[bool] = False  # multi-turn: each turn re-runs stage 1 (begin_turn)
  replan_per_turn: ClassVar[bool] = False  # multi-turn: the split is re-made for each turn
  # Names of the RocketConfig.stage2 variants it accepts (methods/stage2/, `Stage2.name`).
  stage2_variants: ClassVar[tuple[str, ...]] = ("minmax",)
  # RocketConfig.skip_layers may be > 0: `split` puts it in the Plan, `dense_layers` reads it.
  accepts_skip_layers: ClassVar[bool] = False
  # `select` reads, per head, the fewest slots holding `plan.read_mass` of the attention: its
  # index array is [B, Hkv, C], and `rows_read(state)` gives the mean rows it read per step.
  reads_by_mass: ClassVar[bool] = False
  # Its approximate scores use the r query dims of `ops.top_r_dims` (with a stage-2 variant that
  # does too, `Stage2.picks_dims`): RocketConfig.group_dims may be other than "sum".
  picks_dims: ClassVar[bool] = False
  # `rocketkv.Conversation` can add a turn to its state: a `KVCache`, a stage-2 state around
  # one (rebuilt over the grown cache) or, with `keeps_full_cache`, an `MTState`.
  takes_turns: ClassVar[bool] = True

  # ---------------------------------------------------------------- configuration
  def check_config(self, config) -> None:
    """Raises ValueError (one line: argument, allowed values) if `config` is invalid for it."""

  def split(self, config, prompt_len: int, max_new_tokens: int, head_dim: int) -> dict:
    """The Plan fields capacity, prompt_budget, top_k, chunk_size, r (and any of its own).

    The default keeps every token, reads them all and keeps no chunk summaries.
    """
    return full_split(prompt_len, max_new_tokens, head_dim)

  # ---------------------------------------------------------------- state
  def prefill(self, k: jax.Array, v: jax.Array, q_window: jax.Array, plan: Plan, *,
              lengths: jax.Array | None = None, impl: str = "auto", dense: bool = False) -> Any:
    """One layer's decode state from its prompt K/V `[B, Hkv, L, D]` (inputs already checked).

    `dense`: the layer is one of `dense_layers(plan)` and must keep every prompt token (the
    default keeps every token either way)."""
    del q_window, impl, dense
    return full_cache(k, v, plan.capacity, plan.chunk_size, lengths)

  def view(self, state) -> KVCache:
    """The `KVCache` attention reads (the state itself unless the method keeps more)."""
    return state

  # ---------------------------------------------------------------- decoding
  def select(self, q: jax.Array, state, plan: Plan, *,
             sliding_window: int | None = None, impl: str = "auto") -> jax.Array:
    """int32 `[B, Hkv, K]` slots of `view(state)` (which already holds q's token) to attend to.

    `state` is the method's decode state (a `KVCache` for most methods); a method whose state
    holds more than the cache may read that too (RocketKV's "lowrank" summaries)."""
    del q, plan, sliding_window, impl
    return all_slots(self.view(state))

  def decode_step(self, q: jax.Array, k_new: jax.Array, v_new: jax.Array, state, plan: Plan, *,
                  dense: bool = False, sliding_window: int | None = None,
                  impl: str = "auto"):
    """(out [B, Hq, D], new state). `dense`: this layer reads every slot (`dense_layers`)."""
    cache = state
    new = checked_append(q, k_new, v_new, cache)
    if dense or self.dense:  # read before the write: see attend_dense_before_append
      return (attend_dense_before_append(q, cache, k_new, v_new, sliding_window=sliding_window,
                                         appended=new, impl=impl), new)
    # Selection and attention read the cache after the append: reads after an in-place write
    # need no copy (16-bit caches are stored as bits so that the write is in place: cache.py).
    idx = self.select(q, new, plan, sliding_window=sliding_window, impl=impl)
    return attend(q, new, idx, sliding_window=sliding_window, impl=impl), new

  def dense_layers(self, plan: Plan) -> tuple[int, ...]:
    """Layer indices whose prefill keeps every token and whose decode steps attend densely."""
    del plan
    return ()

  # ---------------------------------------------------------------- statistics
  def tokens_read(self, plan: Plan, kept: int, steps: int) -> int:
    """K/V tokens one decode step reads once `kept` prompt tokens and `steps` new ones are
    cached: `top_k` of them for a selecting method, all of them for a dense one."""
    return min(plan.top_k, kept + steps) if plan.top_k else kept + steps

  def layer_reads(self, plan: Plan, kept: Sequence[int], steps: int) -> list[int]:
    """Per layer, the K/V tokens one decode step reads once `kept[i]` prompt tokens (layer i)
    and `steps` new ones are cached: `tokens_read`, except that a dense layer
    (`dense_layers`) reads every cached token."""
    dense = set(self.dense_layers(plan))
    return [n + steps if i in dense else self.tokens_read(plan, n, steps)
            for i, n in enumerate(kept)]


def dense_layer_cache(k: jax.Array, v: jax.Array, plan: Plan,
                      lengths: jax.Array | None = None) -> KVCache:
  """A dense layer's cache: every prompt token of `k, v [B, Hkv, L, D]` and room for every new
  token, without chunk summaries (its decode steps read every slot and select none)."""
  return full_cache(k, v, max(plan.prompt_len, k.shape[2]) + plan.max_new_tokens, 0, lengths)


def checked_append(q: jax.Array, k_new: jax.Array, v_new: jax.Array, cache) -> KVCache:
  """`append(cache, k_new, v_new)` after checking `q` against the cache (a decode step's start)."""
  require(isinstance(cache, KVCache), f"cache must be a KVCache, got {type(cache)}")
  check_query(q, cache)
  require(q.dtype == cache.k.dtype or q.dtype == jax.numpy.float32,
          f"q dtype {q.dtype} must match the cache dtype {cache.k.dtype} (or be float32)")
  return append(cache, k_new, v_new)


def full_split(prompt_len: int, max_new_tokens: int, head_dim: int) -> dict:
  """Every token kept and read; no chunk summaries (chunk_size 0)."""
  return dict(capacity=prompt_len + max_new_tokens, prompt_budget=prompt_len, top_k=0,
              chunk_size=0, r=head_dim)


def require_window_budget(config) -> None:
  """Stage 1 always keeps the window: the budget must hold it."""
  require(config.token_budget >= config.window_size,
          f"token_budget must be >= window_size={config.window_size} for method "
          f"{config.method!r}, got {config.token_budget}")


def require_half_budget(config) -> None:
  """top_k defaults to B // 2, which must be >= 1."""
  require(config.token_budget >= 2 or config.top_k is not None,
          f"token_budget must be >= 2 (top_k = B//2), got {config.token_budget}")
