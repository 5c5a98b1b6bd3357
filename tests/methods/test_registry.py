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


# ---------------------------------------------------------------- what a method declares at registration


def test_the_registry_answers_what_a_method_needs_beyond_its_config():
    """``MergeMethod.needs`` says what a run prepares before merging; whether a given config still needs it is
    the method's own answer (CMM: only an order by score without given scores must rank the experts)."""
    from mergeval.methods.curriculum import CmmConfig
    from mergeval.methods.masks import LocalizeStitchConfig, LocalizeStitchTrainedConfig

    cmm = get_method("cmm")
    assert cmm.needs.ranking is not None
    assert cmm.needs.ranking_pending(CmmConfig())
    assert not cmm.needs.ranking_pending(CmmConfig(order="given"))
    assert not cmm.needs.ranking_pending(CmmConfig(validation_scores=[0.3, 0.1]))
    assert cmm.needs.ranking.fix() == "give method.validation_scores or set method.order=given"
    # what CMM decided beyond its config, for result.json: its registered details
    assert cmm.details is not None
    assert cmm.details(CmmConfig(validation_scores=[0.3, 0.1, 0.2]), ["a", "b", "c"]) == {
        "order": ["b", "c", "a"],
        "coefficients": pytest.approx([0.3, 0.45, 0.6]),
    }
    stitch = get_method("localize_stitch").needs
    assert stitch.magnitude_cuts and stitch.ranking is None
    assert stitch.cuts_pending(LocalizeStitchConfig())
    assert not stitch.cuts_pending(LocalizeStitchConfig(scope="tensor"))
    assert not stitch.cuts_pending(LocalizeStitchConfig(thresholds=[0.1]))
    trained = get_method("localize_stitch_trained").needs
    assert trained.statistics == "localize" and trained.statistics_pending(LocalizeStitchTrainedConfig())
    assert get_method("fisher").needs.statistics == "fisher" and get_method("regmean").needs.statistics == "gram"
    assert get_method("hierarchical").needs.head_counts and get_method("pipeline").needs.expert_names
    plain = get_method("ties")
    assert plain.details is None and plain.needs == type(plain.needs)()
    assert not plain.needs.ranking_pending(plain.config()) and not plain.needs.cuts_pending(plain.config())


def test_the_registry_answers_each_methods_mergekit_counterpart():
    """``MergeMethod.mergekit``: mergekit's name for the method, whether it is mergekit's own or the same in both
    modes, and where mergekit's configuration holds the base; mergekit_config.py derives its lists from them."""
    from mergeval.methods.registry import Mergekit
    from mergeval.run.mergekit_config import counterparts, whole_model_methods

    mk = {name: m.mergekit for name, m in METHODS.items()}
    assert mk["ties"] == Mergekit("ties") and not mk["ties"].written_in_both_modes()
    assert mk["linear"] == Mergekit("linear", same_in_both_modes=True, base="model")
    assert mk["task_arithmetic"].written_in_both_modes() and not mk["task_arithmetic"].own
    assert mk["karcher"] == Mergekit("karcher", own=True, base="averaged")
    assert {n for n, k in mk.items() if k and k.base == "listed"} == {"slerp", "nearswap", "arcee_fusion"}
    assert {n for n, k in mk.items() if k and k.base == "optional"} == {"nuslerp", "multislerp"}
    assert mk["passthrough"].slices_only
    own = {n for n, k in mk.items() if k and k.own and not k.slices_only}
    assert own == {"nearswap", "nuslerp", "multislerp", "karcher", "ram", "ramplus_tl", "arcee_fusion"}
    assert all(mk[n] is None for n in ("cmm", "hierarchical", "fisher", "regmean", "pipeline", "consensus_ta"))
    assert set(whole_model_methods()) == {
        "linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties",
        "della", "della_linear", "slerp", "model_stock", "sce", *own,
    }  # fmt: skip
    assert {m.name for m in counterparts().values()} == {n for n, k in mk.items() if k}
    with pytest.raises(ValueError, match="Mergekit.base must be one of"):
        Mergekit("x", base="first")


def test_the_methods_reference_lines_say_what_each_method_declared():
    lines = {name: m.requirements() for name, m in METHODS.items()}
    assert any("method.validation_scores" in line and "order=given" in line for line in lines["cmm"])
    assert any("calibration statistic 'gram'" in line for line in lines["regmean"])
    assert lines["ties"][0].startswith("nothing prepared") and "compat=mergekit" in lines["ties"][-1]
    assert lines["consensus_ta"][-1] == "no mergekit counterpart"
    assert all(lines.values())


def test_registering_a_method_whose_config_lacks_what_it_declares_is_refused_naming_the_fields():
    """A newcomer's method that declares a need is told at import which fields its config must have for the run
    to fill them (and is not registered)."""
    from dataclasses import dataclass

    from mergeval.methods.registry import Mergekit, Needs, Ranking, register

    @dataclass
    class NewConfig:
        name: str = "newcomer"
        lambda_: float = 1.0

    for needs, mergekit, fields in [
        (Needs(ranking=Ranking(lambda cfg: True)), None, "validation_scores, validation_items, rank_by"),
        (Needs(magnitude_cuts=True), None, "thresholds"),
        (Needs(statistics="fisher"), None, "statistics"),
        (Needs(), Mergekit("newcomer"), "compat"),
    ]:
        with pytest.raises(TypeError, match=f"declares .*: add the field\\(s\\) {fields} to NewConfig"):
            register("newcomer", NewConfig, lambda cfg, n: None, needs=needs, mergekit=mergekit)(lambda *a: a[0])
    assert "newcomer" not in METHODS


def test_every_method_has_its_yaml_and_every_top_level_method_yaml_is_a_method():
    """One YAML per method, ``conf/method/<name>.yaml`` extending ``<name>_schema``; a paper's presets live in
    the paper's own folder (``conf/method/<paper>/``, a spec of ``specs/``), never beside the methods."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    conf = root / "conf" / "method"
    assert {p.stem for p in conf.glob("*.yaml")} == set(METHODS)
    for name in METHODS:
        assert f"{name}_schema" in yaml.safe_load((conf / f"{name}.yaml").read_text())["defaults"], name
    folders = [p.name for p in conf.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert folders and all((root / "specs" / f"{f}.yaml").is_file() for f in folders), folders
