"""mergeval/metrics/tradeoff.py: the Pareto front and the synergy area (hypothesis invariants and hand-worked
values)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.metrics.tradeoff import pareto_front, synergy_area
from tests.strategies import unit

SETTINGS = settings(max_examples=50, deadline=None)
# a coarse grid makes ties and duplicates likely; fine floats cover the rest
coord = st.one_of(st.integers(0, 4).map(lambda k: k / 4), unit)


point = st.tuples(coord, coord)


def _dominates(q, p) -> bool:
    return q[0] >= p[0] and q[1] >= p[1] and (q[0] > p[0] or q[1] > p[1])


@st.composite
def experts(draw):
    """(e1, e2) with e1 better on task 1 and e2 better on task 2."""
    x2, y1 = draw(unit), draw(unit)
    x1 = x2 + draw(st.floats(0.05, 1.0))
    y2 = y1 + draw(st.floats(0.05, 1.0))
    return (x1, y1), (x2, y2)


def _on_diagonal(e1, e2, t):
    return (e1[0] + t * (e2[0] - e1[0]), e1[1] + t * (e2[1] - e1[1]))


ts = st.lists(st.floats(-0.5, 1.5), min_size=1, max_size=8)


offsets = st.lists(st.tuples(st.floats(0.01, 0.5), st.floats(0.01, 0.5)), min_size=1, max_size=8)


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


@SETTINGS
@given(st.lists(point, max_size=25))
def test_pareto_front_properties(points):
    front = pareto_front(points)
    assert len(set(front)) == len(front)
    for i in front:
        assert not any(_dominates(q, points[i]) for q in points)
    for p in points:
        assert any(points[i][0] >= p[0] and points[i][1] >= p[1] for i in front)
    # every non-dominated point is on the front (so duplicates are all kept)
    assert set(front) == {i for i, p in enumerate(points) if not any(_dominates(q, p) for q in points)}
    xs = [points[i][0] for i in front]
    assert xs == sorted(xs)


def test_pareto_front_hand_example():
    pts = [(0.2, 0.9), (0.5, 0.5), (0.4, 0.4), (0.9, 0.1), (0.5, 0.5), (0.1, 0.9)]
    assert pareto_front(pts) == [0, 1, 4, 3]
    assert pareto_front([]) == []


@SETTINGS
@given(experts(), ts)
def test_synergy_zero_on_diagonal(ex, tlist):
    e1, e2 = ex
    pts = [_on_diagonal(e1, e2, t) for t in tlist]
    assert synergy_area(pts, e1, e2) == pytest.approx(0.0, abs=1e-12)


@SETTINGS
@given(experts(), st.floats(0.0, 1.0), st.tuples(st.floats(0.01, 0.5), st.floats(0.01, 0.5)), ts)
def test_synergy_positive_for_a_point_above(ex, t, off, tlist):
    e1, e2 = ex
    x, y = _on_diagonal(e1, e2, t)
    above = (x + off[0], y + off[1])
    assert synergy_area([above], e1, e2) > 0
    with_diagonal = [above] + [_on_diagonal(e1, e2, s) for s in tlist]
    assert synergy_area(with_diagonal, e1, e2) > 0


@SETTINGS
@given(experts(), ts, offsets, st.randoms(use_true_random=False))
def test_synergy_negative_below_and_order_free(ex, tlist, offs, rnd):
    e1, e2 = ex
    below = []
    for t, (dx, dy) in zip(tlist, offs):
        x, y = _on_diagonal(e1, e2, t)
        below.append((x - dx, y - dy))
    area = synergy_area(below, e1, e2)
    assert area < 0
    assert synergy_area(rnd.sample(below, len(below)), e1, e2) == area


@SETTINGS
@given(experts(), st.lists(point, min_size=1, max_size=15), st.randoms(use_true_random=False))
def test_synergy_order_free(ex, pts, rnd):
    e1, e2 = ex
    assert synergy_area(rnd.sample(pts, len(pts)), e1, e2) == synergy_area(pts, e1, e2)


def test_synergy_hand_examples():
    e1, e2 = (1.0, 0.0), (0.0, 1.0)
    # triangle (1,0), (0.6,0.6), (0,1): area 0.1
    assert synergy_area([(0.6, 0.6)], e1, e2) == pytest.approx(0.1)
    # the dominated point (0.5, 0.5) does not count
    assert synergy_area([(0.6, 0.6), (0.5, 0.5)], e1, e2) == pytest.approx(0.1)
    # best possible with scores in [0, 1]
    assert synergy_area([(1.0, 1.0)], e1, e2) == pytest.approx(0.5)
    # triangle (1,0), (0.4,0.4), (0,1) below the diagonal: -0.1
    assert synergy_area([(0.4, 0.4)], e1, e2) == pytest.approx(-0.1)
    # two points above: polygon (1,0),(0.8,0.5),(0.5,0.8),(0,1), shoelace area 0.39 / 2
    assert synergy_area([(0.5, 0.8), (0.8, 0.5)], e1, e2) == pytest.approx(0.195)
    with pytest.raises(ValueError, match="trade off"):
        synergy_area([(0.5, 0.5)], (0.0, 1.0), (1.0, 0.0))
    with pytest.raises(ValueError):
        synergy_area([], e1, e2)
