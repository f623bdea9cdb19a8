"""Sampling strategies (`rocketkv_jax.runtime.sampling`): each draws from the distribution it names,
checked by frequencies against a float64 NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rocketkv_jax.runtime import sampling

LOGITS = np.array([[2.0, 1.5, 0.3, -1.0, 1.9, 0.0, -0.5, 1.0],
                   [0.1, 0.2, 3.0, 2.9, -2.0, 0.5, 2.5, 0.4]], np.float32)  # [B=2, V=8]
N = 6000


def _frequencies(strategy) -> np.ndarray:
  """[B, V] share of N draws that picked each token."""
  keys = jax.random.split(jax.random.PRNGKey(0), N)
  ids = jax.jit(jax.vmap(lambda k: strategy(jnp.asarray(LOGITS), k)))(keys)  # [N, B]
  ids = np.asarray(ids)
  return np.stack([np.bincount(ids[:, b], minlength=LOGITS.shape[1]) / N
                   for b in range(LOGITS.shape[0])])


def _softmax_of(logits: np.ndarray, keep: np.ndarray, temperature: float) -> np.ndarray:
  z = np.where(keep, logits.astype(np.float64) / temperature, -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _top_k_mask(k: int) -> np.ndarray:
  order = np.argsort(-LOGITS, axis=-1)
  mask = np.zeros(LOGITS.shape, bool)
  np.put_along_axis(mask, order[:, :k], True, axis=-1)
  return mask


@pytest.mark.parametrize("k, temperature", [(3, 0.7), (1, 1.0), (100, 1.3)])
def test_top_k_draws_softmax_over_the_k_largest(k, temperature):
  freq = _frequencies(sampling.TopK(temperature=jnp.float32(temperature), k=k))
  want = _softmax_of(LOGITS, _top_k_mask(min(k, LOGITS.shape[1])), temperature)
  assert np.all(freq[want == 0] == 0)               # never outside the k largest
  np.testing.assert_allclose(freq, want, atol=0.025)  # ~4 sigma at N = 6000


def test_top_p_draws_softmax_over_the_nucleus():
  temperature, top_p = 0.8, 0.75
  freq = _frequencies(sampling.TopP(temperature=jnp.float32(temperature),
                                    top_p=jnp.float32(top_p)))
  full = _softmax_of(LOGITS, np.ones(LOGITS.shape, bool), temperature)
  order = np.argsort(-full, axis=-1)
  before = np.cumsum(np.take_along_axis(full, order, -1), -1) - np.take_along_axis(full, order, -1)
  keep = np.zeros(LOGITS.shape, bool)
  np.put_along_axis(keep, order, before < top_p, axis=-1)  # the smallest prefix reaching top_p
  want = _softmax_of(LOGITS, keep, temperature)
  assert np.all(freq[want == 0] == 0)
  np.testing.assert_allclose(freq, want, atol=0.025)


def test_greedy_and_top_k_of_one_are_argmax():
  key = jax.random.PRNGKey(3)
  want = np.argmax(LOGITS, -1)
  assert np.array_equal(sampling.Greedy()(jnp.asarray(LOGITS), key), want)
  assert np.array_equal(sampling.TopK(temperature=jnp.float32(2.0), k=1)(jnp.asarray(LOGITS),
                                                                           key), want)


@pytest.mark.parametrize("k", [0, -1, 2.0, True, None])
def test_top_k_rejects_a_bad_k(k):
  with pytest.raises(ValueError, match=r"^TopK.k must be an int >= 1"):
    sampling.TopK(temperature=1.0, k=k)


@pytest.mark.parametrize("make, match", [
    (lambda: sampling.TopP(temperature=1.0, top_p=0.0), r"^TopP.top_p must be in \(0, 1\]"),
    (lambda: sampling.TopP(temperature=1.0, top_p=float("nan")), r"^TopP.top_p must be in"),
    (lambda: sampling.TopP(temperature=float("nan"), top_p=0.9),
     "^TopP.temperature must be a finite number > 0, got nan"),
    (lambda: sampling.TopP(temperature=jnp.float32(0.0), top_p=jnp.float32(0.9)),
     "^TopP.temperature must be a finite number > 0, got 0.0"),
    (lambda: sampling.TopK(temperature=-5.0, k=3), "^TopK.temperature must be a finite number"),
])
def test_strategies_reject_values_they_would_silently_misuse(make, match):
  """top_p 0 or a NaN temperature drew token 0 every step; a negative one acted as greedy."""
  with pytest.raises(ValueError, match=match):
    make()


def test_strategies_check_concrete_values_only():
  """Inside jit the numbers are traced (not read); a NumPy k is an int."""
  top = sampling.as_strategy(sampling.TopP(temperature=0.7, top_p=0.9))
  out = jax.jit(lambda s, l, k: s(l, k))(top, jnp.zeros((2, 10)), jax.random.PRNGKey(0))
  assert out.shape == (2,)
  assert sampling.TopK(temperature=1.0, k=np.int64(3)).k == 3


def test_as_strategy_wraps_functions_and_converts_numbers():
  def last_token(logits, key):
    del key
    return jnp.full(logits.shape[:1], logits.shape[-1] - 1, jnp.int32)

  fn = sampling.as_strategy(last_token)
  assert isinstance(fn, sampling.Function) and jax.tree.leaves(fn) == []
  assert np.array_equal(fn(jnp.asarray(LOGITS), None), [7, 7])
  top_k = sampling.as_strategy(sampling.TopK(temperature=0.5, k=2))
  assert isinstance(top_k.temperature, jax.Array) and top_k.k == 2
  with pytest.raises(ValueError, match=r"^sampler must be a strategy"):
    sampling.as_strategy(0.7)
  with pytest.raises(ValueError, match=r"leaves must be numbers or arrays"):
    sampling.as_strategy(sampling.TopK(temperature="hot", k=2))


def test_as_strategy_keeps_a_one_leaf_pytree_of_ones_own():
  from flax import struct

  @struct.dataclass
  class Hot:
    temperature: jax.Array

    def __call__(self, logits, key):
      return jax.random.categorical(key, logits / self.temperature, axis=-1).astype(jnp.int32)

  hot = sampling.as_strategy(Hot(temperature=0.5))
  assert isinstance(hot, Hot) and isinstance(hot.temperature, jax.Array)
  freq = _frequencies(hot)
  np.testing.assert_allclose(freq, _softmax_of(LOGITS, np.ones(LOGITS.shape, bool), 0.5),
                             atol=0.025)


def test_sampler_picks_the_strategy_of_its_arguments():
  assert sampling.sampler(0.0, 0.5, 7) == sampling.Greedy()
  top_k = sampling.sampler(0.8, 1.0, 7)
  assert isinstance(top_k, sampling.TopK) and top_k.k == 7
  assert isinstance(sampling.sampler(0.8, 0.9), sampling.TopP)
  with pytest.raises(ValueError, match=r"^top_k goes without top_p < 1"):
    sampling.sampler(0.8, 0.9, 7)
