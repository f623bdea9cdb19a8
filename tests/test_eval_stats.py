"""rocketkv_jax/eval/stats.py against the exact bootstrap distribution (every resample of a tiny
vector enumerated) and against the normal approximation for large n."""

import itertools
import statistics

import numpy as np
import pytest

from rocketkv_jax.eval import stats


def _exact_quantiles(resampled_means, levels):
  """The exact bootstrap distribution's (1 -+ level) / 2 quantiles: the smallest atom whose CDF
  reaches q. Also asserts that q is well inside that atom's mass (> 0.008 on each side), so a
  10000-draw Monte Carlo bootstrap lands on the same atom; otherwise the test is invalid."""
  v, c = np.unique(np.round(resampled_means, 12), return_counts=True)
  cdf = np.cumsum(c) / c.sum()
  out = {}
  for level in levels:
    qs = []
    for q in ((1 - level) / 2, (1 + level) / 2):
      i = int(np.searchsorted(cdf, q))
      assert min(q - (cdf[i - 1] if i else 0.0), cdf[i] - q) > 0.008, (level, q)
      qs.append(float(v[i]))
    out[level] = tuple(qs)
  return out


def test_bootstrap_ci_is_the_exact_bootstrap_percentile_interval():
  x = np.array([0.0, 0.25, 0.5, 1.0, 1.0])
  idx = np.array(list(itertools.product(range(5), repeat=5)))  # all 5^5 equally likely resamples
  exact = _exact_quantiles(x[idx].mean(axis=1), (0.8, 0.9, 0.95))
  for level, (lo, hi) in exact.items():
    got = stats.bootstrap_ci(x, level=level)
    assert got == pytest.approx((lo, hi), abs=1e-12), level
  assert exact[0.95] == pytest.approx((0.2, 0.9))  # 0.95 is the default level
  assert stats.bootstrap_ci(list(x)) == pytest.approx((0.2, 0.9), abs=1e-12)


def test_paired_bootstrap_diff_is_the_exact_paired_bootstrap():
  a = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.0])
  b = np.array([0.0, 1.0, 0.0, 0.5, 0.5, 1.0])
  idx = np.array(list(itertools.product(range(6), repeat=6)))  # the same samples for a and b
  exact = _exact_quantiles(a[idx].mean(axis=1) - b[idx].mean(axis=1), (0.8, 0.9))
  for level, (lo, hi) in exact.items():
    d, got_lo, got_hi = stats.paired_bootstrap_diff(a, b, level=level)
    assert d == pytest.approx(1 / 12)
    assert (got_lo, got_hi) == pytest.approx((lo, hi), abs=1e-12), level


def _normal_half_width(sd, n, level):
  return statistics.NormalDist().inv_cdf((1 + level) / 2) * sd / np.sqrt(n)


def test_large_n_intervals_match_the_normal_approximation():
  rng = np.random.default_rng(1)
  x = (rng.random(2000) < 0.3).astype(float)
  for level in (0.9, 0.95):
    lo, hi = stats.bootstrap_ci(x, level=level)
    half = _normal_half_width(x.std(), x.size, level)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.06)
    assert (lo + hi) / 2 == pytest.approx(x.mean(), abs=0.15 * half)
  # paired: the width follows sd(a - b), far below what unpaired intervals would suggest
  a = (rng.random(2000) < 0.6).astype(float)
  b = np.where(rng.random(2000) < 0.1, 1.0 - a, a)  # b disagrees with a on ~10% of samples
  d, lo, hi = stats.paired_bootstrap_diff(a, b)
  assert d == pytest.approx(np.mean(a - b))
  half = _normal_half_width((a - b).std(), a.size, 0.95)
  assert (hi - lo) / 2 == pytest.approx(half, rel=0.06)
  assert (hi - lo) / 2 < 0.5 * _normal_half_width(np.hypot(a.std(), b.std()), a.size, 0.95)


def test_stratified_bootstrap_resamples_groups_independently():
  rng = np.random.default_rng(2)
  g = rng.random(1500)
  # two identical groups: independent resampling halves the variance of the mean of means
  # (sd / sqrt(2 n)); resampling both with the same indices would not (sd / sqrt(n))
  lo, hi = stats.stratified_bootstrap_ci([g, g])
  assert (hi - lo) / 2 == pytest.approx(_normal_half_width(g.std(), 2 * g.size, 0.95), rel=0.06)
  # unequal groups: the mean of the group means, not the pooled mean
  h = np.ones(10)
  lo, hi = stats.stratified_bootstrap_ci([g, h])
  var = g.var() / g.size / 4  # h never varies
  assert (hi - lo) / 2 == pytest.approx(_normal_half_width(np.sqrt(var), 1, 0.95), rel=0.06)
  assert (lo + hi) / 2 == pytest.approx((g.mean() + 1) / 2, abs=0.002)


def test_deterministic_degenerate_and_rejected_inputs():
  x = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
  y = np.random.default_rng(3).random(8)
  assert stats.bootstrap_ci(y) == stats.bootstrap_ci(y)  # same seed, same resamples
  assert stats.bootstrap_ci(y, seed=1) != stats.bootstrap_ci(y, seed=0)
  assert stats.bootstrap_ci([0.7] * 5) == pytest.approx((0.7, 0.7))
  assert stats.bootstrap_ci([0.3]) == pytest.approx((0.3, 0.3))
  assert stats.paired_bootstrap_diff(x, x) == (0.0, 0.0, 0.0)
  with pytest.raises(ValueError, match="same samples"):
    stats.paired_bootstrap_diff([1.0, 0.0], [1.0])
  with pytest.raises(ValueError, match="non-empty"):
    stats.bootstrap_ci([])
  with pytest.raises(ValueError, match="finite"):
    stats.bootstrap_ci([1.0, float("nan")])
  with pytest.raises(ValueError, match="level"):
    stats.bootstrap_ci(x, level=95)
  with pytest.raises(ValueError, match="n_boot"):
    stats.bootstrap_ci(x, n_boot=0)
  with pytest.raises(ValueError, match="at least one group"):
    stats.stratified_bootstrap_ci([])
