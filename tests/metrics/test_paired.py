"""Paired standard errors (metrics/paired.py): the definition, hand-derived cases and its invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mergeval.metrics.paired import Linear, Outcomes, items_to_decide, items_to_pass, paired_stderr, sample_variance


def outcomes(values, task="t", stderr=None):
    values = tuple(float(v) for v in values)
    se = math.sqrt(sample_variance(values) / len(values)) if stderr is None else stderr
    return Outcomes(task, se, tuple(range(len(values))), values)


def cov(x, y):
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / (len(x) - 1)


binary = st.lists(st.integers(0, 1), min_size=2, max_size=40)


def test_one_score_is_lm_evals_stderr():
    x = outcomes([1, 0, 1, 1])  # mean 0.75, s^2 = 0.25, se = sqrt(0.25 / 4) = 0.25
    assert paired_stderr(Linear.of("a", x)) == pytest.approx(0.25)


def test_hand_derived_difference():
    # x - y = [0, 0, 1, -1]: mean 0, s^2 = 2/3, se = sqrt(2/3 / 4) = 0.4082
    x, y = outcomes([1, 0, 1, 0]), outcomes([1, 0, 0, 1])
    assert paired_stderr(Linear.of("x", x) - Linear.of("y", y)) == pytest.approx(math.sqrt(2 / 3 / 4))
    # unpaired: s^2 = 1/3 each, sqrt(1/12 + 1/12) = 0.4082 too: these two are uncorrelated (cov 0)
    assert cov([1, 0, 1, 0], [1, 0, 0, 1]) == 0
    assert math.hypot(x.stderr, y.stderr) == pytest.approx(math.sqrt(2 / 3 / 4))


def test_identical_answers_differ_by_nothing():
    x = outcomes([1, 0, 1, 1, 0])
    assert paired_stderr(Linear.of("x", x) - Linear.of("y", outcomes([1, 0, 1, 1, 0]))) == 0.0


@given(binary, binary)
def test_paired_variance_is_the_unpaired_one_less_twice_the_covariance(a, b):
    n = min(len(a), len(b))
    x, y = a[:n], b[:n]
    paired = paired_stderr(Linear.of("x", outcomes(x)) - Linear.of("y", outcomes(y)))
    unpaired_sq = (sample_variance(x) + sample_variance(y)) / n
    assert paired**2 == pytest.approx(unpaired_sq - 2 * cov(x, y) / n, abs=1e-12)
    if cov(x, y) > 1e-12:
        assert paired < math.sqrt(unpaired_sq)  # positively correlated: smaller
    if abs(cov(x, y)) <= 1e-12:
        assert paired == pytest.approx(math.sqrt(unpaired_sq), abs=1e-12)  # uncorrelated: the same


@given(binary)
def test_zero_covariance_gives_the_unpaired_value(a):
    # y answers the first copy of the items like x and the second against it: sum (x_i - m)(y_i - 1/2) cancels
    # between the halves, so cov(x, y) = 0 exactly
    x = [*a, *a]
    y = [*a, *[1 - v for v in a]]
    assert cov(x, y) == pytest.approx(0.0, abs=1e-12)
    paired = paired_stderr(Linear.of("x", outcomes(x)) - Linear.of("y", outcomes(y)))
    assert paired == pytest.approx(math.hypot(outcomes(x).stderr, outcomes(y).stderr), abs=1e-12)


@given(binary, binary, st.floats(-3, 3), st.floats(-3, 3))
def test_different_tasks_add_as_independent(a, b, c, d):
    x, y = outcomes(a, task="t1"), outcomes(b, task="t2")
    got = paired_stderr(Linear.of("x", x) * c + Linear.of("y", y) * d)
    assert got == pytest.approx(math.hypot(c * x.stderr, d * y.stderr), abs=1e-12)


@given(binary, st.floats(0.1, 10))
def test_scaling_scales(a, c):
    x = outcomes(a)
    assert paired_stderr(Linear.of("x", x) * c) == pytest.approx(c * x.stderr, abs=1e-12)


def test_terms_without_items_are_taken_as_independent():
    x = outcomes([1, 0, 1, 1])
    bare = Outcomes("t", 0.2)
    assert paired_stderr(Linear.of("x", x) - Linear.of("b", bare)) == pytest.approx(math.hypot(x.stderr, 0.2))
    assert not (Linear.of("x", x) - Linear.of("b", bare)).paired


def test_the_same_key_twice_adds_its_coefficients():
    x = outcomes([1, 0, 1, 1])
    form = Linear.of("x", x) + Linear.of("x", x)
    assert paired_stderr(form) == pytest.approx(2 * x.stderr)
    assert paired_stderr(form - Linear.of("x", x) * 2) == 0.0


def test_items_to_decide_hand_derived():
    # measured 1 se above the threshold of a "by 1 se" claim (z = 2) on 20 items: 2 se from it at z = 3,
    # sqrt(n'/20) = 1.5, n' = 45
    assert items_to_decide(1.0, 1.0, 20) == 45
    assert items_to_decide(2.5, 1.0, 20) == 20  # already decided
    assert items_to_decide(-0.5, 0.0, 20) == 320  # fails by half a se: (2 / 0.5)^2 = 16 times the items
    assert items_to_decide(-1.0, 1.0, 20) is None  # no effect at all


@given(st.floats(-5, 5), st.sampled_from([0.0, 1.0, 2.0, 3.0]), st.integers(5, 500))
def test_items_to_decide_decides(margin, k, n):
    need = items_to_decide(margin, k, n)
    z = margin + k
    if need is None:
        assert z == 0 or n * max((k + 2) / abs(z), abs(2 - k) / abs(z)) ** 2 > 1e9
        return
    assert need >= n
    assert abs(z * math.sqrt(need / n) - k) >= 2 - 1e-9  # decided with that many items
    if need > n + 1:
        assert abs(z * math.sqrt((need - 2) / n) - k) < 2  # and not with noticeably fewer


def test_items_to_pass():
    # 3 se asked, 1.5 measured (margin -1.5) on 20 items: (3 / 1.5)^2 = 4 times the items
    assert items_to_pass(-1.5, 3.0, 20) == 80
    assert items_to_pass(0.2, 3.0, 20) == 20
    assert items_to_pass(-3.5, 3.0, 20) is None  # the effect is on the other side
