"""mergeval/metrics/uncertainty.py: bootstrap, mean and Wilson intervals (hypothesis invariants and
hand-worked values)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.metrics.uncertainty import (
    bootstrap_ci,
    bootstrap_stderr,
    mean_ci,
    wilson_interval,
)
from tests.strategies import unit


def counting():
    """A statistic that ignores its sample and returns 0, 1, 2, ...: the bootstrap's spread is then known."""
    counter = itertools.count()
    return lambda sample: float(next(counter))


SETTINGS = settings(max_examples=50, deadline=None)


def test_bootstrap_stderr_is_the_sample_std_of_the_replicates():
    # replicates 0, 1, 2, 3: mean 1.5, squared deviations 5, over R - 1 = 3
    assert bootstrap_stderr([0.2, 0.4], counting(), n_resamples=4) == pytest.approx(math.sqrt(5 / 3))
    assert bootstrap_stderr([0.2, 0.4], counting(), n_resamples=2) == pytest.approx(math.sqrt(0.5))


def test_bootstrap_ci_takes_the_two_sided_quantiles():
    # replicates 0..4: the 10% and 90% quantiles by linear interpolation are 0.4 and 3.6
    assert bootstrap_ci([0.2, 0.4], counting(), level=0.8, n_resamples=5) == pytest.approx((0.4, 3.6))
    assert bootstrap_ci([0.2], counting(), level=0.5, n_resamples=5) == pytest.approx((1.0, 3.0))


def test_mean_ci_at_90_percent():
    lo, hi = mean_ci(0.6, 0.05, level=0.90)
    assert (lo, hi) == pytest.approx((0.6 - 1.6448536 * 0.05, 0.6 + 1.6448536 * 0.05), abs=1e-7)


def test_mean_ci_hand_example():
    lo, hi = mean_ci(0.5, 0.1)
    assert lo == pytest.approx(0.5 - 0.195996, abs=1e-6)
    assert hi == pytest.approx(0.5 + 0.195996, abs=1e-6)
    assert mean_ci(0.3, 0.0) == (0.3, 0.3)
    with pytest.raises(ValueError):
        mean_ci(0.5, -0.1)
    with pytest.raises(ValueError):
        mean_ci(0.5, 0.1, level=1.0)


def test_wilson_hand_example():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.236593, abs=1e-5)
    assert hi == pytest.approx(0.763407, abs=1e-5)
    assert wilson_interval(0, 10)[0] == 0.0
    assert wilson_interval(10, 10)[1] == 1.0
    for bad in [(-1, 10), (11, 10), (1, 0), (0.5, 10)]:
        with pytest.raises(ValueError):
            wilson_interval(*bad)


@SETTINGS
@given(st.integers(1, 2000), st.data(), st.floats(0.5, 0.999))
def test_wilson_contains_phat_and_stays_in_unit_interval(n, data, level):
    k = data.draw(st.integers(0, n))
    lo, hi = wilson_interval(k, n, level)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


@SETTINGS
@given(st.lists(unit, min_size=1, max_size=30), st.integers(0, 2**32 - 1))
def test_bootstrap_is_deterministic_in_seed(values, seed):
    se1 = bootstrap_stderr(values, np.mean, n_resamples=200, seed=seed)
    se2 = bootstrap_stderr(values, np.mean, n_resamples=200, seed=seed)
    ci1 = bootstrap_ci(values, np.mean, n_resamples=200, seed=seed)
    ci2 = bootstrap_ci(values, np.mean, n_resamples=200, seed=seed)
    assert se1 == se2 and ci1 == ci2
    assert se1 >= 0.0
    assert min(values) - 1e-12 <= ci1[0] <= ci1[1] <= max(values) + 1e-12


def test_bootstrap_examples():
    assert bootstrap_stderr([0.7] * 5, np.mean) == pytest.approx(0.0, abs=1e-12)
    assert bootstrap_ci([0.7] * 5, np.mean) == pytest.approx((0.7, 0.7))
    # stderr of a mean of n 0/1 values ~ sqrt(p(1-p)/n) = sqrt(.25/400) = 0.025
    values = [0, 1] * 200
    assert bootstrap_stderr(values, np.mean, n_resamples=2000) == pytest.approx(0.025, rel=0.1)
    with pytest.raises(ValueError):
        bootstrap_stderr([], np.mean)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, 2.0], np.mean, level=0.0)
