"""Hand-worked values of the metric functions at the points where a plausible slip changes the number.

Each example is small enough to check on paper: bins of unequal size (ECE), ties between choices, a
bootstrap whose statistic is known exactly, token- versus text-weighted perplexity, per-format accuracies.
"""

from __future__ import annotations

import itertools
import math

import pytest

from mergeval.metrics.aggregates import accuracy_stderr, band, macro_gain, macro_og, normalized_score
from mergeval.metrics.calibration import ece_from_loglikelihoods, expected_calibration_error, format_agreement
from mergeval.metrics.groups import group_mean
from mergeval.metrics.perplexity import degradation, log_perplexity, mean_log_ratio, perplexity
from mergeval.metrics.tradeoff import pareto_front, synergy_area
from mergeval.metrics.uncertainty import bootstrap_ci, bootstrap_stderr, mean_ci

# ---------------------------------------------------------------- calibration


def test_ece_weights_each_bin_by_its_size():
    # bin [0.9, 1): 4 items, conf 0.95, acc 0.75 -> 0.20; bin [0.5, 0.6): 1 item, conf 0.55, acc 1 -> 0.45
    got = expected_calibration_error([0.95, 0.95, 0.95, 0.95, 0.55], [1, 1, 1, 0, 1])
    assert got == pytest.approx(4 / 5 * 0.20 + 1 / 5 * 0.45)  # 0.25, not the bins' plain mean 0.325


def test_ece_bin_edges():
    # 0.1 opens bin 1 (b/n <= conf): bin 0 {0.05: wrong} -> 0.05, bin 1 {0.1: right} -> 0.9
    assert expected_calibration_error([0.1, 0.05], [1, 0]) == pytest.approx(0.5 * 0.05 + 0.5 * 0.9)
    # conf 1.0 joins the last bin [0.9, 1]: acc 0.5, conf 0.96 -> 0.46 (apart they would give 0.54)
    assert expected_calibration_error([1.0, 0.92], [0, 1]) == pytest.approx(0.46)
    # 5 bins: 0.39 is in [0.2, 0.4), 0.41 in [0.4, 0.6)
    assert expected_calibration_error([0.39, 0.41], [1, 0], n_bins=5) == pytest.approx(0.5 * 0.61 + 0.5 * 0.41)


def test_ece_from_loglikelihoods_takes_the_first_of_tied_choices():
    # three equal choices: p = 1/3 each; predicted choice 0
    assert ece_from_loglikelihoods([[-1.0, -1.0, -1.0]], [0]) == pytest.approx(2 / 3)  # right: |1 - 1/3|
    assert ece_from_loglikelihoods([[-1.0, -1.0, -1.0]], [2]) == pytest.approx(1 / 3)  # wrong: |0 - 1/3|
    # softmax over the choices, not over the exponentiated log-likelihoods' raw sum: p = e^0 / (e^0 + e^-ln3)
    assert ece_from_loglikelihoods([[-2.0, -2.0 - math.log(3.0)]], [0]) == pytest.approx(1 - 0.75)


def test_format_agreement_counts_each_format_on_its_own():
    a = [
        {"doc_id": 0, "lls": [-1.0, -2.0], "gold": 0},
        {"doc_id": 1, "lls": [-1.0, -2.0], "gold": 1},
        {"doc_id": 2, "lls": [-3.0, -1.0], "gold": 1},
        {"doc_id": 3, "lls": [-1.0, -1.0], "gold": 0},
    ]
    b = [
        {"doc_id": 3, "lls": [-2.0, -1.0], "gold": 0},
        {"doc_id": 2, "lls": [-3.0, -1.0], "gold": 1},
        {"doc_id": 1, "lls": [-2.0, -1.0], "gold": 1},
        {"doc_id": 0, "lls": [-2.0, -1.0], "gold": 0},
    ]
    # pred a: 0 0 1 0 (doc 3 a tie: the first); pred b: 1 1 1 1; gold 0 1 1 0
    out = format_agreement(a, b)
    assert out == {"agreement": 0.25, "n": 4, "acc_a": 0.75, "acc_b": 0.5, "both_correct": 0.25}


# ---------------------------------------------------------------- uncertainty


def counting():
    """A statistic that ignores its sample and returns 0, 1, 2, ...: the bootstrap's spread is then known."""
    counter = itertools.count()
    return lambda sample: float(next(counter))


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


def test_accuracy_stderr_by_hand():
    assert accuracy_stderr(0.5, 5) == pytest.approx(0.25)  # sqrt(0.25 / 4)
    assert accuracy_stderr(0.0, 10) == 0.0
    with pytest.raises(ValueError):
        accuracy_stderr(0.5, 1)


# ---------------------------------------------------------------- aggregates, groups


def test_macro_gain_averages_tasks_before_constituents():
    merged = [0.5, 0.7]
    constituents = [[0.2, 0.6], [0.9, 0.3], [0.4, 0.4]]  # averages 0.4, 0.6, 0.4
    assert macro_gain(merged, constituents) == pytest.approx(0.6 - 1.4 / 3)
    assert macro_og(merged, constituents, scale="percent") == pytest.approx(0.0, abs=1e-12)


def test_normalized_score_beyond_the_expert_and_below_the_base():
    assert normalized_score(0.9, 0.5, 0.7) == pytest.approx(2.0)
    assert normalized_score(0.4, 0.5, 0.7) == pytest.approx(-0.5)
    assert normalized_score(0.4, 0.5, 0.3) == pytest.approx(0.5)  # an expert below the base: still (m-b)/(e-b)
    assert [band(x) for x in (2.0, 0.5, 0.4999, None)] == ["good", "moderate", "failing", "undefined"]


def test_group_mean_with_given_weights_and_scales():
    scores = {"a": 0.5, "b": 0.7, "c": 30.0}
    groups = {"small": ["a", "b"], "big": ["c"]}
    # small rescaled by 100: mean 60; big: 30; weights 1 and 2 -> (60 + 60) / 3
    got = group_mean(scores, groups, {"small": 100.0}, "given", {"small": 1.0, "big": 2.0})
    assert got == pytest.approx(40.0)
    assert group_mean(scores, groups, {"small": 100.0}, "equal") == pytest.approx(45.0)
    assert group_mean(scores, groups, {"small": 100.0}) == pytest.approx((50 + 70 + 30) / 3)  # by task count


# ---------------------------------------------------------------- perplexity


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


# ---------------------------------------------------------------- trade-off


def test_pareto_front_drops_a_point_behind_one_with_the_same_y():
    assert pareto_front([(0.5, 0.5), (0.4, 0.5), (0.5, 0.4)]) == [0]
    assert pareto_front([(0.3, 0.8), (0.3, 0.8), (0.8, 0.3)]) == [0, 1, 2]


def test_synergy_area_of_one_point_is_a_triangle():
    # experts (1, 0) and (0, 1): the diagonal has length sqrt 2; the point (0.75, 0.75) sits at u = 0.5,
    # height (0.75 + 0.75 - 1) / sqrt 2 above it: area = sqrt 2 * (1/2 * 1 * 0.5/sqrt 2) = 0.25
    assert synergy_area([(0.75, 0.75)], (1.0, 0.0), (0.0, 1.0)) == pytest.approx(0.25)
    assert synergy_area([(0.25, 0.25)], (1.0, 0.0), (0.0, 1.0)) == pytest.approx(-0.25)
    # a point beyond expert 1 is clipped onto u = 0 and keeps its height: the trapezoid (0, h) -> (1, 0)
    h = (1.2 + 0.1 - 1) / math.sqrt(2)
    assert synergy_area([(1.2, 0.1)], (1.0, 0.0), (0.0, 1.0)) == pytest.approx(math.sqrt(2) * h / 2)


# ---------------------------------------------------------------- similarity pooling


def test_task_vector_stats_pool_layers_and_the_whole_model_by_sums():
    import torch

    from mergeval.metrics.similarity import task_vector_stats

    names = ("model.layers.0.w", "model.layers.0.b", "model.embed.weight")
    base = {n: torch.zeros(2 if "layers" in n else 1) for n in names}
    a = {
        "model.layers.0.w": torch.tensor([1.0, 0.0]),
        "model.layers.0.b": torch.tensor([0.0, 2.0]),
        "model.embed.weight": torch.tensor([3.0]),
    }
    b = {
        "model.layers.0.w": torch.tensor([1.0, 1.0]),
        "model.layers.0.b": torch.tensor([0.0, -2.0]),
        "model.embed.weight": torch.tensor([3.0]),
    }
    out = task_vector_stats(base, a, b)
    # layer 0 pools (1, 0, 0, 2) and (1, 1, 0, -2): dot -3, squares 5 and 6, one conflict of 4, 2 non-zero in both
    layer = out["by_layer"][0]
    assert layer["cosine"] == pytest.approx(-3 / math.sqrt(30)) and layer["l2"] == pytest.approx(math.sqrt(17))
    assert (layer["numel"], layer["sign_conflict"], layer["sign_conflict_nonzero"]) == (4, 0.25, 0.5)
    # the whole model adds the embedding (3 and 3), which belongs to no layer
    whole = out["overall"]
    assert whole["cosine"] == pytest.approx(6 / math.sqrt(14 * 15)) and whole["l2"] == pytest.approx(math.sqrt(17))
    assert (whole["numel"], whole["sign_conflict"]) == (5, 0.2)
    assert whole["sign_conflict_nonzero"] == pytest.approx(1 / 3)
    assert set(out["by_layer"]) == {0} and out["per_tensor"]["model.embed.weight"]["layer"] is None
