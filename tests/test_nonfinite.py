"""Non-finite inputs, measured over every registered method and stage-2 variant
(docs/reliability.md#non-finite-inputs): a NaN / Inf never changes another row, dense reads
return NaN from the step it arrives on; and the checked mode (`debug=True` under
`rocketkv.checked`) turns a non-finite input and a cache overflow into errors.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
from test_methods import D, G, L, LAYER, LENGTHS, NEW, VARIANTS, _config, _data

BAD_STEP = 1  # the step whose inputs hold the bad value (row 0 only)


def _run(name, where=None, value=np.nan):
  """NEW jitted decode steps; `where` in {"q", "k_new", "v_new"} puts `value` in row 0 of that
  input at step BAD_STEP, {"k", "v"} in a kept prompt token of row 0. Returns [B, NEW, Hq, D]."""
  k, v, qw, steps = _data()
  plan = rocketkv.plan(_config(name), L, NEW, D)
  if where in ("k", "v"):
    (k if where == "k" else v)[0, 0, LENGTHS[0] - 1, 0] = value  # in the window: always kept
  state = rocketkv.prefill(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan,
                           lengths=jnp.asarray(LENGTHS), layer=LAYER)
  step = jax.jit(lambda q, kn, vn, s: rocketkv.decode_step(q, kn, vn, s, plan, layer=LAYER))
  outs = []
  for i, xs in enumerate(steps):
    xs = dict(zip(("q", "k_new", "v_new"), (x.copy() for x in xs)))
    if i == BAD_STEP and where in xs:
      xs[where][0, 0, 0] = value
    out, state = step(*(jnp.asarray(xs[n]) for n in ("q", "k_new", "v_new")), state)
    outs.append(np.asarray(out))
  return np.stack(outs, 1)


@pytest.mark.parametrize("name", VARIANTS)
def test_a_steps_non_finite_input_stays_in_its_row(name):
  """A NaN / Inf in a step's q, k_new or v_new: earlier steps and other rows never change; a
  dense read (`Method.dense`) returns NaN at that step for a NaN (an Inf key gives NaN or no
  weight, by the sign of its logit); a selecting method's row is unspecified (its NaN scores
  may leave the new token unread)."""
  clean = _run(name)
  assert np.isfinite(clean).all()
  dense = methods.get(name.partition(":")[0]).dense
  for where in ("q", "k_new", "v_new"):
    for value in (np.nan, np.inf):
      out = _run(name, where, value)
      np.testing.assert_array_equal(out[0, :BAD_STEP], clean[0, :BAD_STEP])
      np.testing.assert_array_equal(out[1], clean[1])  # other rows never change
      if dense and value is np.nan:  # q: query head 0; k_new / v_new: KV head 0's group
        assert np.isnan(out[0, BAD_STEP, :1 if where == "q" else G]).any(axis=-1).all()


@pytest.mark.parametrize("name", VARIANTS)
def test_a_stored_nan_stays_in_its_row(name):
  """A NaN stored in the cache (a prompt token, an earlier step's key or value): rows without
  one never change; a dense read (`Method.dense`) returns NaN at every later step, in the query
  heads of the KV head that holds it (KV head 0: query heads 0..G-1)."""
  clean = _run(name)
  for where in ("k", "v", "k_new", "v_new"):
    out = _run(name, where)
    np.testing.assert_array_equal(out[1], clean[1])
    if methods.get(name.partition(":")[0]).dense:
      later = out[0] if where in ("k", "v") else out[0, BAD_STEP:]
      assert np.isnan(later[:, :G]).any(axis=-1).all(), where  # a NaN value: its dim


def _checked_setup(method="rocketkv", new=NEW, **config):
  k, v, qw, steps = _data()
  plan = rocketkv.plan(_config(method, **config), L, new, D)
  return k, v, qw, steps, plan


def test_checked_mode_raises_on_non_finite_inputs():
  k, v, qw, steps, plan = _checked_setup()
  prefill = rocketkv.checked(jax.jit(lambda k, v, qw, ln: rocketkv.prefill(
      k, v, qw, plan, lengths=ln, layer=LAYER, debug=True)))
  step = rocketkv.checked(jax.jit(lambda q, kn, vn, s: rocketkv.decode_step(
      q, kn, vn, s, plan, layer=LAYER, debug=True)))
  lengths = jnp.asarray(LENGTHS)
  state = prefill(k, v, qw, lengths)
  q, kn, vn = steps[0]
  out, _ = step(q, kn, vn, state)
  assert np.isfinite(np.asarray(out)).all()

  kp = k.copy()
  kp[1, 0, LENGTHS[1] + 3, 0] = np.nan  # padding past row 1's length: never read, no error
  prefill(kp, v, qw, lengths)
  kp[1, 0, 2, 0] = np.nan
  with pytest.raises(checkify.JaxRuntimeError, match=r"k holds a NaN or Inf in row 1"):
    prefill(kp, v, qw, lengths)
  with pytest.raises(ValueError, match=r"q_window holds a NaN or Inf in row 0"):
    prefill(k, v, np.where(np.arange(4)[None, None, :, None] == 2, np.inf, qw), lengths)
  for i, name in enumerate(("q", "k_new", "v_new")):
    bad = [x.copy() for x in steps[0]]
    bad[i][1, 0, 0] = np.nan
    with pytest.raises(ValueError, match=rf"{name} holds a NaN or Inf in row 1"):
      step(*bad, state)


def test_checked_mode_raises_on_overflow():
  k, v, qw, steps, plan = _checked_setup(method="full", new=1)
  state = rocketkv.prefill(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan,
                           lengths=jnp.asarray(LENGTHS))
  step = rocketkv.checked(jax.jit(lambda q, kn, vn, s: rocketkv.decode_step(
      q, kn, vn, s, plan, debug=True)))
  _, state = step(*steps[0], state)  # row 0 (48 of 49 slots) takes its last slot
  with pytest.raises(ValueError, match=r"cache overflow: row 0 is full"):
    step(*steps[1], state)


def test_debug_is_eager_too_and_names_checked_under_jit():
  k, v, qw, steps, plan = _checked_setup()
  state = rocketkv.prefill(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan,
                           lengths=jnp.asarray(LENGTHS), layer=LAYER)
  q, kn, vn = (x.copy() for x in steps[0])
  kn[0, 1, 0, 3] = np.inf
  with pytest.raises(ValueError, match=r"k_new holds a NaN or Inf in row 0"):
    rocketkv.decode_step(q, kn, vn, state, plan, layer=LAYER, debug=True)  # eager
  with pytest.raises(ValueError, match=r"debug=True under jax.jit needs .*rocketkv.checked") as e:
    jax.jit(lambda *a: rocketkv.decode_step(*a, plan, layer=LAYER, debug=True))(q, kn, vn, state)
  assert "\n" not in str(e.value)


def test_default_path_is_unchanged_by_debug():
  """debug=False adds no check to the program; debug=True computes the same outputs."""
  k, v, qw, steps, plan = _checked_setup()
  state = rocketkv.prefill(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan,
                           lengths=jnp.asarray(LENGTHS), layer=LAYER)
  fn = lambda debug: lambda *a: rocketkv.decode_step(*a, plan, layer=LAYER, debug=debug)  # noqa
  assert not re.search(r"\bcheck\[", str(jax.make_jaxpr(fn(False))(*steps[0], state)))
  plain = jax.jit(fn(False))(*steps[0], state)
  debug = rocketkv.checked(jax.jit(fn(True)))(*steps[0], state)
  np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(debug[0]))
