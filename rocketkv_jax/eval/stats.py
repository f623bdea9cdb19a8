"""Percentile-bootstrap confidence intervals for per-sample scores.

    lo, hi = bootstrap_ci(scores)                  # 95% interval of the mean score
    d, lo, hi = paired_bootstrap_diff(a, b)        # mean(a - b) and its 95% interval
    lo, hi = stratified_bootstrap_ci([s1, s2])     # mean of group means (e.g. over tasks)

A sweep scores every method on the same prompts, so two methods are compared with a paired
bootstrap: samples (not methods) are resampled, and the interval is that of the mean per-sample
difference. That interval is much narrower than one read off two unpaired intervals when the
methods agree on most prompts, which they do.

Intervals are percentile intervals: the (1 - level) / 2 and (1 + level) / 2 quantiles (NumPy's
default linear interpolation) of `n_boot` resampled means. Everything is NumPy float64 and
deterministic: the same `seed` gives the same resamples, so a table regenerated from the same
JSON is identical. A percentile bootstrap never leaves the range of the observed scores: a cell
where every sample scored the same gets a zero-width interval ("0.0 [0.0, 0.0]"), which says
nothing about certainty, and with few samples (20 per cell here) intervals are somewhat narrower
than exact binomial ones. That is why tables also print n.
"""

from __future__ import annotations

import numpy as np


def _check(level: float, n_boot: int) -> None:
  if not 0.0 < level < 1.0:
    raise ValueError(f"level must be in (0, 1), got {level!r}")
  if int(n_boot) < 1:
    raise ValueError(f"n_boot must be >= 1, got {n_boot!r}")


def _as_scores(x, name: str) -> np.ndarray:
  a = np.asarray(x, dtype=np.float64)
  if a.ndim != 1 or a.size == 0:
    raise ValueError(f"{name} must be a non-empty 1-D sequence of numbers, got shape {a.shape}")
  if not np.all(np.isfinite(a)):
    raise ValueError(f"{name} must be finite; it has {int(np.sum(~np.isfinite(a)))} NaN/inf")
  return a


def bootstrap_means(scores, *, n_boot: int = 10000, rng: np.random.Generator) -> np.ndarray:
  """[n_boot] means of `scores` resampled with replacement (each resample has len(scores))."""
  a = _as_scores(scores, "scores")
  idx = rng.integers(0, a.size, size=(int(n_boot), a.size))
  return a[idx].mean(axis=1)


def _interval(means: np.ndarray, level: float) -> tuple[float, float]:
  lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
  return float(lo), float(hi)


def bootstrap_ci(scores, *, level: float = 0.95, n_boot: int = 10000,
                 seed: int = 0) -> tuple[float, float]:
  """Percentile-bootstrap interval (lo, hi) of the mean of `scores` [n]."""
  _check(level, n_boot)
  return _interval(bootstrap_means(scores, n_boot=n_boot, rng=np.random.default_rng(seed)),
                   level)


def paired_bootstrap_diff(a, b, *, level: float = 0.95, n_boot: int = 10000,
                          seed: int = 0) -> tuple[float, float, float]:
  """(mean(a - b), lo, hi): `a` [n] and `b` [n] are two methods' scores on the same n samples,
  in the same order; the samples are resampled together."""
  _check(level, n_boot)
  a, b = _as_scores(a, "a"), _as_scores(b, "b")
  if a.shape != b.shape:
    raise ValueError(f"a and b must score the same samples; got {a.size} and {b.size} scores")
  d = a - b
  lo, hi = _interval(bootstrap_means(d, n_boot=n_boot, rng=np.random.default_rng(seed)), level)
  return float(d.mean()), lo, hi


def stratified_bootstrap_ci(groups, *, level: float = 0.95, n_boot: int = 10000,
                            seed: int = 0) -> tuple[float, float]:
  """Interval of the mean of the group means (e.g. a mean over tasks of per-task scores); each
  group is resampled on its own samples, the groups independently of each other."""
  _check(level, n_boot)
  groups = list(groups)
  if not groups:
    raise ValueError("groups must hold at least one group of scores")
  rng = np.random.default_rng(seed)
  means = np.mean([bootstrap_means(g, n_boot=n_boot, rng=rng) for g in groups], axis=0)
  return _interval(means, level)
