"""CMM (curriculum merging) and multi-stage pipelines: formulas, invariants, and config errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.methods import METHODS, get_method
from mergeval.methods.curriculum import CmmConfig, merge_order, schedule
from mergeval.methods.draws import Draws
from mergeval.methods.pipeline import PipelineConfig, StageConfig
from mergeval.methods.task_vector import TaskArithmeticConfig, TiesConfig
from mergeval.run.ranking import near_ties, score_stderr
from tests.strategies import merge, t

GEN = Draws(0, "w")
cmm = get_method("cmm")
pipeline = get_method("pipeline")
ta = get_method("task_arithmetic")
ties = get_method("ties")


def tensors(seed: int, n: int, shape=(6, 5)):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    return base, [base + torch.randn(shape, generator=g) for _ in range(n)]


coef = st.floats(0.05, 2.0)


@given(st.sampled_from(["constant", "linear", "exponential"]), coef, coef, st.integers(1, 8))
def test_schedule_endpoints_and_monotone(kind, start, end, n):
    c = schedule(kind, start, end, n)
    assert len(c) == n and math.isclose(c[0], start)
    if kind != "constant" and n > 1:
        assert math.isclose(c[-1], end, rel_tol=1e-9)
        diffs = [b - a for a, b in zip(c, c[1:])]
        assert all(d >= -1e-12 for d in diffs) or all(d <= 1e-12 for d in diffs)
    if kind == "exponential" and n > 2:  # geometric: constant ratio between steps
        assert math.isclose(c[1] / c[0], c[2] / c[1], rel_tol=1e-9)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=7))
def test_merge_order(scores):
    n = len(scores)
    ranked = merge_order("ranked", scores, n)
    assert sorted(ranked) == list(range(n))
    assert [scores[i] for i in ranked] == sorted(scores)  # weakest first
    assert [scores[i] for i in merge_order("reverse", scores, n)] == sorted(scores, reverse=True)
    assert merge_order("given", None, n) == list(range(n))


def test_ties_in_scores_keep_modelset_order():
    assert merge_order("ranked", [0.5, 0.2, 0.5], 3) == [1, 0, 2]
    assert merge_order("reverse", [0.5, 0.2, 0.5], 3) == [0, 2, 1]


@settings(max_examples=30)
@given(st.integers(0, 10_000), st.integers(1, 4), st.floats(0.1, 1.0), st.floats(-1, 2))
def test_constant_additive_cmm_is_task_arithmetic(seed, n, c, lam):
    base, experts = tensors(seed, n)
    cfg = CmmConfig(order="given", schedule="constant", start=c, lambda_=lam, update="additive")
    expected = ta.merge(base, experts, TaskArithmeticConfig(lambda_=lam * c), GEN)
    torch.testing.assert_close(cmm.merge(base, experts, cfg, GEN), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=30)
@given(st.integers(0, 10_000), st.integers(1, 4), st.sampled_from(["additive", "interpolate", "ties_step"]))
def test_lambda_zero_and_identical_models_return_base(seed, n, update):
    base, experts = tensors(seed, n)
    cfg = CmmConfig(order="given", update=update, lambda_=0.0)
    torch.testing.assert_close(cmm.merge(base, experts, cfg, GEN), base)
    cfg = CmmConfig(order="given", update=update)
    torch.testing.assert_close(cmm.merge(base, [base.clone() for _ in experts], cfg, GEN), base)


def test_one_expert_with_coefficient_one_returns_it():
    base, [e] = tensors(1, 1)
    for update in ("additive", "interpolate"):
        cfg = CmmConfig(order="given", schedule="constant", start=1.0, update=update)
        torch.testing.assert_close(cmm.merge(base, [e], cfg, GEN), e)


def test_interpolate_ends_at_the_last_expert_when_its_coefficient_is_one():
    base, experts = tensors(2, 3)
    cfg = CmmConfig(order="given", schedule="linear", start=0.3, end=1.0, update="interpolate")
    torch.testing.assert_close(cmm.merge(base, experts, cfg, GEN), experts[-1])


@settings(max_examples=30)
@given(st.integers(0, 10_000), st.sampled_from(["additive", "interpolate"]))
def test_cmm_depends_on_the_order(seed, update):
    base, experts = tensors(seed, 3)
    scores = [0.2, 0.5, 0.9]
    up = cmm.merge(base, experts, CmmConfig(order="ranked", validation_scores=scores, update=update), GEN)
    down = cmm.merge(base, experts, CmmConfig(order="reverse", validation_scores=scores, update=update), GEN)
    assert not torch.allclose(up, down)
    # ranked by these scores is the given order here
    torch.testing.assert_close(up, cmm.merge(base, experts, CmmConfig(order="given", update=update), GEN))


def test_additive_linear_formula_by_hand():
    base, experts = tensors(3, 3)
    cfg = CmmConfig(
        order="ranked", validation_scores=[0.9, 0.1, 0.5], start=0.3, end=0.6, lambda_=0.8, update="additive"
    )
    d = [e - base for e in experts]
    expected = base + 0.8 * (0.3 * d[1] + 0.45 * d[2] + 0.6 * d[0])  # weakest (1) first, strongest (0) last
    torch.testing.assert_close(cmm.merge(base, experts, cfg, GEN), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "field,value,fix",
    [
        ("order", "random", "order"),
        ("schedule", "cosine", "schedule"),
        ("update", "ema", "update"),
        ("validation_scores", [0.1], "validation_scores"),
        ("validation_items", 0, "validation_items"),
    ],
)
def test_cmm_bad_config(field, value, fix):
    with pytest.raises(UserError) as err:
        cmm.validate(CmmConfig(**{field: value}), 2)
    assert err.value.field == f"method.{fix}"


def test_exponential_needs_positive_coefficients():
    with pytest.raises(UserError):
        cmm.validate(CmmConfig(schedule="exponential", start=0.0), 2)


def stage(stage_name, base, inputs, **method):
    return StageConfig(name=stage_name, base=base, inputs=inputs, method=method)


def test_single_stage_pipeline_equals_its_method():
    base, experts = tensors(4, 2)
    cfg = PipelineConfig(stages=[stage("m", "base", ["a", "b"], name="ties", density=0.4)], expert_names=["a", "b"])
    pipeline.validate(cfg, 2)
    torch.testing.assert_close(
        pipeline.merge(base, experts, cfg, GEN), ties.merge(base, experts, TiesConfig(density=0.4), GEN)
    )


def test_two_stage_pipeline_composes():
    base, (a, b) = tensors(5, 2)
    cfg = PipelineConfig(
        stages=[
            stage("half", "base", ["a"], name="task_arithmetic", lambda_=0.5),
            stage("final", "half", ["b"], name="linear"),
        ],
        expert_names=["a", "b"],
    )
    pipeline.validate(cfg, 2)
    half = base + 0.5 * (a - base)
    torch.testing.assert_close(pipeline.merge(base, [a, b], cfg, GEN), b)  # linear of one model = that model
    cfg.stages[1] = stage("final", "half", ["b"], name="task_arithmetic", lambda_=0.3)
    torch.testing.assert_close(pipeline.merge(base, [a, b], cfg, GEN), half + 0.3 * (b - half))


def test_random_stages_are_deterministic():
    base, experts = tensors(6, 2)
    cfg = PipelineConfig(
        stages=[stage("d", "base", ["a", "b"], name="dare_ties", density=0.5)], expert_names=["a", "b"]
    )
    out = [pipeline.merge(base, experts, cfg, Draws(7, "w")) for _ in range(2)]
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize(
    "stages,field",
    [
        ([], "method.stages"),
        ([stage("x", "base", ["nope"], name="linear")], "method.stages[0]"),
        ([stage("a", "base", ["b"], name="linear")], "method.stages[0].name"),
        ([stage("x", "base", [], name="linear")], "method.stages[0].inputs"),
        ([stage("x", "base", ["a"], name="nosuch")], "method.stages[0].method.name"),
        ([stage("x", "base", ["a"], name="ties", density=2.0)], "method.density"),
        ([stage("x", "base", ["a"], name="ties", densty=0.5)], "method.stages[0].method.densty"),
        ([stage("x", "base", ["a"], name="cmm")], "method.stages[0].method.validation_scores"),
        ([stage("x", "base", ["a", "b"], name="localize_stitch")], "method.stages[0].method.scope"),
        ([stage("x", "base", ["a"], name="linear"), stage("y", "base", ["b"], name="linear")], "method.stages"),
        (
            [stage("x", "base", ["a"], name="ties", rules=[{"match": "*", "density": 0.3}])],
            "method.stages[0].method.rules",
        ),
    ],
)
def test_pipeline_bad_config(stages, field):
    with pytest.raises(UserError) as err:
        pipeline.validate(PipelineConfig(stages=stages, expert_names=["a", "b"]), 2)
    assert err.value.field == field


def test_a_stage_whose_method_still_needs_measuring_is_refused_by_its_declared_needs():
    """A stage merges values computed per tensor: what its method declared it needs from whole models
    (CMM's ranking, localize_stitch's whole-model cuts) is refused unless the stage's config gives it,
    the fix naming the stage's own fields."""

    def validate(one: StageConfig) -> None:
        pipeline.validate(PipelineConfig(stages=[one], expert_names=["a", "b"]), 2)

    with pytest.raises(UserError) as err:
        validate(stage("x", "base", ["a", "b"], name="cmm"))
    assert err.value.problem == "cmm in a pipeline cannot rank by evaluation"
    assert err.value.fix == (
        "give method.stages[0].method.validation_scores or set method.stages[0].method.order=given"
    )
    with pytest.raises(UserError) as err:
        validate(stage("x", "base", ["a", "b"], name="localize_stitch"))
    assert err.value.fix == "set method.stages[0].method.scope=tensor"
    validate(stage("x", "base", ["a", "b"], name="cmm", validation_scores=[0.2, 0.1]))
    validate(stage("x", "base", ["a", "b"], name="cmm", order="given"))
    validate(stage("x", "base", ["a", "b"], name="localize_stitch", scope="tensor"))
    validate(stage("x", "base", ["a", "b"], name="localize_stitch", thresholds=[0.1, 0.2]))


@settings(max_examples=30)
@given(st.integers(0, 10_000), st.integers(2, 5), st.floats(0.1, 1.5))
def test_additive_is_task_arithmetic_with_each_experts_step_coefficient(seed, n, lam):
    """update=additive is exactly task arithmetic with weights c_rank(i): nothing a same-weight baseline lacks."""
    base, experts = tensors(seed, n)
    scores = [float(x) for x in torch.rand(n, generator=torch.Generator().manual_seed(seed))]
    cfg = CmmConfig(order="ranked", validation_scores=scores, lambda_=lam, update="additive")
    coeffs = schedule("linear", 0.3, 0.6, n)
    weights = [0.0] * n
    for c, i in zip(coeffs, merge_order("ranked", scores, n)):
        weights[i] = c
    expected = ta.merge(base, experts, TaskArithmeticConfig(lambda_=lam, weights=weights), GEN)
    torch.testing.assert_close(cmm.merge(base, experts, cfg, GEN), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=30)
@given(st.integers(0, 10_000), st.integers(2, 5))
def test_the_default_reading_is_not_same_weight_task_arithmetic(seed, n):
    """The discussion's fairness answer: TA ran with CMM's weights and lost, so CMM's rule cannot be TA."""
    base, experts = tensors(seed, n)
    cfg = CmmConfig(order="given")
    assert cfg.update == "interpolate"
    weights = schedule("linear", 0.3, 0.6, n)
    same_weights = ta.merge(base, experts, TaskArithmeticConfig(weights=weights), GEN)
    assert not torch.allclose(cmm.merge(base, experts, cfg, GEN), same_weights, atol=1e-3)


@settings(max_examples=30)
@given(st.integers(0, 10_000), st.integers(3, 5))
def test_only_sequential_readings_depend_on_the_order_once_each_expert_has_its_weight(seed, n):
    """With one coefficient for every step, each expert's weight is fixed whatever the order: additive gives the
    same model for any order, the sequential readings do not (the paper's reversed order loses 15 points).
    (ties_step needs three experts: with two and equal weights its disjoint mean is symmetric.)"""
    base, experts = tensors(seed, n)
    scores = list(range(n))
    for update, sensitive in (("additive", False), ("interpolate", True), ("ties_step", True)):
        up, down = (
            cmm.merge(
                base,
                experts,
                CmmConfig(order=order, validation_scores=scores, schedule="constant", start=0.5, update=update),
                GEN,
            )
            for order in ("ranked", "reverse")
        )
        assert torch.allclose(up, down, atol=1e-5) is not sensitive, update


def test_an_earlier_experts_alignment_falls_as_later_experts_merge():
    """The discussion's SAR table: an expert merged early aligns less with the merge after each later step."""
    from mergeval.metrics.similarity import subspace_alignment_ratio

    g = torch.Generator().manual_seed(7)
    base = torch.randn(24, 24, generator=g)
    # low-rank task vectors, as fine-tunes have: each lives in its own 3-dimensional column space
    experts = [base + torch.randn(24, 3, generator=g) @ torch.randn(3, 24, generator=g) for _ in range(4)]
    sar = []
    for k in range(1, 5):
        merged = cmm.merge(base, experts[:k], CmmConfig(order="given"), GEN)
        sar.append(subspace_alignment_ratio(experts[0] - base, merged - base))
    assert sar[0] == pytest.approx(1.0, abs=1e-4)
    assert all(later <= earlier + 1e-6 for earlier, later in zip(sar, sar[1:])) and sar[-1] < sar[0], sar


# ---------------------------------------------------------------- near ties in the validation ranking


def test_score_stderr_of_the_mean_and_of_the_own_task():
    assert score_stderr({"a": 0.3, "b": 0.4}, "mean", None) == pytest.approx(0.25)  # sqrt(0.09 + 0.16) / 2
    assert score_stderr({"a": 0.3, "b": 0.4}, "own_task", "b") == 0.4
    assert score_stderr({"a": 0.3, "b": None}, "mean", None) is None


def test_near_ties_are_neighbours_closer_than_one_combined_stderr():
    # ranked: c 0.20, a 0.50, b 0.53, d 0.90; se 0.03 each -> a/b 0.03 apart = 0.71 combined se
    got = near_ties(["a", "b", "c", "d"], [0.50, 0.53, 0.20, 0.90], [0.03] * 4)
    assert [t["experts"] for t in got] == [["a", "b"]]
    assert got[0]["scores"] == [0.50, 0.53] and got[0]["gap_in_stderrs"] == pytest.approx(0.03 / (0.03 * 2**0.5))
    assert near_ties(["a", "b"], [0.5, 0.5], [0.0, 0.0]) == [
        {"experts": ["a", "b"], "scores": [0.5, 0.5], "gap_in_stderrs": None}
    ]  # an exact tie
    assert near_ties(["a", "b"], [0.5, 0.6], [0.0, 0.0]) == []
    assert near_ties(["a", "b"], [0.5, 0.5], [None, 0.1]) == []  # no stderr: not judged


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 0.2)), min_size=1, max_size=6))
def test_near_ties_follow_the_merge_order_and_each_gap_is_under_one_stderr(experts):
    names = [f"e{i}" for i in range(len(experts))]
    scores, ses = [s for s, _ in experts], [se for _, se in experts]
    order = [names[i] for i in merge_order("ranked", scores, len(names))]
    for tie in near_ties(names, scores, ses):
        a, b = tie["experts"]
        assert order.index(b) == order.index(a) + 1  # neighbours in the curriculum, weakest first
        if tie["gap_in_stderrs"] is not None:
            assert 0 <= tie["gap_in_stderrs"] < 1


def test_cmm_schedules_by_hand():
    assert schedule("linear", 0.3, 0.6, 3) == pytest.approx([0.3, 0.45, 0.6])
    assert schedule("linear", 0.3, 0.6, 1) == pytest.approx([0.3])
    assert schedule("exponential", 0.2, 0.8, 3) == pytest.approx([0.2, 0.4, 0.8])
    assert schedule("constant", 0.4, 0.9, 2) == pytest.approx([0.4, 0.4])


def test_cmm_interpolate_steps_by_hand():
    # coefficients 0.5, 0.5 in the given order: theta_1 = 0.5 * 1 = 0.5; theta_2 = 0.5 * 0.5 + 0.5 * 2 = 1.25
    out = merge("cmm", t(0.0), [t(1.0), t(2.0)], order="given", schedule="constant", start=0.5, end=0.5)
    assert out.item() == pytest.approx(1.25)
    # lambda scales theta_N - b: 2 * 1.25; ranked by the scores, expert 1 (0.2) first: 0.5 * 2 = 1, 0.5 + 0.5 = 1
    out = merge(
        "cmm",
        t(0.0),
        [t(1.0), t(2.0)],
        order="ranked",
        validation_scores=[0.9, 0.2],
        schedule="constant",
        start=0.5,
        end=0.5,
        lambda_=2.0,
    )
    assert out.item() == pytest.approx(2.0)


def test_cmm_ties_step_weights_the_model_so_far_by_one_minus_c():
    # step 1 (c = 0.25): TIES of [b, e1] with weights [0.75, 0.25]: only e1 moves: 0.25 * 4 / 0.25 = 4
    # step 2 (c = 0.75): deltas 4 (weight 0.25) and 8 (weight 0.75): (1 + 6) / 1 = 7
    out = merge(
        "cmm",
        t(0.0),
        [t(4.0), t(8.0)],
        order="given",
        update="ties_step",
        schedule="linear",
        start=0.25,
        end=0.75,
        density=1.0,
    )
    assert out.item() == pytest.approx(7.0)


def test_a_pipeline_stage_merges_around_its_own_base():
    # half = 0 + 0.5 * (2 - 0) = 1; final around half: 1 + 0.5 * (4 - 1) = 2.5 (around the modelset's base: 2)
    stages = [
        StageConfig(name="half", base="base", inputs=["a"], method={"name": "task_arithmetic", "lambda_": 0.5}),
        StageConfig(name="final", base="half", inputs=["c"], method={"name": "task_arithmetic", "lambda_": 0.5}),
    ]
    cfg = PipelineConfig(stages=stages, expert_names=["a", "c"])
    METHODS["pipeline"].validate(cfg, 2)
    assert METHODS["pipeline"].merge(t(0.0), [t(2.0), t(4.0)], cfg, Draws(0, "w")).item() == pytest.approx(2.5)
