"""Behaviour shared by every merge method of the registry (mergeval/methods/registry.py): lookup, docs,
hyperparameter checks and defaults, and invariants over many methods at once (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.methods import METHODS, get_method
from tests.strategies import low_precision_models, merge

SETTINGS = settings(max_examples=40, deadline=None)


def test_unknown_method():
    with pytest.raises(UserError, match="choose one of"):
        get_method("nope")


def test_every_method_documents_its_formula():
    for method in METHODS.values():
        assert "=" in method.doc, method.name


@pytest.mark.parametrize(
    "name,params,n_experts,field",
    [
        ("dare_linear", {"density": 0.0}, 2, "method.density"),
        ("dare_ties", {"density": 1.5}, 2, "method.density"),
        ("dare_linear", {"rescale": "l2"}, 2, "method.rescale"),
        ("dare_ties", {"sign_rule": "vote"}, 2, "method.sign_rule"),
        ("dare_linear", {"lambda_": float("inf")}, 2, "method.lambda_"),
        ("dare_ties", {"weights": [1.0]}, 2, "method.weights"),
        ("breadcrumbs", {"density": -0.1}, 2, "method.density"),
        ("breadcrumbs", {"gamma": 1.0}, 2, "method.gamma"),
        ("breadcrumbs_ties", {"gamma": -0.01}, 2, "method.gamma"),
        ("breadcrumbs", {"density": 0.95, "gamma": 0.1}, 2, "method.gamma"),
        ("breadcrumbs_ties", {"weights": [1.0, 2.0, 3.0]}, 2, "method.weights"),
        ("della", {"density": 0.5, "epsilon": 0.5}, 2, "method.epsilon"),
        ("della_linear", {"density": 0.9, "epsilon": 0.2}, 2, "method.epsilon"),
        ("della", {"epsilon": -0.1}, 2, "method.epsilon"),
        ("della_linear", {"density": 2.0}, 2, "method.density"),
        ("della", {"rescale": "inverse_density"}, 2, "method.rescale"),
        ("della", {"sign_rule": "max"}, 2, "method.sign_rule"),
        ("sce", {"select_topk": 0.0}, 2, "method.select_topk"),
        ("sce", {"select_topk": 1.2}, 2, "method.select_topk"),
        ("sce", {"select_topk": 0.5}, 1, "modelset.experts"),
        ("sce", {"lambda_": float("nan")}, 2, "method.lambda_"),
        ("slerp", {"t": -0.1}, 1, "method.t"),
        ("slerp", {"t": 1.5}, 1, "method.t"),
        ("slerp", {}, 2, "modelset.experts"),
        ("model_stock", {}, 1, "modelset.experts"),
    ],
)
def test_invalid_hyperparameters_name_the_field(name, params, n_experts, field):
    method = get_method(name)
    with pytest.raises(UserError) as err:
        method.validate(method.config(**params), n_experts)
    assert err.value.field == field
    assert "\n" not in str(err.value) and field in str(err.value)


def test_defaults_are_valid():
    for name in [
        "dare_linear",
        "dare_ties",
        "breadcrumbs",
        "breadcrumbs_ties",
        "della",
        "della_linear",
        "sce",
        "model_stock",
    ]:
        method = get_method(name)
        method.validate(method.config(), 2)
        assert method.config().name == name
    get_method("slerp").validate(get_method("slerp").config(), 1)


@SETTINGS
@given(
    low_precision_models(min_experts=2),
    st.sampled_from(
        [
            "task_arithmetic",
            "ties",
            "dare_linear",
            "dare_ties",
            "breadcrumbs",
            "breadcrumbs_ties",
            "della",
            "della_linear",
            "sce",
        ]
    ),
)
def test_an_expert_equal_to_the_base_changes_nothing(data, name):
    """Appended last, a zero task vector leaves every earlier expert's random draws alone, adds nothing,
    never votes and never joins a disjoint mean: the merge is bit for bit the merge without it."""
    base, experts, _ = data
    params = {
        "dare_linear": {"density": 0.5},
        "dare_ties": {"density": 0.5},
        "ties": {"density": 0.5},
        "breadcrumbs": {"density": 0.5, "gamma": 0.1},
        "breadcrumbs_ties": {"density": 0.5, "gamma": 0.1},
        "della": {"density": 0.5, "epsilon": 0.2},
        "della_linear": {"density": 0.5, "epsilon": 0.2},
    }
    p = params.get(name, {})
    assert torch.equal(merge(name, base, [*experts, base.clone()], **p), merge(name, base, experts, **p))


@SETTINGS
@given(
    low_precision_models(max_experts=3),
    st.sampled_from(
        [
            "linear",
            "task_arithmetic",
            "ties",
            "dare_ties",
            "della",
            "breadcrumbs_ties",
            "sce",
            "model_stock",
            "slerp",
            "cmm",
        ]
    ),
)
def test_experts_all_equal_to_the_base_return_the_base(data, name):
    base, experts, dtype = data
    n = 1 if name == "slerp" else max(2, len(experts)) if name == "model_stock" else len(experts)
    params = {"cmm": {"order": "given"}, "della": {"epsilon": 0.2}}.get(name, {})
    got = merge(name, base, [base.clone() for _ in range(n)], **params)
    assert got.dtype == dtype and torch.equal(got, base)


@SETTINGS
@given(low_precision_models(max_experts=1), st.sampled_from(["sum", "count"]))
def test_opposite_deltas_cancel_to_the_base(data, sign_rule):
    base, (expert,), _ = data
    opposite = (2 * base.double() - expert.double()).to(base.dtype)  # b - d, exact on the grid
    for name in ("ties", "dare_ties", "breadcrumbs_ties"):
        params = {"breadcrumbs_ties": {"gamma": 0.0}}.get(name, {})
        got = merge(name, base, [expert, opposite], density=1.0, sign_rule=sign_rule, **params)
        assert torch.equal(got, base), name
