"""Property and example tests for mergeval.metrics: uncertainty, groups,
tradeoff, calibration and similarity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.metrics.calibration import (
    consistency,
    ece_from_loglikelihoods,
    expected_calibration_error,
)
from mergeval.metrics.groups import forgetting, group_mean
from mergeval.metrics.similarity import (
    layer_index,
    sar_rank,
    subspace_alignment_ratio,
    task_vector_stats,
)
from mergeval.metrics.tradeoff import pareto_front, synergy_area
from mergeval.metrics.uncertainty import (
    bootstrap_ci,
    bootstrap_stderr,
    mean_ci,
    wilson_interval,
)

SETTINGS = settings(max_examples=50, deadline=None)

unit = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, allow_infinity=False)
# a coarse grid makes ties and duplicates likely; fine floats cover the rest
coord = st.one_of(st.integers(0, 4).map(lambda k: k / 4), unit)
point = st.tuples(coord, coord)


# --- uncertainty ------------------------------------------------------------


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


# --- groups -----------------------------------------------------------------


@st.composite
def grouped_scores(draw):
    """(scores, groups): scores per task and a partition of the tasks into groups."""
    n = draw(st.integers(1, 12))
    tasks = [f"t{i}" for i in range(n)]
    values = draw(st.lists(unit, min_size=n, max_size=n))
    labels = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    groups: dict[str, list[str]] = {}
    for t, g in zip(tasks, labels):
        groups.setdefault(f"g{g}", []).append(t)
    return dict(zip(tasks, values)), groups


@SETTINGS
@given(grouped_scores(), st.randoms(use_true_random=False))
def test_group_mean_tasks_weighting_is_plain_mean_and_order_free(sg, rnd):
    scores, groups = sg
    plain = math.fsum(scores.values()) / len(scores)
    got = group_mean(scores, groups, scale={g: 1.0 for g in groups}, weighting="tasks")
    assert got == pytest.approx(plain, abs=1e-12)
    shuffled = {}
    for g in rnd.sample(list(groups), len(groups)):
        shuffled[g] = rnd.sample(groups[g], len(groups[g]))
    scores_shuffled = dict(rnd.sample(list(scores.items()), len(scores)))
    for weighting in ("tasks", "equal"):
        assert group_mean(scores_shuffled, shuffled, weighting=weighting) == group_mean(
            scores, groups, weighting=weighting
        )


def test_group_mean_hand_examples():
    scores = {"a1": 1.0, "a2": 1.0, "a3": 1.0, "b1": 0.0}
    groups = {"A": ["a1", "a2", "a3"], "B": ["b1"]}
    assert group_mean(scores, groups, weighting="tasks") == 0.75
    assert group_mean(scores, groups, weighting="equal") == 0.5
    assert group_mean(scores, groups, weighting="given", weights={"A": 1.0, "B": 3.0}) == 0.25
    # CMM-style: ChemBench on 0-100, Mol-Instructions on 0-1 rescaled by 100
    scores = {"chem_nc": 50.0, "chem_rs": 70.0, "mol_rt": 0.35}
    groups = {"chembench": ["chem_nc", "chem_rs"], "molinst": ["mol_rt"]}
    scale = {"molinst": 100.0}
    assert group_mean(scores, groups, scale) == pytest.approx((50 + 70 + 35) / 3)
    assert group_mean(scores, groups, scale, weighting="equal") == pytest.approx((60 + 35) / 2)


def test_group_mean_rejects_bad_input():
    scores = {"a": 1.0, "b": 0.0}
    with pytest.raises(ValueError, match="no score"):
        group_mean(scores, {"G": ["a", "c"]})
    with pytest.raises(ValueError, match="both group"):
        group_mean(scores, {"G": ["a"], "H": ["a", "b"]})
    with pytest.raises(ValueError, match="weighting"):
        group_mean(scores, {"G": ["a"]}, weighting="median")
    with pytest.raises(ValueError, match="given"):
        group_mean(scores, {"G": ["a"]}, weighting="given")
    with pytest.raises(ValueError, match="scale"):
        group_mean(scores, {"G": ["a"]}, scale={"H": 2.0})
    with pytest.raises(ValueError, match="no tasks"):
        group_mean(scores, {"G": []})


def test_forgetting_hand_example():
    out = forgetting({"mmlu": 0.60, "arc": 0.50}, {"mmlu": 0.55, "arc": 0.52})
    assert out["per_task"] == pytest.approx({"mmlu": 0.05, "arc": -0.02})
    assert out["mean"] == pytest.approx(0.015)
    with pytest.raises(ValueError):
        forgetting({"mmlu": 0.6}, {"arc": 0.5})


# --- tradeoff ---------------------------------------------------------------


def _dominates(q, p) -> bool:
    return q[0] >= p[0] and q[1] >= p[1] and (q[0] > p[0] or q[1] > p[1])


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


# --- calibration ------------------------------------------------------------


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


# --- similarity -------------------------------------------------------------

NAMES = {
    "model.embed_tokens.weight": (6, 4),
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.mlp.up_proj.weight": (5, 4),
    "model.layers.1.input_layernorm.weight": (4,),
    "model.layers.1.mlp.down_proj.weight": (4, 5),
    "model.norm.weight": (4,),
}


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g, dtype=torch.float64) for n, shape in NAMES.items()}


def _negate_task_vector(base, a):
    return {n: base[n] - (a[n] - base[n]) for n in base}


def _all_stats(out):
    return [*out["per_tensor"].values(), *out["by_layer"].values(), out["overall"]]


@SETTINGS
@given(st.integers(0, 2**31 - 1))
def test_task_vector_with_itself_and_its_negation(seed):
    base, a = _model(seed), _model(seed + 1)
    same = task_vector_stats(base, a, a)
    for s in _all_stats(same):
        assert s["cosine"] == pytest.approx(1.0)
        assert s["sign_conflict"] == 0.0
        assert s["l2"] == 0.0
        if s["sar_a_in_b"] is not None:
            assert math.sqrt(1 - 0.05**2) - 1e-12 <= s["sar_a_in_b"] <= 1.0
    neg = task_vector_stats(base, a, _negate_task_vector(base, a))
    for s in _all_stats(neg):
        assert s["cosine"] == pytest.approx(-1.0)
        assert s["sign_conflict"] == 1.0
        assert s["l2"] == pytest.approx(2 * s["norm_a"])


@SETTINGS
@given(st.integers(0, 2**31 - 1))
def test_task_vector_stats_ranges_and_grouping(seed):
    base, a, b = _model(seed), _model(seed + 1), _model(seed + 2)
    out = task_vector_stats(base, a, b)
    assert set(out["by_layer"]) == {0, 1}
    assert out["by_layer"][0]["numel"] == 16 + 20
    assert out["overall"]["numel"] == sum(math.prod(s) for s in NAMES.values())
    assert out["per_tensor"]["model.norm.weight"]["sar_a_in_b"] is None
    assert out["per_tensor"]["model.layers.1.mlp.down_proj.weight"]["layer"] == 1
    for s in _all_stats(out):
        assert -1.0 <= s["cosine"] <= 1.0
        assert 0.0 <= s["sign_conflict"] <= s["sign_conflict_nonzero"] <= 1.0
        for key in ("sar_a_in_b", "sar_b_in_a"):
            assert s[key] is None or 0.0 <= s[key] <= 1.0
    # layer 1 pools its two tensors' SARs: only the matrix has one
    assert out["by_layer"][1]["sar_a_in_b"] == out["per_tensor"]["model.layers.1.mlp.down_proj.weight"]["sar_a_in_b"]


def test_task_vector_stats_hand_example():
    base = {"layers.0.w": torch.zeros(2, 2)}
    a = {"layers.0.w": torch.tensor([[1.0, 0.0], [2.0, 0.0]])}
    b = {"layers.0.w": torch.tensor([[1.0, 1.0], [-2.0, 0.0]])}
    s = task_vector_stats(base, a, b)["per_tensor"]["layers.0.w"]
    # dot = 1 - 4 = -3; |a| = sqrt 5; |b| = sqrt 6
    assert s["cosine"] == pytest.approx(-3 / math.sqrt(30))
    assert s["l2"] == pytest.approx(math.sqrt(0 + 1 + 16 + 0))
    assert s["sign_conflict"] == 0.25  # one of four entries
    assert s["sign_conflict_nonzero"] == 0.5  # one of the two non-zero in both
    assert s["layer"] == 0
    with pytest.raises(ValueError, match="same tensors"):
        task_vector_stats(base, a, {"layers.1.w": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="shapes"):
        task_vector_stats(base, a, {"layers.0.w": torch.zeros(2, 3)})


def test_layer_index():
    assert layer_index("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_index("layers.3.attn.weight") == 3
    assert layer_index("lm_head.weight") is None
    assert layer_index("model.sublayers.2.weight") is None


def test_sar_rank_hand_examples():
    # tail energy after k=1: 0.01 / 9.01 = 0.0011 <= 0.05^2 = 0.0025
    assert sar_rank(torch.tensor([3.0, 0.1])) == 1
    # 1 / 10 = 0.1 > 0.0025, so both directions are needed
    assert sar_rank(torch.tensor([3.0, 1.0])) == 2
    assert sar_rank(torch.tensor([0.0, 0.0])) == 0
    assert sar_rank(torch.tensor([2.0, 1.0]), eps=1.0) == 0  # k=0 keeps no energy: 5/5 <= 1
    assert sar_rank(torch.tensor([2.0, 1.0]), eps=0.0) == 2


def test_sar_hand_examples():
    eye = torch.eye(2)
    # Delta_M = diag(3, 0.1): k_M = 1, projection onto e1 keeps 1 of eye's 2 units of energy
    assert subspace_alignment_ratio(eye, torch.diag(torch.tensor([3.0, 0.1]))) == pytest.approx(1 / math.sqrt(2))
    # Delta_M = diag(3, 1): k_M = 2, full space
    assert subspace_alignment_ratio(eye, torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx(1.0)
    # orthogonal column spaces
    t = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    m = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    assert subspace_alignment_ratio(t, m) == pytest.approx(0.0)
    assert subspace_alignment_ratio(torch.zeros(2, 2), m) is None
    assert subspace_alignment_ratio(t, torch.zeros(2, 2)) == 0.0
    with pytest.raises(ValueError, match="matrices"):
        subspace_alignment_ratio(torch.ones(3), torch.ones(3))


@SETTINGS
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 6),
    st.integers(1, 6),
    st.floats(0.1, 10.0),
    st.floats(-10.0, -0.1),
)
def test_sar_properties(seed, rows, cols, c, d):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    m = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    sar = subspace_alignment_ratio(t, m)
    assert 0.0 <= sar <= 1.0
    # the maximal value 1 for a rank-1 matrix with itself, >= sqrt(1 - eps^2) in general
    r1 = torch.outer(t[:, 0], m[0])
    assert subspace_alignment_ratio(r1, r1) == pytest.approx(1.0)
    assert subspace_alignment_ratio(t, t) >= math.sqrt(1 - 0.05**2) - 1e-12
    # invariant to rescaling either argument (the sign of Delta_M does not matter)
    assert subspace_alignment_ratio(c * t, d * m) == pytest.approx(sar, abs=1e-9)


def _sar_by_svd(t: torch.Tensor, m: torch.Tensor, eps: float = 0.05) -> float | None:
    """SAR from its definition, with torch's SVD (what subspace_alignment_ratio computed before the Gram route)."""
    t, m = t.double().reshape(t.shape[0], -1), m.double().reshape(m.shape[0], -1)
    if torch.linalg.matrix_norm(t) == 0:
        return None
    u, s, _ = torch.linalg.svd(m, full_matrices=False)
    k = sar_rank(s, eps)
    return (
        0.0
        if k == 0
        else min(float(torch.linalg.matrix_norm(u[:, :k] @ (u[:, :k].T @ t)) / torch.linalg.matrix_norm(t)), 1.0)
    )


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    rank=st.integers(0, 40),
    seed=st.integers(0, 10_000),
    eps=st.sampled_from([0.01, 0.05, 0.3]),
)  # eps = 0 counts singular values at rounding level: no route's k is stable
def test_sar_from_the_gram_matrix_equals_sar_from_the_svd(rows, cols, rank, seed, eps):
    """dominant_basis (the eigendecomposition of the smaller Gram matrix) spans the subspace of the SVD's top
    singular vectors: SAR agrees with the definition on tall, wide, rank-deficient and zero matrices."""
    g = torch.Generator().manual_seed(seed)
    r = min(rank, rows, cols)
    m = torch.randn(rows, r, generator=g, dtype=torch.float64) @ torch.randn(r, cols, generator=g, dtype=torch.float64)
    t = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    for a, b in ((t, m), (m, t), (m, m)):
        want, got = _sar_by_svd(a, b, eps), subspace_alignment_ratio(a, b, eps)
        assert (want is None) == (got is None)
        if want is not None:
            assert got == pytest.approx(want, abs=1e-9)


def test_the_pairs_of_several_models_in_one_pass_equal_each_pair_alone():
    from mergeval.metrics.similarity import pairwise_stats

    g = torch.Generator().manual_seed(0)
    shapes = {"layers.0.w": (6, 4), "layers.0.b": (4,), "layers.1.w": (3, 5), "emb": (7, 2)}
    base = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    models = {k: {n: t + torch.randn(t.shape, generator=g) for n, t in base.items()} for k in ("x", "y", "z")}
    pairs = [("x", "y"), ("x", "z"), ("y", "z")]
    together = pairwise_stats(base, models, pairs)
    for a, b in pairs:
        assert together[f"{a}~{b}"] == task_vector_stats(base, models[a], models[b])
