"""Two-task trade-off of merged models: Pareto front and synergy area.

Pure functions on plain Python floats: no I/O.

Each point is (score on task 1, score on task 2) of one merge configuration
(e.g. one mixing weight lambda). Following a merging evaluation guide, the
reference is the "diagonal": the segment from the task-1 expert's point to the
task-2 expert's point, i.e. what randomly routing each query to one of the two
experts achieves. A Pareto front above the diagonal means merging is
synergistic; below it, routing between the experts would do better.

- ``pareto_front``: indices of the non-dominated points (both coordinates
  maximised).
- ``synergy_area``: signed area between the (piecewise-linear) Pareto front
  and the diagonal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Point = tuple[float, float]


def _check_points(points: Sequence[Sequence[float]], what: str = "points") -> list[Point]:
    out = []
    for i, p in enumerate(points):
        if len(p) != 2:
            raise ValueError(f"{what}[{i}] must be an (x, y) pair, got {p!r}")
        x, y = float(p[0]), float(p[1])
        if not (math.isfinite(x) and math.isfinite(y)):
            raise ValueError(f"{what}[{i}] must be finite, got {p!r}")
        out.append((x, y))
    return out


def pareto_front(points: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the points that no other point dominates, sorted by x.

        q dominates p  <=>  q.x >= p.x and q.y >= p.y and (q.x > p.x or q.y > p.y)
        front = { i : no point dominates points[i] }

    Both coordinates are maximised. Exact duplicates do not dominate each
    other, so all copies of a front point are kept. The result is sorted by
    (x, index); along it y is non-increasing. An empty input gives [].
    Raises ValueError on a point that is not a finite (x, y) pair.
    """
    pts = _check_points(points)
    order = sorted(range(len(pts)), key=lambda i: (-pts[i][0], -pts[i][1]))
    front: list[int] = []
    best_y = -math.inf  # highest y among points with strictly larger x
    k = 0
    while k < len(order):
        x = pts[order[k]][0]
        top_y = pts[order[k]][1]  # the highest y at this x comes first
        j = k
        while j < len(order) and pts[order[j]][0] == x:
            if top_y > best_y and pts[order[j]][1] == top_y:
                front.append(order[j])
            j += 1
        best_y = max(best_y, top_y)
        k = j
    return sorted(front, key=lambda i: (pts[i][0], i))


def synergy_area(
    points: Sequence[Sequence[float]],
    expert1: Sequence[float],
    expert2: Sequence[float],
) -> float:
    """Signed area between the merged points' Pareto front and the diagonal.

    Let e1 = expert1 = (x1, y1) (the "all task-1" point) and e2 = expert2 =
    (x2, y2) (the "all task-2" point), with x1 > x2 and y2 > y1. The diagonal
    is the segment e1 -> e2, of length L = |e2 - e1|, with unit direction
    d = (e2 - e1) / L and unit normal n = (d_y, -d_x); both components of n
    are positive, so "above" (n . (p - e) > 0) means better on both tasks.
    Each point p of ``pareto_front(points)`` gets coordinates

        u_p = clip(d . (p - e1) / L, 0, 1)     position along the diagonal
        v_p = n . (p - e1)                     signed distance above it

    (clipping moves a point beyond an expert onto that end, keeping its
    height). The frontier is the piecewise-linear function g on [0, 1] through
    the knots (u_p, v_p), sorted by u; where several knots share a u, g takes
    the highest v (the upper envelope). The ends are the experts themselves,
    g(0) = 0 and g(1) = 0, unless some knot lies exactly there. Then

        synergy_area = L * integral_0^1 g(u) du        (trapezoid rule, exact)

    which is the Euclidean area between the frontier and the diagonal, counted
    positive above it and negative below: 0 when every merged point lies on
    the diagonal's line, > 0 when all lie on or above it and one strictly
    above, < 0 when all lie strictly below. It depends only on the set of
    points, not their order, and is in squared score units (for scores in
    [0, 1], 0.5 is the largest possible value with e1 = (1, 0), e2 = (0, 1)).

    Raises ValueError on no points, a non-finite or non-pair point, or experts
    that do not trade off (need x1 > x2 and y2 > y1).
    """
    pts = _check_points(points)
    if not pts:
        raise ValueError("points is empty: need at least one merged point")
    (x1, y1), (x2, y2) = _check_points([expert1, expert2], "experts")
    if not (x1 > x2 and y2 > y1):
        raise ValueError(
            "experts must trade off: expert1 better on task 1 (x1 > x2) and expert2 "
            f"better on task 2 (y2 > y1), got expert1={expert1!r}, expert2={expert2!r}"
        )
    length = math.hypot(x2 - x1, y2 - y1)
    dx, dy = (x2 - x1) / length, (y2 - y1) / length
    nx, ny = dy, -dx
    knots: dict[float, float] = {}
    for i in pareto_front(pts):
        px, py = pts[i][0] - x1, pts[i][1] - y1
        u = min(max((dx * px + dy * py) / length, 0.0), 1.0)
        v = nx * px + ny * py
        knots[u] = max(v, knots.get(u, -math.inf))
    knots.setdefault(0.0, 0.0)
    knots.setdefault(1.0, 0.0)
    us = sorted(knots)
    integral = math.fsum((b - a) * (knots[a] + knots[b]) / 2.0 for a, b in zip(us, us[1:]))
    return length * integral
