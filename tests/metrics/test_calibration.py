"""mergeval/metrics/calibration.py: ECE (from probabilities and from loglikelihoods), format agreement and
consistency (hypothesis invariants and hand-worked values)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.metrics.calibration import (
    consistency,
    ece_from_loglikelihoods,
    expected_calibration_error,
    format_agreement,
)
from tests.strategies import unit

SETTINGS = settings(max_examples=50, deadline=None)


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


@SETTINGS
@given(st.lists(st.tuples(unit, st.booleans()), min_size=1, max_size=50), st.integers(1, 20))
def test_ece_in_unit_interval(items, n_bins):
    conf, correct = zip(*items)
    assert 0.0 <= expected_calibration_error(conf, correct, n_bins) <= 1.0


def test_ece_hand_examples():
    assert expected_calibration_error([1.0] * 4, [True] * 4) == 0.0
    assert expected_calibration_error([0.0] * 3, [0, 0, 0]) == 0.0
    # bin [0.9,1): conf .95, acc .5 -> .45 * 2/4; bin [0.6,0.7): conf .65, acc 1 -> .35 * 2/4
    got = expected_calibration_error([0.95, 0.95, 0.65, 0.65], [1, 0, 1, 1])
    assert got == pytest.approx(0.225 + 0.175)
    # one bin: |mean acc - mean conf|
    assert expected_calibration_error([0.2, 0.8], [1, 0], n_bins=1) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        expected_calibration_error([1.2], [1])
    with pytest.raises(ValueError):
        expected_calibration_error([0.5, 0.5], [1])


def test_ece_from_loglikelihoods_hand_examples():
    # confident and right on every item: ECE ~ 0
    assert ece_from_loglikelihoods([[0.0, -1000.0], [-900.0, -1.0]], [0, 1]) == pytest.approx(0.0)
    # p = (0.8, 0.2), predicted 0 with confidence 0.8, correct: ECE = 0.2
    lls = [[math.log(0.8) - 5.0, math.log(0.2) - 5.0]]
    assert ece_from_loglikelihoods(lls, [0]) == pytest.approx(0.2)
    # same prediction, wrong: ECE = 0.8
    assert ece_from_loglikelihoods(lls, [1]) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        ece_from_loglikelihoods([[0.0, -1.0]], [2])


@SETTINGS
@given(
    # quarter-integers, so that shifting is exact and cannot flip an argmax by rounding
    st.lists(
        st.lists(st.integers(-200, 0).map(lambda k: k / 4), min_size=2, max_size=5),
        min_size=1,
        max_size=20,
    ),
    st.integers(-400, 400).map(lambda k: k / 4),
    st.data(),
)
def test_ece_from_loglikelihoods_shift_invariant(lls, shift, data):
    gold = [data.draw(st.integers(0, len(item) - 1)) for item in lls]
    ece = ece_from_loglikelihoods(lls, gold)
    assert 0.0 <= ece <= 1.0
    shifted = [[v + shift for v in item] for item in lls]
    assert ece_from_loglikelihoods(shifted, gold) == pytest.approx(ece, abs=1e-9)


def test_consistency():
    assert consistency(["A", "B", "C", "D"], ["A", "B", "D", "D"]) == 0.75
    assert consistency([1], [1]) == 1.0
    with pytest.raises(ValueError):
        consistency(["A"], [])
