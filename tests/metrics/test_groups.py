"""mergeval/metrics/groups.py: group means and forgetting (hypothesis invariants and hand-worked values)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.metrics.groups import forgetting, group_mean
from tests.strategies import unit

SETTINGS = settings(max_examples=50, deadline=None)


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


def test_group_mean_with_given_weights_and_scales():
    scores = {"a": 0.5, "b": 0.7, "c": 30.0}
    groups = {"small": ["a", "b"], "big": ["c"]}
    # small rescaled by 100: mean 60; big: 30; weights 1 and 2 -> (60 + 60) / 3
    got = group_mean(scores, groups, {"small": 100.0}, "given", {"small": 1.0, "big": 2.0})
    assert got == pytest.approx(40.0)
    assert group_mean(scores, groups, {"small": 100.0}, "equal") == pytest.approx(45.0)
    assert group_mean(scores, groups, {"small": 100.0}) == pytest.approx((50 + 70 + 30) / 3)  # by task count


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
