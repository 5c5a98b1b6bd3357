"""mergeval/metrics/perplexity.py: pooled perplexity, log ratios and degradation, by hand."""

from __future__ import annotations

import math

import pytest

from mergeval.metrics.perplexity import degradation, log_perplexity, mean_log_ratio, perplexity


def test_perplexity_pools_tokens():
    nlls = [[1.0, 1.0, 1.0], [4.0]]
    assert log_perplexity(nlls) == pytest.approx(7 / 4)  # not the texts' mean (1 + 4) / 2
    assert perplexity(nlls) == pytest.approx(math.exp(1.75))


def test_mean_log_ratio_and_degradation_by_hand():
    ref = {"a": 10.0, "b": 10.0}
    assert mean_log_ratio({"a": 20.0, "b": 5.0}, ref) == pytest.approx(0.0)  # ln 2 and ln 1/2 cancel
    assert degradation({"a": 20.0, "b": 5.0}, ref) == pytest.approx(0.0)
    assert mean_log_ratio({"a": 40.0, "b": 10.0}, ref) == pytest.approx(math.log(2.0))
    assert degradation({"a": 40.0, "b": 10.0}, ref) == pytest.approx(1.0)  # 100% more perplexed
    assert degradation({"a": 5.0}, ref) == pytest.approx(-0.5)
