"""The metric group's composed metrics: groups, forgetting, similarity, and their config checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.metrics.composed import forgetting_of_merge, group_scores, similarity
from mergeval.run.checks import check_metric_config
from mergeval.run.config import MetricConfig, MetricGroup

acc = st.floats(0, 1)


def table(values: dict[str, dict[str, float]]) -> dict:
    return {
        t: {role: {"metric": "acc,none", "value": a, "stderr": 0.0, "n": 10} for role, a in roles.items()}
        for t, roles in values.items()
    }


@given(st.lists(acc, min_size=3, max_size=3))
def test_groups_with_equal_scales_weighted_by_tasks_equal_the_plain_mean(accs):
    scores = table({f"t{i}": {"merged": a} for i, a in enumerate(accs)})
    metric = MetricConfig(groups={"g1": MetricGroup(["t0", "t1"]), "g2": MetricGroup(["t2"])})
    assert group_scores(scores, ["merged"], metric)["merged"] == pytest.approx(sum(accs) / 3)


def test_cmm_overall_rescales_mol_instructions_and_weights_by_task_count():
    chem = {f"c{i}": 0.6141 for i in range(9)}
    mol = {"m0": 0.35, "m1": 0.35}
    scores = table({t: {"cmm": a} for t, a in {**chem, **mol}.items()})
    metric = MetricConfig(
        groups={"chembench": MetricGroup(list(chem), 100.0), "molinst": MetricGroup(list(mol), 100.0)}
    )
    # ChemBench scores here are fractions, so both groups are rescaled by 100: (9 * 61.41 + 2 * 35) / 11
    assert group_scores(scores, ["cmm"], metric)["cmm"] == pytest.approx((9 * 61.41 + 2 * 35) / 11)
    equal = MetricConfig(groups=metric.groups, weighting="equal")
    assert group_scores(scores, ["cmm"], equal)["cmm"] == pytest.approx((61.41 + 35) / 2)


def test_forgetting_is_the_drop_below_the_base():
    scores = table({"general": {"base": 0.8, "merged": 0.7}, "other": {"base": 0.1, "merged": 0.9}})
    out = forgetting_of_merge(scores, MetricConfig(forgetting_tasks=["general"]), "merged")
    assert out["mean"] == pytest.approx(0.1)
    assert forgetting_of_merge(scores, MetricConfig(), "merged") is None


def test_similarity_of_identical_task_vectors():
    base = {"model.layers.0.w": torch.zeros(4, 3)}
    a = {"model.layers.0.w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    out = similarity(base, {"a": a, "b": {k: 2 * v for k, v in a.items()}}, merged=a)
    assert out["a~b"]["overall"]["cosine"] == pytest.approx(1.0)
    assert out["a~merged"]["overall"]["sign_conflict"] == 0
    assert set(out) == {"a~b", "a~merged", "b~merged"}


@pytest.mark.parametrize(
    "metric,field",
    [
        (MetricConfig(groups={"g": MetricGroup(["nope"])}), "metric.groups.g.tasks"),
        (MetricConfig(groups={"g": MetricGroup([])}), "metric.groups.g.tasks"),
        (MetricConfig(weighting="median"), "metric.weighting"),
        (MetricConfig(groups={"g": MetricGroup(["t"])}, weighting="given"), "metric.weights"),
        (MetricConfig(forgetting_tasks=["nope"]), "metric.forgetting_tasks"),
        (MetricConfig(consistency=[["t", "t"]]), "metric.consistency"),
    ],
)
def test_bad_metric_configs(metric, field):
    with pytest.raises(UserError) as err:
        check_metric_config(metric, ["t"])
    assert err.value.field == field


def test_calibration_per_role_and_task():
    from mergeval.metrics.composed import calibration

    confident_right = [{"lls": [0.0, -30.0], "gold": 0}] * 5  # p = 1 on the right answer: ECE 0
    confident_wrong = [{"lls": [0.0, -30.0], "gold": 1}] * 5  # p = 1 on the wrong answer: ECE 1
    out = calibration({"a": {"t": confident_right}, "b": {"t": confident_wrong}, "old": None})
    assert out["a"]["t"] == pytest.approx(0.0, abs=1e-9)
    assert out["b"]["t"] == pytest.approx(1.0, abs=1e-9)
    assert out["old"] is None


def test_samples_round_trip(tmp_path):
    from mergeval.eval import samples

    rows = {"t1": [{"doc_id": 0, "lls": [-1.0, -2.0], "gold": 1}], "t2": [{"doc_id": 3, "lls": [-0.5], "gold": 0}]}
    path = samples.write(samples.path_for(tmp_path, "f" * 64, "s", {"t1": "d1", "t2": "d2"}), rows)
    assert samples.read(path) == rows
    assert samples.read(tmp_path / "missing.jsonl") is None and samples.read(None) is None


def test_constituents_decide_what_macro_gain_compares_against():
    """The CPT paper's first stage merges an expert with its own base: its constituents are base and expert."""
    from mergeval.core.errors import UserError
    from mergeval.core.outcome import ModelInfo
    from mergeval.run.checks import check_constituents
    from mergeval.run.summary import aggregate

    models = [ModelInfo("base", "b", "fb"), ModelInfo("fin", "f", "ff", task="t1"), ModelInfo("merged", "m", "fm")]
    scores = table({"t1": {"base": 0.2, "fin": 0.8, "merged": 0.7}, "t2": {"base": 0.6, "fin": 0.2, "merged": 0.5}})
    tasks = ["t1", "t2"]
    # merged avg 0.6; expert avg 0.5; base avg 0.4
    experts_only = aggregate(scores, tasks, models, MetricConfig())
    assert experts_only["constituents"] == ["fin"]
    assert experts_only["macro_gain"] == pytest.approx(10.0) and experts_only["macro_og"] == pytest.approx(10.0)
    both = aggregate(scores, tasks, models, MetricConfig(constituents="base_and_experts"))
    assert both["constituents"] == ["base", "fin"]
    assert both["macro_gain"] == pytest.approx(15.0) and both["macro_og"] == pytest.approx(10.0)
    listed = aggregate(scores, tasks, models, MetricConfig(constituents=["base"]))
    assert listed["macro_gain"] == pytest.approx(20.0)
    for bad in ("everyone", ["nobody"], []):
        with pytest.raises(UserError, match="metric.constituents"):
            check_constituents(bad, ["fin"])
