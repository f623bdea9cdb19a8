"""Every decode state answers the same questions (`rocketkv.State`): valid length, tokens seen,
overflow per row and bytes held, for every registered method and stage-2 variant, checked
against counts made in NumPy from the inputs alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
from method_specs import SPECS, spec_plan

B, HKV, G, D, L, NEW = 2, 2, 2, 16, 40, 5
LENGTHS = np.array([40, 23], np.int32)


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  k, v = (jnp.asarray(rng.standard_normal((B, HKV, L, D)), jnp.float32) for _ in range(2))
  qw = jnp.asarray(rng.standard_normal((B, HKV * G, 4, D)), jnp.float32)
  return k, v, qw, rng


def _kept(plan, dense):
  """Prompt tokens a layer keeps per row: all of them in a dense layer (or a method that keeps
  all), else min(length, prompt_budget)."""
  return LENGTHS.copy() if dense else np.minimum(LENGTHS, plan.prompt_budget)


def _np_nbytes(state):
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))


@pytest.mark.parametrize("layer", [0, 2])  # 0: dense for quest and skip_layers
@pytest.mark.parametrize("spec", SPECS)
def test_every_state_answers_length_seen_overflow_nbytes(spec, layer):
  plan = spec_plan(spec, L, NEW, D)
  method = methods.get(plan.method)
  dense = layer in method.dense_layers(plan)
  k, v, qw, rng = _inputs()
  state = rocketkv.prefill(k, v, qw, plan, lengths=jnp.asarray(LENGTHS), layer=layer)
  assert isinstance(state, rocketkv.State), type(state)
  kept = _kept(plan, dense)
  np.testing.assert_array_equal(np.asarray(state.length), kept)
  np.testing.assert_array_equal(np.asarray(state.seen), LENGTHS)
  assert not np.asarray(state.overflow).any()
  assert state.nbytes == _np_nbytes(state) and isinstance(state.nbytes, int)
  assert state.nbytes == jax.eval_shape(lambda: state).nbytes  # from shapes alone

  # Decode until row 0 overflows the cache attention reads (one step past its capacity).
  capacity = method.view(state).capacity
  steps = capacity - int(kept[0]) + 1
  step = jax.jit(lambda q, kn, vn, s: rocketkv.decode_step(q, kn, vn, s, plan, layer=layer))
  for _ in range(steps):
    q = jnp.asarray(rng.standard_normal((B, HKV * G, D)), jnp.float32)
    kn, vn = (jnp.asarray(rng.standard_normal((B, HKV, 1, D)), jnp.float32) for _ in range(2))
    _, state = step(q, kn, vn, state)
  want_overflow = kept + steps > capacity
  if method.keeps_full_cache:  # the full cache overflows on its own count
    want_overflow |= LENGTHS + steps > state.full.capacity
  np.testing.assert_array_equal(np.asarray(state.length), np.minimum(kept + steps, capacity))
  np.testing.assert_array_equal(np.asarray(state.seen), LENGTHS + steps)
  np.testing.assert_array_equal(np.asarray(state.overflow), want_overflow)
  assert want_overflow[0]
  np.testing.assert_array_equal(np.asarray(state.overflow),
                                np.asarray(rocketkv.cache_overflow(state)))
  # The valid slots are those holding a position (pos >= 0), per head: the same count.
  pos = np.asarray(method.view(state).pos)
  np.testing.assert_array_equal((pos >= 0).sum(-1), np.broadcast_to(
      np.asarray(state.length)[:, None], (B, HKV)))
  assert state.nbytes == _np_nbytes(state)


def test_recommended_state_reads_like_a_cache():
  """User code written against a KVCache keeps working when the config becomes the recommended
  one (a QuantState)."""
  k, v, qw, _ = _inputs()
  for config in (rocketkv.RocketConfig(16, window_size=4),
                 rocketkv.RocketConfig.recommended(16, window_size=4)):
    plan = rocketkv.plan(config, L, NEW, D)
    state = rocketkv.prefill(k, v, qw, plan, lengths=jnp.asarray(LENGTHS))
    np.testing.assert_array_equal(np.asarray(state.length),
                                  np.minimum(LENGTHS, plan.prompt_budget))
    assert state.nbytes == _np_nbytes(state) > 0


def test_stacked_states_answer_per_layer_and_row():
  plan = spec_plan("rocketkv:quant", L, NEW, D)
  k, v, qw, _ = _inputs()
  states = [rocketkv.prefill(k, v, qw, plan, lengths=jnp.asarray(LENGTHS)) for _ in range(3)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *states)
  assert stacked.length.shape == (3, B) and stacked.overflow.shape == (3, B)
  assert stacked.nbytes == 3 * states[0].nbytes
