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

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from rocketkv_jax import _impl, layer_scan, methods
from rocketkv_jax._checks import (check_lengths, require, require_int, require_layout,
                                require_rank)
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import KVCache, cache_overflow
from rocketkv_jax.evict import check_prefill_inputs
from rocketkv_jax.select import check_query


def _check_plan(plan) -> None:
  require(isinstance(plan, Plan), f"plan must be a Plan from rocketkv.plan(), got {type(plan)}")


def _is_cache(x) -> bool:
  return isinstance(x, KVCache)


def _tag(state, method: str):
  """`state` with every `KVCache` in it marked as made by `method` (static metadata)."""
  return jax.tree.map(lambda c: c.replace(method=method) if _is_cache(c) else c, state,
                      is_leaf=_is_cache)


def _check_state(state, plan: Plan) -> None:
  """ValueError when a `KVCache` in `state` was made by another method's `prefill`."""
  made = {c.method for c in jax.tree.leaves(state, is_leaf=_is_cache) if _is_cache(c)} - {""}
  require(made <= {plan.method}, f"cache must come from a {plan.method!r} prefill (the plan's "
          f"method), got one made by {sorted(made)}")


def last_valid_window(q: jax.Array, lengths: jax.Array | None, window: int) -> jax.Array:
  """The queries of the last `window` *valid* tokens of each row of a right-padded batch.

  Args:
    q: [B, Hq, L, D] the prompt's post-RoPE queries, right-padded.
    lengths: [B] valid tokens per row (None: all L).
    window: W, normally `plan.window_size`.
  Returns:
    [B, Hq, min(W, L), D]: row b holds the queries of positions lengths[b]-W .. lengths[b]-1
    (clamped at position 0 when lengths[b] < W: stage 1 masks those) -- what `prefill` expects
    as `q_window`. Not the last W columns of the padded array, which are padding for a row
    shorter than L.
  """
  require_rank("q", q, 4, "[B, Hq, L, D]")
  require_int("window", window, 1)
  b, _, l, _ = q.shape
  if lengths is None:
    lengths = jnp.full((b,), l, jnp.int32)
  else:
    if not isinstance(lengths, jax.core.Tracer):  # a length past L that fits axis 1: [B, L, Hq, D]
      top = int(np.max(np.asarray(lengths), initial=0))
      require_layout(top <= l or top > q.shape[1], "q", "[B, Hq, L, D]", q.shape,
                     "[B, L, Hq, D]", f"lengths reach {top} > L={l}: transpose with "
                     f"q.transpose(0, 2, 1, 3)")
    check_lengths(lengths, b, l)
  return jnp.take_along_axis(q, window_positions(lengths, l, window)[:, None, :, None], axis=2)


def window_positions(lengths: jax.Array, length: int, window: int) -> jax.Array:
  """`[B, min(W, L)]` int32 positions of the last W valid tokens of each row (clamped to
  [0, L-1]); `[:, -1]` is lengths - 1."""
  w = min(window, length)
  idx = jnp.asarray(lengths, jnp.int32)[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None, :]
  return jnp.clip(idx, 0, length - 1)


def _is_dense(method, plan: Plan, layer):
  """Whether `layer` is one of the method's dense layers: a Python bool for an int `layer`, a
  traced bool for an integer scalar array (the index a scan over layers carries as data).

  None is accepted only where the plan has no dense layers: for Quest or `skip_layers` it
  would silently make a dense layer sparse (a scan over layers that drops its index)."""
  dense = tuple(method.dense_layers(plan))
  if layer is None:
    require(not dense, f"layer must be this layer's index (an int, or the traced index in a "
            f"scan over layers) for method {plan.method!r} with dense layers {list(dense)}, "
            f"got None")
    return False
  if isinstance(layer, (jax.Array, np.ndarray, np.generic)):
    require(layer.ndim == 0 and np.issubdtype(layer.dtype, np.integer),
            f"layer must be an int >= 0 or an integer scalar array, got {layer!r}")
    return jnp.isin(layer, jnp.asarray(dense, jnp.int32)) if dense else False
  require(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0,
          f"layer must be an int >= 0 or an integer scalar array, got {layer!r}")
  return layer in dense


def _by_layer(fn, dense, plan: Plan):
  """`fn(dense)` for a Python bool; for a traced one (a scanned layer index), `lax.cond` over
  both when they build states of one structure (Quest's), else a ValueError: a dense layer
  whose state differs (`skip_layers`) cannot be a step of a scan over the others."""
  if isinstance(dense, bool):
    return fn(dense)
  with layer_scan.suspended():  # the branches write their own copies (no stacked-carry views)
    try:
      a, b = (jax.eval_shape(lambda d=d: fn(d)) for d in (True, False))
      same = jax.tree.structure(a) == jax.tree.structure(b) and jax.tree.leaves(a) == \
          jax.tree.leaves(b)
    except ValueError:
      same = False
    require(same, f"layer must be a Python int for method {plan.method!r} with dense layers "
            f"{list(methods.get(plan.method).dense_layers(plan))}: their state differs from the "
            f"other layers', so they cannot be scanned with them (run them outside the scan)")
    return lax.cond(dense, lambda: fn(True), lambda: fn(False))


def prefill(k: jax.Array, v: jax.Array, q_window: jax.Array, plan: Plan, *,
            lengths: jax.Array | None = None, impl: str = "auto", layer: int | None = None,
            debug: bool = False):
  """Builds the decode state of one layer from its prompt K/V.

  Args:
    k, v: [B, Hkv, L, D] prompt keys (post-RoPE) and values, right-padded.
    q_window: [B, Hq, W, D] post-RoPE queries of the last W *valid* prompt tokens of each
      row, W = min(plan.window_size, L) (ValueError otherwise): `last_valid_window(q, lengths,
      plan.window_size)`. Only methods with stage 1 read them.
    plan: from `rocketkv.plan`, for a `prompt_len` >= L (ValueError otherwise).
    lengths: [B] valid prompt lengths (None: all L), integers in [1, L]. Checked (ValueError)
      when concrete; a traced `lengths` (inside `jax.jit`) is not read on the host: values
      outside [1, L] are clamped to it.
    impl: "auto" | "xla" | "pallas" for the stage-1 scoring.
    layer: this layer's index, as for `decode_step`: a layer the method keeps dense
      (`Method.dense_layers`, e.g. RocketKV's `skip_layers`) keeps every prompt token. Pass the
      same `layer` to both (see there for None and a traced index).
    debug: also check the values: a NaN or Inf in a valid token of k or v, or in q_window, is an
      error (`checked`; nothing is added to the computation when False).
  Returns:
    The method's state: a `KVCache` (an `MTState` for "rocketkv_mt", a `LowRankState` for
    stage2="lowrank"; any pytree in general).
  """
  _check_plan(plan)
  # (evict alone also takes a shorter window: a later turn's, `rocketkv.begin_turn`)
  check_prefill_inputs(k, v, q_window, plan, lengths, exact_window=True)
  l = k.shape[2]
  # a plan for a shorter prompt would keep its prompt_budget of a longer one, unasked
  require(l <= plan.prompt_len, f"k: prompt length L={l} must be <= plan.prompt_len="
          f"{plan.prompt_len} (plan for the padded prompt length)")
  _impl.check(impl)
  method = methods.get(plan.method)
  if lengths is not None:  # concrete values were checked above; traced ones are clamped
    lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 1, k.shape[2])
  if debug:  # padding past `lengths` is never read: only valid tokens must be finite
    n = jnp.full((k.shape[0],), l, jnp.int32) if lengths is None else lengths
    valid = (jnp.arange(l) < n[:, None])[:, None, :, None]
    for name, x in (("k", k), ("v", v)):
      _debug_finite(name, jnp.where(valid, x, 0))
    _debug_finite("q_window", q_window)
  state = _by_layer(lambda dense: method.prefill(k, v, q_window, plan, lengths=lengths,
                                                 impl=impl, dense=dense),
                    _is_dense(method, plan, layer), plan)
  return _tag(state, plan.method)


def decode_step(q: jax.Array, k_new: jax.Array, v_new: jax.Array, cache, plan: Plan, *,
                layer: int | None = None, sliding_window: int | None = None,
                impl: str = "auto", debug: bool = False):
  """One decode step of one layer.

  Args:
    q: [B, Hq, D] the new token's query (post-RoPE).
    k_new, v_new: [B, Hkv, 1, D] its key (post-RoPE) and value; dtype of the cache.
    cache: the method's state from `prefill` / a previous step (ValueError if that `prefill`
      had a plan of another method).
    plan: the static plan (pass it as a static jit argument).
    layer: this layer's index. The method decides which layers stay dense
      (`Method.dense_layers`, e.g. Quest's first two). An int; or an integer scalar array, the
      index a scan over stacked layers carries as data: Quest's dense layers then run under
      `lax.cond` (both branches compiled), while a plan whose dense layers hold a state of
      another structure (`skip_layers`) raises ValueError (run those layers outside the scan).
      None only for a plan without dense layers (ValueError otherwise: a scan that drops the
      index would silently make a dense layer sparse).
    sliding_window: Mistral v0.1 window, or None.
    impl: "auto" | "xla" | "pallas".
    debug: also check the values: a NaN or Inf in q, k_new or v_new, or a cache overflow after
      the step, is an error (`checked`; nothing is added to the computation when False).
  Returns:
    (out [B, Hq, D] attention output in q's dtype, new state). A NaN or Inf input reaches the
    output where the method reads it (docs/reliability.md#non-finite-inputs; `debug`).
  """
  _check_plan(plan)
  if sliding_window is not None:
    require(isinstance(sliding_window, int) and sliding_window >= 1,
            f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
  _impl.check(impl)
  _check_state(cache, plan)
  method = methods.get(plan.method)
  if debug:
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
      _debug_finite(name, x)
  out, state = _by_layer(lambda dense: method.decode_step(q, k_new, v_new, cache, plan,
                                                          dense=dense,
                                                          sliding_window=sliding_window,
                                                          impl=impl),
                         _is_dense(method, plan, layer), plan)
  if debug:
    over = cache_overflow(state)
    _debug_check(~jnp.any(over), "cache overflow: row {row} is full (capacity reached; plan "
                 "for more max_new_tokens)", row=jnp.argmax(over))
  return out, state


def _finite_rows(x: jax.Array) -> jax.Array:
  """[B] bool: every value of row b of `x` is finite."""
  return jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)


# Set while `checked` traces its function: a staged check outside it cannot raise.
_CHECKING = threading.local()


def _debug_check(pred, msg: str, **fmt) -> None:
  """`checkify.check`: raises at once on concrete values; traced, it needs `checked` around."""
  require(not isinstance(pred, jax.core.Tracer) or getattr(_CHECKING, "on", False),
          "debug=True under jax.jit needs the jitted function wrapped in rocketkv.checked(fn)")
  checkify.check(pred, msg, **fmt)


def _debug_finite(name: str, x: jax.Array) -> None:
  ok = _finite_rows(x)
  _debug_check(jnp.all(ok), f"{name} holds a NaN or Inf in row {{row}}", row=jnp.argmin(ok))


def checked(fn):
  """`fn` with the checks of `debug=True` turned into errors.

  `fn` (jitted or not) calls `rocketkv.prefill` / `decode_step` with `debug=True`; the result
  runs it under `jax.experimental.checkify` and raises `checkify.JaxRuntimeError` (a
  ValueError) on the first failed check: a NaN or Inf in an input, or a cache overflow. It reads
  the error flag on the host after each call (a sync): a debugging mode, not the default path.

      step = rocketkv.checked(jax.jit(lambda q, k, v, s: rocketkv.decode_step(
          q, k, v, s, plan, debug=True)))
  """
  checkified = checkify.checkify(fn, errors=checkify.user_checks)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    before, _CHECKING.on = getattr(_CHECKING, "on", False), True
    try:
      err, out = checkified(*args, **kwargs)
    finally:
      _CHECKING.on = before
    err.throw()
    return out

  return run


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
  _check_state(cache, plan)
  method = methods.get(plan.method)
  check_query(q, cache if isinstance(cache, KVCache) else method.view(cache))
  _impl.check(impl)
  return method.select(q, cache, plan, sliding_window=sliding_window,
                                         impl=impl)
