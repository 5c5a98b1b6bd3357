"""Uncertainty of benchmark scores: confidence intervals and bootstrap errors.

Pure functions, no I/O.

- ``mean_ci``: normal-approximation interval from a mean and its standard error
  (e.g. lm-eval's ``acc`` and ``acc_stderr``).
- ``wilson_interval``: Wilson score interval for a proportion (k successes of n);
  unlike the normal interval it stays inside [0, 1] and is sensible near 0 and 1.
- ``bootstrap_stderr`` / ``bootstrap_ci``: nonparametric bootstrap of any
  statistic of per-item values, deterministic in ``seed`` (numpy Generator).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Integral
from statistics import NormalDist

import numpy as np


def _z(level: float) -> float:
    """Two-sided standard-normal quantile: z = Phi^{-1}((1 + level) / 2)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    return NormalDist().inv_cdf((1.0 + level) / 2.0)


def mean_ci(mean: float, stderr: float, level: float = 0.95) -> tuple[float, float]:
    """Normal-approximation confidence interval for a mean.

        z  = Phi^{-1}((1 + level) / 2)        (1.95996... for level = 0.95)
        CI = (mean - z * stderr, mean + z * stderr)

    Raises ValueError when mean or stderr is not finite, stderr < 0, or level
    is not in (0, 1).
    """
    if not (math.isfinite(mean) and math.isfinite(stderr)):
        raise ValueError(f"mean and stderr must be finite, got {mean}, {stderr}")
    if stderr < 0:
        raise ValueError(f"stderr must be >= 0, got {stderr}")
    half = _z(level) * stderr
    return mean - half, mean + half


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion p_hat = successes / n.

        z      = Phi^{-1}((1 + level) / 2)
        center = (p_hat + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p_hat (1 - p_hat) / n + z^2 / (4 n^2))
        CI     = (center - half, center + half)

    The interval always contains p_hat and lies in [0, 1]; the bounds are
    clamped to that exactly, against rounding. Requires integers n >= 1 and
    0 <= successes <= n, and level in (0, 1); raises ValueError otherwise.
    """
    if not isinstance(n, Integral) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not isinstance(successes, Integral) or isinstance(successes, bool):
        raise ValueError(f"successes must be an integer, got {successes!r}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    z = _z(level)
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n))
    lo = min(max(center - half, 0.0), p)
    hi = max(min(center + half, 1.0), p)
    return lo, hi


def _bootstrap_statistics(
    values: Sequence[float] | np.ndarray,
    statistic: Callable[[np.ndarray], float],
    n_resamples: int,
    seed: int,
) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"values must be a non-empty 1-D sequence, got shape {arr.shape}")
    if n_resamples < 2:
        raise ValueError(f"n_resamples must be >= 2, got {n_resamples}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, arr.size, size=(n_resamples, arr.size))
    return np.array([float(statistic(arr[row])) for row in idx])


def bootstrap_stderr(
    values: Sequence[float] | np.ndarray,
    statistic: Callable[[np.ndarray], float],
    n_resamples: int = 1000,
    seed: int = 0,
) -> float:
    """Bootstrap standard error of ``statistic(values)``.

        for r = 1..R:  x*_r = n values drawn from values with replacement
                       s_r  = statistic(x*_r)
        stderr = sqrt( sum_r (s_r - mean(s))^2 / (R - 1) )

    R = n_resamples; the resampling indices come from
    ``numpy.random.default_rng(seed)``, so equal seeds give equal results.
    ``statistic`` receives a 1-D float array. Raises ValueError on empty or
    non-1-D values or n_resamples < 2.
    """
    stats = _bootstrap_statistics(values, statistic, n_resamples, seed)
    return float(np.std(stats, ddof=1))


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    statistic: Callable[[np.ndarray], float],
    level: float = 0.95,
    n_resamples: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval for ``statistic(values)``.

        s_1..s_R as in ``bootstrap_stderr`` (same resamples for the same seed)
        CI = (quantile(s, (1 - level) / 2), quantile(s, (1 + level) / 2))

    Quantiles use numpy's default (linear) interpolation. Raises ValueError on
    empty values, n_resamples < 2 or level not in (0, 1).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    stats = _bootstrap_statistics(values, statistic, n_resamples, seed)
    lo, hi = np.quantile(stats, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)
