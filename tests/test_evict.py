"""Stage 1 against the float64 reference: window kept, and every kept candidate's pooled score
is >= every evicted candidate's (scores, not indices: max-pooling makes ties)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rocketkv_jax as rocketkv
from rocketkv_jax.evict import window_scores_xla
import reference as ref


def _check_sequence(cache, b, k, v, qw, length, plan):
  w = qw.shape[2]
  kept_n = int(cache.length[b])
  assert kept_n == min(plan.prompt_budget, length)
  pos = np.asarray(cache.pos[b])
  scores = ref.window_scores(qw[b], k[b, :, :length], length, plan.window_reduce)
  pooled = ref.pooled(scores, length, w, plan.kernel_size)
  for h in range(k.shape[1]):
    kept = pos[h, :kept_n]
    assert np.all(np.diff(kept) > 0), "position order"
    assert np.all(pos[h, kept_n:] == -1)
    np.testing.assert_array_equal(np.asarray(cache.k[b, h, :kept_n]), k[b, h, kept])
    np.testing.assert_array_equal(np.asarray(cache.v[b, h, :kept_n]), v[b, h, kept])
    if length <= plan.prompt_budget:
      np.testing.assert_array_equal(kept, np.arange(length))
      continue
    window = np.arange(length - w, length)
    assert set(window) <= set(kept.tolist())
    cand_kept = np.array([p for p in kept if p < length - w])
    evicted = np.setdiff1d(np.arange(length - w), cand_kept)
    assert len(cand_kept) == plan.prompt_budget - w
    if len(evicted):
      assert pooled[h, cand_kept].min() >= pooled[h, evicted].max() - 1e-5


def _rand(seed, b, hq, hkv, l, w, d):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((b, hkv, l, d)).astype(np.float32)
  v = rng.standard_normal((b, hkv, l, d)).astype(np.float32)
  qw = rng.standard_normal((b, hq, w, d)).astype(np.float32)
  return k, v, qw


@given(seed=st.integers(0, 10_000), g=st.sampled_from([1, 3, 4]), hkv=st.sampled_from([1, 2]),
       l=st.sampled_from([20, 77, 160]), budget=st.sampled_from([16, 40, 96]),
       ragged=st.booleans(), kernel=st.sampled_from([1, 7, 63]),
       reduce=st.sampled_from(rocketkv.WINDOW_REDUCE))
@settings(max_examples=15, deadline=None)
def test_evict_matches_reference(seed, g, hkv, l, budget, ragged, kernel, reduce):
  w, d, b = 8, 16, 2
  k, v, qw = _rand(seed, b, g * hkv, hkv, l, w, d)
  lengths = np.array([l, max(w, l // 2)] if ragged else [l, l], np.int32)
  # q_window holds the last W valid queries of each sequence: the data is random anyway.
  cfg = rocketkv.RocketConfig(token_budget=budget, window_size=w, kernel_size=kernel,
                              prompt_budget=budget, window_reduce=reduce)
  plan = rocketkv.plan(cfg, l, 3, d)
  cache = rocketkv.evict(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan,
                         lengths=jnp.asarray(lengths))
  assert cache.capacity == plan.capacity
  for bi in range(b):
    _check_sequence(cache, bi, k, v, qw, int(lengths[bi]), plan)
  # Summaries equal min/max recomputed from the kept keys.
  for bi in range(b):
    kmin, kmax = ref.chunk_bounds(np.asarray(cache.k[bi]), int(cache.length[bi]),
                                  plan.chunk_size)
    np.testing.assert_allclose(np.asarray(cache.kmin[bi]), kmin, rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(cache.kmax[bi]), kmax, rtol=0, atol=0)


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_window_scores_match_reference(reduce):
  k, v, qw = _rand(3, 2, 8, 2, 100, 16, 32)
  lengths = np.array([100, 40], np.int32)
  got = window_scores_xla(jnp.asarray(qw), jnp.asarray(k), jnp.asarray(lengths), reduce)
  for b in range(2):
    want = ref.window_scores(qw[b], k[b, :, :lengths[b]], int(lengths[b]), reduce)
    np.testing.assert_allclose(np.asarray(got[b, :, :lengths[b]]), want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got[b, :, lengths[b]:]) == 0)


def test_prompt_that_fits_is_kept_whole():
  k, v, qw = _rand(0, 1, 4, 2, 50, 8, 16)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=512, window_size=8), 50, 5, 16)
  cache = rocketkv.evict(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan)
  assert int(cache.length[0]) == 50 and cache.capacity == 55
  np.testing.assert_array_equal(np.asarray(cache.k[0, :, :50]), k[0])


def test_evict_jits():
  k, v, qw = _rand(1, 1, 4, 2, 128, 8, 16)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=32, window_size=8), 128, 4, 16)
  f = jax.jit(rocketkv.evict, static_argnums=3)
  a = f(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan)
  b = rocketkv.evict(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan)
  np.testing.assert_array_equal(np.asarray(a.pos), np.asarray(b.pos))


def test_window_reduce_max_keeps_the_key_one_sharp_query_picks():
  """A key that one window query attends to sharply, while the others spread their mass over
  the rest, is evicted by "sum" and kept by "max" (in place of the weakest shared key)."""
  l, w, d = 40, 4, 8
  k = np.zeros((1, 1, l, d), np.float32)
  k[0, 0, 5, 0] = 1.0  # the needle
  k[0, 0, 20:24, 1] = [1.0, 0.98, 0.96, 0.94]  # four keys the other queries share
  qw = np.zeros((1, 1, w, d), np.float32)
  qw[0, 0, 0, 0] = 6.2  # one query looks at the needle (probability ~0.2)
  qw[0, 0, 1:, 1] = 5.0  # three look at keys 20..23 (~0.1 each, ~0.3 summed over the three)
  out = {}
  for reduce in rocketkv.WINDOW_REDUCE:
    cfg = rocketkv.RocketConfig(token_budget=8, window_size=w, kernel_size=1, prompt_budget=w + 4,
                                window_reduce=reduce)
    plan = rocketkv.plan(cfg, l, 1, d)
    cache = rocketkv.evict(jnp.asarray(k), jnp.asarray(k), jnp.asarray(qw), plan)
    out[reduce] = set(np.asarray(cache.pos[0, 0, :plan.prompt_budget]).tolist())
  window = set(range(l - w, l))
  assert out["sum"] == {20, 21, 22, 23} | window
  assert out["max"] == {5, 20, 21, 22} | window
  # the Pallas window kernel (interpret mode) keeps the same keys with "max"
  cache = rocketkv.evict(jnp.asarray(k), jnp.asarray(k), jnp.asarray(qw), plan, impl="interpret")
  assert set(np.asarray(cache.pos[0, 0, :plan.prompt_budget]).tolist()) == out["max"]


def test_window_reduce_reaches_the_plan_and_the_eval_specs():
  from rocketkv_jax.eval import variants
  for method in ("rocketkv", "rocketkv_mt", "snapkv"):
    cfg = variants.rocket_config(f"{method}:window_reduce=max", 256)
    assert rocketkv.plan(cfg, 4000, 24, 64).window_reduce == "max"
  assert rocketkv.plan(rocketkv.RocketConfig(token_budget=256), 4000, 24, 64).window_reduce == "sum"
  with pytest.raises(ValueError,
                     match=r"^window_reduce must be one of \['sum', 'max'\], got 'mean'$"):
    rocketkv.RocketConfig(token_budget=256, window_reduce="mean")
  with pytest.raises(ValueError,
                     match=r"window_reduce='mean' in .* must be one of \['sum', 'max'\]"):
    variants.parse("rocketkv:window_reduce=mean")
