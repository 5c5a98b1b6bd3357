"""mergeval/metrics/aggregates.py: Macro-Gain, Macro-OG, normalized scores, bands and accuracy stderr
(hypothesis invariants and hand-worked values)."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mergeval.metrics.aggregates import (
    accuracy_stderr,
    band,
    macro_gain,
    macro_og,
    mean_normalized_score,
    normalized_score,
)

SETTINGS = settings(max_examples=100, deadline=None)


score = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, allow_infinity=False)


@st.composite
def models(draw, min_constituents: int = 1, max_constituents: int = 5):
    """(merged, constituents): aligned per-task score lists."""
    n_tasks = draw(st.integers(1, 10))
    n_const = draw(st.integers(min_constituents, max_constituents))
    row = st.lists(score, min_size=n_tasks, max_size=n_tasks)
    merged = draw(row)
    constituents = [draw(row) for _ in range(n_const)]
    return merged, constituents


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


def test_accuracy_stderr_by_hand():
    assert accuracy_stderr(0.5, 5) == pytest.approx(0.25)  # sqrt(0.25 / 4)
    assert accuracy_stderr(0.0, 10) == 0.0
    with pytest.raises(ValueError):
        accuracy_stderr(0.5, 1)


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


@SETTINGS
@given(models())
def test_og_never_exceeds_gain(m):
    merged, constituents = m
    assert macro_og(merged, constituents) <= macro_gain(merged, constituents) + 1e-12


@SETTINGS
@given(models(max_constituents=1))
def test_gain_equals_og_with_one_constituent(m):
    merged, constituents = m
    assert macro_gain(merged, constituents) == pytest.approx(macro_og(merged, constituents))


@SETTINGS
@given(models(), st.randoms(use_true_random=False))
def test_task_permutation_invariance(m, rnd):
    merged, constituents = m
    perm = list(range(len(merged)))
    rnd.shuffle(perm)
    merged_p = [merged[i] for i in perm]
    constituents_p = [[c[i] for i in perm] for c in constituents]
    for f in (macro_gain, macro_og):
        assert f(merged_p, constituents_p) == pytest.approx(f(merged, constituents))


@SETTINGS
@given(models(), st.randoms(use_true_random=False))
def test_constituent_permutation_invariance(m, rnd):
    merged, constituents = m
    shuffled = list(constituents)
    rnd.shuffle(shuffled)
    for f in (macro_gain, macro_og):
        assert f(merged, shuffled) == pytest.approx(f(merged, constituents))


@SETTINGS
@given(models())
def test_percent_is_100_times_fraction(m):
    merged, constituents = m
    for f in (macro_gain, macro_og):
        frac = f(merged, constituents, scale="fraction")
        assert f(merged, constituents, scale="percent") == pytest.approx(100 * frac, abs=1e-9)
        assert f(merged, constituents) == frac  # fraction is the default


@SETTINGS
@given(models(), st.data())
def test_misaligned_raises(m, data):
    merged, constituents = m
    i = data.draw(st.integers(0, len(constituents) - 1))
    extra = data.draw(st.lists(score, min_size=1, max_size=3))
    bad = [list(c) for c in constituents]
    if data.draw(st.booleans()) and len(bad[i]) > 1:
        bad[i] = bad[i][:-1]
    else:
        bad[i] = bad[i] + extra
    for f in (macro_gain, macro_og):
        with pytest.raises(ValueError):
            f(merged, bad)


@pytest.mark.parametrize("f", [macro_gain, macro_og])
def test_empty_and_bad_scale_raise(f):
    with pytest.raises(ValueError):
        f([], [[]])
    with pytest.raises(ValueError):
        f([0.5], [])
    with pytest.raises(ValueError):
        f([0.5], [[0.5]], scale="percentage")


def test_macro_example_two_constituents():
    merged = [0.6, 0.8]  # avg 0.70
    c1 = [0.5, 0.7]  # avg 0.60
    c2 = [0.7, 0.9]  # avg 0.80
    # gain = 0.70 - mean(0.60, 0.80) = 0.00 ; og = 0.70 - 0.80 = -0.10
    assert macro_gain(merged, [c1, c2]) == pytest.approx(0.0, abs=1e-12)
    assert macro_og(merged, [c1, c2]) == pytest.approx(-0.10)
    assert macro_og(merged, [c1, c2], scale="percent") == pytest.approx(-10.0)


def test_macro_example_three_constituents():
    merged = [0.9, 0.6, 0.6]  # avg 0.70
    cs = [
        [0.3, 0.3, 0.3],  # avg 0.30
        [0.6, 0.6, 0.6],  # avg 0.60
        [0.9, 0.3, 0.6],
    ]  # avg 0.60
    # gain = 0.70 - 0.50 = 0.20 ; og = 0.70 - 0.60 = 0.10
    assert macro_gain(merged, cs) == pytest.approx(0.20)
    assert macro_og(merged, cs) == pytest.approx(0.10)
    assert macro_gain(merged, cs, scale="percent") == pytest.approx(20.0)


@SETTINGS
@given(finite, finite)
def test_normalized_endpoints(base, expert):
    assume(abs(expert - base) > 1e-12)
    assert normalized_score(expert, base, expert) == pytest.approx(1.0)
    assert normalized_score(base, base, expert) == pytest.approx(0.0)


@SETTINGS
@given(finite, finite)
def test_normalized_undefined_when_expert_equals_base(merged, base):
    assert normalized_score(merged, base, base) is None
    assert normalized_score(merged, base, base + 1e-13) is None  # within eps


def test_normalized_example_and_mean():
    assert normalized_score(0.7, 0.5, 0.9) == pytest.approx(0.5)
    assert normalized_score(0.4, 0.5, 0.9) == pytest.approx(-0.25)
    assert mean_normalized_score([0.5, None, 1.0]) == pytest.approx(0.75)
    assert mean_normalized_score([None, None]) is None
    assert mean_normalized_score([]) is None


@pytest.mark.parametrize(
    "x, expected",
    [
        (None, "undefined"),
        (1.2, "good"),
        (0.8 + 1e-6, "good"),
        (0.8, "moderate"),  # the guide: good is *above* 0.8, moderate is between 0.5 and 0.8
        (math.nextafter(0.8, 1.0), "moderate"),  # a rounding error above 0.8 is still 0.8
        (0.5, "moderate"),
        (math.nextafter(0.5, 0.0), "moderate"),  # a rounding error below 0.5 is still 0.5
        (0.5 - 1e-6, "failing"),
        (-3.0, "failing"),
    ],
)
def test_band_boundaries(x, expected):
    assert band(x) == expected


def test_accuracy_stderr():
    # 0.5 * 0.5 / (101 - 1) = 0.0025 -> 0.05
    assert accuracy_stderr(0.5, 101) == pytest.approx(0.05)
    assert accuracy_stderr(1.0, 10) == 0.0
    with pytest.raises(ValueError):
        accuracy_stderr(0.5, 1)
    with pytest.raises(ValueError):
        accuracy_stderr(1.5, 10)
