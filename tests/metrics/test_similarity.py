"""mergeval/metrics/similarity.py: task vector statistics and the subspace alignment ratio (hypothesis
invariants and hand-worked values)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.metrics.similarity import (
    layer_index,
    sar_rank,
    subspace_alignment_ratio,
    task_vector_stats,
)

SETTINGS = settings(max_examples=50, deadline=None)


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
