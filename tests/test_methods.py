"""Invariants of the merge methods (hypothesis) and their hyperparameter checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.methods import METHODS, get_method
from mergeval.methods.draws import Draws
from mergeval.methods.task_vector import kept_count, trim_to_density

SETTINGS = settings(max_examples=60, deadline=None)
GEN = Draws(0, "w")


@st.composite
def tensors(draw, min_experts: int = 1, max_experts: int = 4):
    """(base, experts) of one random shape, from a drawn seed."""
    seed = draw(st.integers(0, 2**31 - 1))
    n = draw(st.integers(min_experts, max_experts))
    shape = draw(st.sampled_from([(7,), (3, 5), (4, 4, 2)]))
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    return base, [base + 0.1 * torch.randn(shape, generator=g) for _ in range(n)]


def merge(name: str, base, experts, **params):
    method = METHODS[name]
    cfg = method.config(**params)
    method.validate(cfg, len(experts))
    return method.merge(base, experts, cfg, GEN)


@SETTINGS
@given(tensors(), st.sampled_from(["task_arithmetic", "ties"]))
def test_lambda_zero_returns_base(data, name):
    base, experts = data
    assert torch.equal(merge(name, base, experts, lambda_=0.0), base)


@SETTINGS
@given(tensors(max_experts=1), st.sampled_from(["linear", "task_arithmetic", "ties"]))
def test_one_expert_with_weight_one_returns_it(data, name):
    base, experts = data
    params = {} if name == "linear" else {"lambda_": 1.0}
    if name == "ties":
        params["density"] = 1.0
    assert torch.allclose(merge(name, base, experts, weights=[1.0], **params), experts[0], atol=1e-6)


@SETTINGS
@given(tensors(max_experts=1), st.integers(1, 4), st.sampled_from(["linear", "ties"]))
def test_merging_identical_models_returns_that_model(data, copies, name):
    base, (expert,) = data
    params = {} if name == "linear" else {"density": 1.0}
    assert torch.allclose(merge(name, base, [expert] * copies, **params), expert, atol=1e-6)


@SETTINGS
@given(tensors(min_experts=2), st.sampled_from(["linear", "task_arithmetic", "ties"]), st.randoms())
def test_order_of_experts_does_not_matter(data, name, rnd):
    base, experts = data
    shuffled = experts[:]
    rnd.shuffle(shuffled)
    assert torch.allclose(merge(name, base, experts), merge(name, base, shuffled), atol=1e-6)


@SETTINGS
@given(tensors(), st.floats(0.05, 1.0))
def test_trim_keeps_the_largest_entries(data, density):
    _, experts = data
    delta = experts[0]
    trimmed = trim_to_density(delta, density)
    kept = trimmed != 0
    assert int(kept.sum()) == (delta.numel() if density >= 1.0 else kept_count(density, delta.numel()))
    if kept.any() and (~kept).any():
        assert delta[kept].abs().min() >= delta[~kept].abs().max()


def test_ties_examples_by_hand():
    base = torch.zeros(4)
    a = torch.tensor([1.0, -2.0, 3.0, 0.5])
    b = torch.tensor([-3.0, -1.0, 1.0, 0.5])
    # density 1: sum = [-2, -3, 4, 1] -> signs [-, -, +, +]; disjoint means [-3, -1.5, 2, 0.5]
    out = merge("ties", base, [a, b], density=1.0, lambda_=1.0)
    assert torch.allclose(out, torch.tensor([-3.0, -1.5, 2.0, 0.5]))
    # count rule: votes [0, -2, +2, +2] -> entry 0 has no majority (sign 0) -> 0
    out = merge("ties", base, [a, b], density=1.0, sign_rule="count")
    assert torch.allclose(out, torch.tensor([0.0, -1.5, 2.0, 0.5]))


def test_ties_weights_before_election_changes_the_sign():
    base = torch.zeros(1)
    a, b = torch.tensor([1.0]), torch.tensor([-2.0])
    # unweighted election: sum -1 -> negative -> only b
    assert merge("ties", base, [a, b], density=1.0, weights=[3.0, 1.0]).item() == pytest.approx(-2.0)
    # mergekit order: weighted sum 3 - 2 = +1 -> positive -> only a
    assert merge(
        "ties", base, [a, b], density=1.0, weights=[3.0, 1.0], weights_before_election=True
    ).item() == pytest.approx(1.0)


def test_trim_count_is_not_inflated_by_float_error():
    assert kept_count(0.07, 100) == 7 and kept_count(0.5, 3) == 2 and kept_count(1e-9, 10) == 1


def test_task_arithmetic_formula():
    base, a, b = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([4.0])
    assert merge("task_arithmetic", base, [a, b], lambda_=0.5).item() == pytest.approx(1 + 0.5 * (1 + 3))


@pytest.mark.parametrize(
    "name,params,field",
    [
        ("ties", {"density": -0.1}, "method.density"),
        ("ties", {"density": 1.5}, "method.density"),
        ("ties", {"sign_rule": "vote"}, "method.sign_rule"),
        ("task_arithmetic", {"lambda_": float("nan")}, "method.lambda_"),
        ("task_arithmetic", {"weights": [1.0]}, "method.weights"),
        ("linear", {"weights": [1.0, -1.0]}, "method.weights"),
    ],
)
def test_invalid_hyperparameters_name_the_field(name, params, field):
    method = get_method(name)
    with pytest.raises(UserError) as err:
        method.validate(method.config(**params), 2)
    assert err.value.field == field


def test_unknown_method():
    with pytest.raises(UserError, match="choose one of"):
        get_method("nope")


def test_every_method_documents_its_formula():
    for method in METHODS.values():
        assert "=" in method.doc, method.name


def test_ties_elects_the_sign_on_the_trimmed_deltas_by_hand():
    """density 0.5 of 4 entries keeps 2 per expert. At entry 0 expert 2's -4 and expert 3's 0.5 are trimmed away:
    the trimmed deltas elect + there (3), where the untrimmed ones would elect - (3 - 4 + 0.5 < 0) and drop the 3.
      d1 = ( 3,  10,  0,  0   ) -> t1 = (3, 10, 0, 0)
      d2 = (-4,   0,  9,  8   ) -> t2 = (0,  0, 9, 8)
      d3 = ( 0.5, -2, -3, 0.25) -> t3 = (0, -2, -3, 0)
    signs (+, +, +, +); disjoint means: (3, 10, 9, 8)."""
    from mergeval.methods import get_method
    from mergeval.methods.task_vector import TiesConfig

    base = torch.zeros(4)
    experts = [
        torch.tensor([3.0, 10.0, 0.0, 0.0]),
        torch.tensor([-4.0, 0.0, 9.0, 8.0]),
        torch.tensor([0.5, -2.0, -3.0, 0.25]),
    ]
    merged = get_method("ties").merge(base, experts, TiesConfig(density=0.5), Draws(0, "w"))
    torch.testing.assert_close(merged, torch.tensor([3.0, 10.0, 9.0, 8.0]))
