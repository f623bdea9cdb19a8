"""`prefill`, `decode_step` and `select`: every method behind one interface, chosen by
`plan.method` in the registry (rocketkv_jax/methods/).

    state = prefill(k, v, q_window, plan, lengths=lengths, layer=i)  # per layer, after the prompt
    out, state = decode_step(q, k_new, v_new, state, plan, layer=i)  # every generated token

A method's `decode_step` is by default `append` (write the new token, update its chunk's
min/max) -> its `select` (stage 2) -> `attend` (exact attention over the selected slots); dense
methods, and a method's dense layers, skip the selection. `layer=i` lets the method keep some
layers dense (`Method.dense_layers`: Quest's first two, RocketKV's `skip_layers`); such a layer's
prefill keeps every prompt token.
"""

from __future__ import annotations

import jax

from rocketkv_jax import _impl, methods
from rocketkv_jax._checks import require
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import KVCache
from rocketkv_jax.evict import check_prefill_inputs
from rocketkv_jax.select import check_query


def _check_plan(plan) -> None:
  require(isinstance(plan, Plan), f"plan must be a Plan from rocketkv.plan(), got {type(plan)}")


def _is_dense(method, plan: Plan, layer: int | None) -> bool:
  if layer is not None:
    require(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0,
            f"layer must be an int >= 0 or None, got {layer!r}")
  return layer is not None and layer in method.dense_layers(plan)


def prefill(k: jax.Array, v: jax.Array, q_window: jax.Array, plan: Plan, *,
            lengths: jax.Array | None = None, impl: str = "auto", layer: int | None = None):
  """Builds the decode state of one layer from its prompt K/V.

  Args:
    k, v: [B, Hkv, L, D] prompt keys (post-RoPE) and values, right-padded.
    q_window: [B, Hq, W, D] post-RoPE queries of the last W valid prompt tokens
      (W = min(plan.window_size, L)); only methods with stage 1 read them.
    plan: from `rocketkv.plan`.
    lengths: [B] valid prompt lengths (None: all L).
    impl: "auto" | "xla" | "pallas" for the stage-1 scoring.
    layer: this layer's index, or None, as for `decode_step`: a layer the method keeps dense
      (`Method.dense_layers`, e.g. RocketKV's `skip_layers`) keeps every prompt token. Pass the
      same `layer` to both; None: not a dense layer.
  Returns:
    The method's state: a `KVCache` (an `MTState` for "rocketkv_mt", a `LowRankState` for
    stage2="lowrank"; any pytree in general).
  """
  _check_plan(plan)
  check_prefill_inputs(k, v, q_window, plan, lengths)
  _impl.check(impl)
  method = methods.get(plan.method)
  return method.prefill(k, v, q_window, plan, lengths=lengths, impl=impl,
                        dense=_is_dense(method, plan, layer))


def decode_step(q: jax.Array, k_new: jax.Array, v_new: jax.Array, cache, plan: Plan, *,
                layer: int | None = None, sliding_window: int | None = None,
                impl: str = "auto"):
  """One decode step of one layer.

  Args:
    q: [B, Hq, D] the new token's query (post-RoPE).
    k_new, v_new: [B, Hkv, 1, D] its key (post-RoPE) and value; dtype of the cache.
    cache: the method's state from `prefill` / a previous step.
    plan: the static plan (pass it as a static jit argument).
    layer: this layer's index, or None. The method decides which layers stay dense
      (`Method.dense_layers`, e.g. Quest's first two); None: none of them.
    sliding_window: Mistral v0.1 window, or None.
    impl: "auto" | "xla" | "pallas".
  Returns:
    (out [B, Hq, D] attention output in q's dtype, new state).
  """
  _check_plan(plan)
  if sliding_window is not None:
    require(isinstance(sliding_window, int) and sliding_window >= 1,
            f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
  _impl.check(impl)
  method = methods.get(plan.method)
  return method.decode_step(q, k_new, v_new, cache, plan, dense=_is_dense(method, plan, layer),
                            sliding_window=sliding_window, impl=impl)


def select(q: jax.Array, cache, plan: Plan, *, sliding_window: int | None = None,
           impl: str = "auto") -> jax.Array:
  """Stage 2: the slots each KV head attends to.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    cache: the method's state, already holding the query's own token: a `KVCache` for most
      methods (its `KVCache` view will do for those whose selection reads nothing else; a
      stage2="lowrank" plan needs the `LowRankState`). The slots index `view(cache)`.
    plan: from `rocketkv.plan`; `plan.method` chooses the scoring.
    sliding_window: Mistral v0.1 window, or None.
    impl: "auto" | "xla" | "pallas" for the approximate scoring.
  Returns:
    int32 [B, Hkv, K] slot indices, K = min(plan.top_k, C) (K = C for dense methods). Only valid
    slots are picked while there are enough of them; when K >= valid slots every valid slot is
    picked, and the rest of the row points at invalid slots, which `attend` masks.
  """
  _check_plan(plan)
  method = methods.get(plan.method)
  check_query(q, cache if isinstance(cache, KVCache) else method.view(cache))
  _impl.check(impl)
  return method.select(q, cache, plan, sliding_window=sliding_window,
                                         impl=impl)
