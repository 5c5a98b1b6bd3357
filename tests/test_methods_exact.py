"""Hand-worked merges at the points where a plausible slip changes the result.

Weights that do not sum to the number of models (linear, task arithmetic, TIES' disjoint mean), a tie at
the trim cut, slerp off the midpoint (where swapping its coefficients shows), Model Stock with three
experts, DELLA's per-entry rescale, the hierarchical method's non-layer tensors, CMM's steps, and a pipeline
stage on its own base. Every expected value is worked out in the comments, not by calling the method.
"""

from __future__ import annotations

import math

import pytest
import torch

from mergeval.methods import METHODS
from mergeval.methods.curriculum import schedule
from mergeval.methods.draws import Draws
from mergeval.methods.hierarchical import HierarchicalConfig, hierarchical_tensor
from mergeval.methods.pipeline import PipelineConfig, StageConfig
from mergeval.methods.sparsify import dare_drop, della_keep_prob, della_magprune
from mergeval.methods.task_vector import kept_count, trim_to_density


def merge(name: str, base, experts, seed: int = 0, **params):
    method = METHODS[name]
    cfg = method.config(**params)
    method.validate(cfg, len(experts))
    return method.merge(base, experts, cfg, Draws(seed, "w"))


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# ---------------------------------------------------------------- linear, task arithmetic, TIES


def test_linear_divides_by_the_sum_of_the_weights():
    a, b = t(1.0), t(4.0)
    assert merge("linear", t(0.0), [a, b], weights=[1.0, 3.0]).item() == pytest.approx((1 + 12) / 4)
    assert merge("linear", t(0.0), [a, b], weights=[1.0, 3.0], normalize=False).item() == pytest.approx(13.0)
    # include_base: the base is the first of three models, (2*10 + 1 + 4) / 4
    assert merge("linear", t(10.0), [a, b], weights=[2.0, 1.0, 1.0], include_base=True).item() == pytest.approx(6.25)
    assert merge("linear", t(10.0), [a, b]).item() == pytest.approx(2.5)  # the base stays out by default


def test_task_arithmetic_with_weights_and_lambda():
    # 1 + 0.5 * (2 * (2 - 1) + 0.5 * (4 - 1)) = 1 + 0.5 * 3.5
    assert merge("task_arithmetic", t(1.0), [t(2.0), t(4.0)], weights=[2.0, 0.5], lambda_=0.5).item() == pytest.approx(
        2.75
    )


def test_ties_disjoint_mean_is_weighted_by_the_agreeing_weights():
    # deltas 2, 4, -1: sum 5 elects +; a and b agree: (1*2 + 3*4) / (1 + 3) = 3.5 (not 14 / 2 agreeing experts)
    out = merge("ties", t(0.0), [t(2.0), t(4.0), t(-1.0)], density=1.0, weights=[1.0, 3.0, 1.0])
    assert out.item() == pytest.approx(3.5)
    out = merge("ties", t(0.0), [t(2.0), t(4.0), t(-1.0)], density=1.0, weights=[1.0, 3.0, 1.0], lambda_=2.0)
    assert out.item() == pytest.approx(7.0)


def test_ties_count_rule_votes_by_experts_not_mass():
    # deltas 1, 1, -5: the sum elects -, the count elects + (two against one)
    experts = [t(1.0), t(1.0), t(-5.0)]
    assert merge("ties", t(0.0), experts, density=1.0).item() == pytest.approx(-5.0)
    assert merge("ties", t(0.0), experts, density=1.0, sign_rule="count").item() == pytest.approx(1.0)


def test_trim_keeps_exactly_k_entries_when_magnitudes_tie_at_the_cut():
    delta = t(3.0, -3.0, 3.0, 1.0)
    kept = trim_to_density(delta, 0.5)  # k = 2 of the three entries of magnitude 3; never all three, never the 1
    assert int((kept != 0).sum()) == 2 and kept[3] == 0
    assert set(kept[kept != 0].abs().tolist()) == {3.0}
    assert [kept_count(d, 5) for d in (0.5, 0.2, 0.21, 1.0)] == [3, 1, 2, 5]  # ceil(2.5), 1, ceil(1.05), 5


def test_ties_with_an_expert_equal_to_the_base():
    # the zero delta neither votes nor dilutes the mean: (4 + 2) / 2
    out = merge("ties", t(1.0, 1.0), [t(1.0, 1.0), t(5.0, 1.0), t(3.0, 1.0)], density=1.0)
    torch.testing.assert_close(out, t(4.0, 1.0))


# ---------------------------------------------------------------- DARE, DELLA


def test_dare_keeps_each_entry_whole_or_drops_it_then_divides_by_density():
    delta = torch.linspace(-1.0, 1.0, 64)
    out = dare_drop(delta, 0.25, "inverse_density", Draws(3, "w"), 0)
    kept = out != 0
    assert 0 < int(kept.sum()) < 64
    torch.testing.assert_close(out[kept], delta[kept] * 4.0)
    l1 = dare_drop(delta, 0.25, "l1", Draws(3, "w"), 0)
    assert torch.equal(l1 != 0, kept)  # the same draws
    assert l1.abs().sum().item() == pytest.approx(delta.abs().sum().item(), rel=1e-5)


def test_della_keep_probabilities_and_rescale_by_hand():
    delta = t(5.0, 1.0, 3.0, 2.0, 4.0)
    # ranks 4 0 2 1 3 of 4: p = 0.3 + 0.4 * r / 4
    torch.testing.assert_close(della_keep_prob(delta, 0.5, 0.2), t(0.7, 0.3, 0.5, 0.4, 0.6))
    # equal magnitudes rank by position
    torch.testing.assert_close(della_keep_prob(t(1.0, -1.0, 2.0), 0.5, 0.1), t(0.4, 0.5, 0.6))
    # rows: each row ranked on its own
    rows = della_keep_prob(torch.tensor([[1.0, 2.0], [4.0, 3.0]]), 0.5, 0.1, "row")
    torch.testing.assert_close(rows, torch.tensor([[0.4, 0.6], [0.6, 0.4]]))
    out = della_magprune(delta, 0.5, 0.2, "inverse_prob", Draws(5, "w"), 0)
    p = t(0.7, 0.3, 0.5, 0.4, 0.6)
    kept = out != 0
    assert kept.any()
    torch.testing.assert_close(out[kept], delta[kept] / p[kept])  # each entry by its own keep probability


# ---------------------------------------------------------------- SLERP, Model Stock


def test_slerp_off_the_midpoint_weights_the_base_by_sin_of_the_remaining_angle():
    # orthogonal unit vectors, theta = pi/2: t = 0.25 gives sin(3pi/8) * base + sin(pi/8) * expert
    out = merge("slerp", t(1.0, 0.0), [t(0.0, 1.0)], t=0.25)
    torch.testing.assert_close(out, t(math.sin(3 * math.pi / 8), math.sin(math.pi / 8)))
    # colinear: plain lerp, 0.75 * 1 + 0.25 * 3
    torch.testing.assert_close(merge("slerp", t(1.0, 1.0), [t(3.0, 3.0)], t=0.25), t(1.5, 1.5))
    # opposite (cos = -1, sin(theta) = 0) and nearly opposite: lerp too, never a division by sin(theta) ~ 0
    torch.testing.assert_close(merge("slerp", t(1.0, 2.0), [t(-1.0, -2.0)], t=0.25), t(0.5, 1.0))
    near = merge("slerp", t(1.0, 0.0), [t(-1.0, 0.01)], t=0.5)  # cos = -0.99995
    torch.testing.assert_close(near, t(0.0, 0.005))


def test_model_stock_with_three_experts():
    # d = (1,0,0), (0,1,0), (1,1,0): pair cosines 0, 1/sqrt2, 1/sqrt2 -> cos = sqrt2 / 3
    # t = 3 cos / (1 + 2 cos); merged = t * mean(e) + (1 - t) * base, mean(e) = (2/3, 2/3, 0)
    base = t(0.0, 0.0, 0.0)
    experts = [t(1.0, 0.0, 0.0), t(0.0, 1.0, 0.0), t(1.0, 1.0, 0.0)]
    cos = math.sqrt(2) / 3
    w = 3 * cos / (1 + 2 * cos)
    torch.testing.assert_close(merge("model_stock", base, experts), t(w * 2 / 3, w * 2 / 3, 0.0))


def test_model_stock_filter_wise_takes_one_angle_per_row():
    # row 0: d = (1, 0), (0, 1) -> cos 0 -> t 0 -> the base row; row 1: parallel deltas -> t 1 -> mean row
    base = torch.zeros(2, 2)
    e1, e2 = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[0.0, 1.0], [3.0, 3.0]])
    out = merge("model_stock", base, [e1, e2], filter_wise=True)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0], [2.0, 2.0]]))


# ---------------------------------------------------------------- hierarchical, CMM, pipeline


def test_hierarchical_non_layer_tensor_interpolates_from_the_anchor():
    # d_A = (1, 0), d_B = (1, 1): cos = 1/sqrt2 = w; merged = (1 - w) A + w B = (1, w)
    base, a, b = t(0.0, 0.0), t(1.0, 0.0), t(1.0, 1.0)
    out = hierarchical_tensor(base, [a, b], HierarchicalConfig(align="none"), Draws(0, "w"))
    torch.testing.assert_close(out, t(1.0, 1 / math.sqrt(2)))


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
