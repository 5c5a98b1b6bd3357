"""Merges of bfloat16 / float16 inputs, experts equal to the base, and exact ties (hypothesis).

Checkpoints are usually stored in bfloat16; merges run in float32 and cast back. A merge of low-precision
inputs must equal the float64 formula applied to those same inputs up to the one rounding of the output
(TOLERANCE below). Values are drawn on small grids, so zero deltas (an expert equal to the base), exact
magnitude ties at the trim cut and sign sums of exactly zero are common, not accidents.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.methods import METHODS
from mergeval.methods.draws import Draws
from mergeval.methods.task_vector import kept_count, trim_to_density

SETTINGS = settings(max_examples=40, deadline=None)
LOW = [torch.bfloat16, torch.float16]
# Unit roundoff of the output dtype (round to nearest: half an ulp, relative): bfloat16 keeps 8 significant
# bits, float16 11. The float32 arithmetic in between adds at most a few 2^-24 of the terms' magnitudes.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
F32_SLACK = 2.0**-20


def tolerance(dtype: torch.dtype, ref: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """|merged - ref| allowed entry-wise: one rounding to ``dtype`` of the exact result (relative, and below the
    smallest normal number the subnormals' fixed spacing), plus float32 slack on ``magnitude`` (the sum of the
    absolute terms the result was computed from)."""
    return UNIT_ROUNDOFF[dtype] * (ref.abs() + torch.finfo(dtype).smallest_normal) + F32_SLACK * magnitude


@st.composite
def low_precision_models(draw, min_experts: int = 1, max_experts: int = 4):
    """(base, experts, dtype): values on a grid of quarters in [-4, 4] (exact in bf16 and fp16); each expert's
    delta is zero, a copy of another expert's (exact ties), or drawn from {-1, -0.5, 0, 0.5, 1} * step."""
    dtype = draw(st.sampled_from(LOW))
    n = draw(st.integers(min_experts, max_experts))
    size = draw(st.integers(1, 12))
    quarters = st.integers(-16, 16).map(lambda k: k / 4)
    base = torch.tensor(draw(st.lists(quarters, min_size=size, max_size=size)), dtype=torch.float64)
    step = draw(st.sampled_from([0.25, 0.5, 1.0]))
    deltas: list[torch.Tensor] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["zero", "grid", "grid", "copy"] if deltas else ["zero", "grid", "grid"]))
        if kind == "zero":
            deltas.append(torch.zeros(size, dtype=torch.float64))
        elif kind == "copy":
            deltas.append(deltas[draw(st.integers(0, len(deltas) - 1))].clone())
        else:
            units = draw(st.lists(st.sampled_from([-1.0, -0.5, 0.0, 0.5, 1.0]), min_size=size, max_size=size))
            deltas.append(step * torch.tensor(units, dtype=torch.float64))
    return base.to(dtype), [(base + d).to(dtype) for d in deltas], dtype


def merge(name: str, base, experts, seed: int = 0, **params):
    method = METHODS[name]
    cfg = method.config(**params)
    method.validate(cfg, len(experts))
    return method.merge(base, experts, cfg, Draws(seed, "w"))


def ties_reference(
    base: torch.Tensor, experts: list[torch.Tensor], weights: list[float], lam: float, sign_rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """TIES at density 1 in float64, entry by entry as the paper states it: (result, magnitude of its terms)."""
    b = base.double()
    d = torch.stack([e.double() - b for e in experts])
    w = torch.tensor(weights, dtype=torch.float64).view(-1, 1)
    gamma = torch.sign(d.sum(0)) if sign_rule == "sum" else torch.sign(torch.sign(d).sum(0))
    agree = (torch.sign(d) == gamma) & (d != 0)
    mass = (w * agree).sum(0)
    tau = torch.where(mass > 0, (w * d * agree).sum(0) / torch.where(mass > 0, mass, 1.0), 0.0)
    return b + lam * tau, b.abs() + abs(lam) * (w.abs() * d.abs()).sum(0)


@SETTINGS
@given(
    low_precision_models(),
    st.lists(st.sampled_from([0.5, 1.0, 1.5, 3.0]), min_size=4, max_size=4),
    st.sampled_from([0.5, 1.0, 1.25]),
)
def test_task_arithmetic_and_linear_match_float64(data, weights, lam):
    base, experts, dtype = data
    w = weights[: len(experts)]
    b = base.double()
    ds = [e.double() - b for e in experts]
    ref = b + lam * sum(wi * d for wi, d in zip(w, ds))
    got = merge("task_arithmetic", base, experts, lambda_=lam, weights=w)
    assert got.dtype == dtype
    magnitude = b.abs() + lam * sum(wi * d.abs() for wi, d in zip(w, ds))
    assert ((got.double() - ref).abs() <= tolerance(dtype, ref, magnitude)).all()
    soup = sum(wi * e.double() for wi, e in zip(w, experts)) / sum(w)
    got = merge("linear", base, experts, weights=w)
    magnitude = sum(wi * e.double().abs() for wi, e in zip(w, experts)) / sum(w)
    assert got.dtype == dtype and ((got.double() - soup).abs() <= tolerance(dtype, soup, magnitude)).all()


@SETTINGS
@given(low_precision_models(), st.sampled_from(["sum", "count"]), st.booleans())
def test_ties_matches_float64_with_zero_deltas_and_sign_ties(data, sign_rule, weighted):
    base, experts, dtype = data
    w = [1.0 + 0.5 * i for i in range(len(experts))] if weighted else [1.0] * len(experts)
    ref, magnitude = ties_reference(base, experts, w, 1.0, sign_rule)
    got = merge("ties", base, experts, density=1.0, weights=w, sign_rule=sign_rule)
    assert got.dtype == dtype
    assert ((got.double() - ref).abs() <= tolerance(dtype, ref, magnitude)).all()


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


@SETTINGS
@given(st.sampled_from(LOW), st.integers(1, 40), st.floats(0.05, 0.95), st.integers(0, 2**31 - 1))
def test_trim_with_exact_magnitude_ties_keeps_exactly_k_of_the_largest(dtype, n, density, seed):
    # magnitudes from {0.5, 1, 2} with random signs: almost every cut falls inside a run of equal magnitudes
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (n,), generator=g)]
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    delta = (levels * signs).to(dtype)
    kept = trim_to_density(delta, density)
    assert kept.dtype == dtype
    mask = kept != 0
    assert int(mask.sum()) == kept_count(density, n)
    assert torch.equal(kept[mask], delta[mask])
    if (~mask).any():
        assert delta[mask].abs().min() >= delta[~mask].abs().max()


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_checkpoint_merges_match_float64(tiny_dir, dtype):
    """The tiny zoo model and two experts stored in ``dtype``, merged by the engine tensor by tensor: every
    entry of task arithmetic and TIES (density 1) within one output rounding of the float64 formula."""
    from mergeval.merge import merge_tensors
    from mergeval.models.checkpoint import load_tensors

    base32 = load_tensors(tiny_dir)
    g = torch.Generator().manual_seed(0)
    base = {n: t.to(dtype) for n, t in base32.items()}
    experts = [
        {n: (t + 0.01 * torch.randn(t.shape, generator=g)).to(dtype) for n, t in base32.items()} for _ in range(2)
    ]
    weights, lam = [0.7, 1.3], 0.9
    for name, params in (
        ("task_arithmetic", {"lambda_": lam, "weights": weights}),
        ("ties", {"lambda_": lam, "weights": weights, "density": 1.0}),
    ):
        method = METHODS[name]
        merged = merge_tensors(method, method.config(**params), base, experts, seed=0, progress=False)
        assert set(merged) == set(base)
        for tensor_name, got in merged.items():
            b, es = base[tensor_name], [e[tensor_name] for e in experts]
            if name == "ties":
                ref, magnitude = ties_reference(b.flatten(), [e.flatten() for e in es], weights, lam, "sum")
                ref, magnitude = ref.view(b.shape), magnitude.view(b.shape)
            else:
                ds = [e.double() - b.double() for e in es]
                ref = b.double() + lam * sum(w * d for w, d in zip(weights, ds))
                magnitude = b.double().abs() + lam * sum(w * d.abs() for w, d in zip(weights, ds))
            assert got.dtype == dtype, tensor_name
            assert ((got.double() - ref).abs() <= tolerance(dtype, ref, magnitude)).all(), (name, tensor_name)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1.0, -2.5, 3e38, -3e38, float("inf"), -float("inf")]),
        min_size=2,
        max_size=40,
    ),
    st.sampled_from([-1.0, -0.0, 0.0, 1.0]),
)
def test_the_agreement_product_is_the_sign_comparison(values, gamma):
    """disjoint_merge's A_i = [s_i * gamma > 0] equals [sign(s_i) == gamma and s_i != 0] for gamma in {-1, 0, +1}."""
    s = torch.tensor(values, dtype=torch.float32)
    g = torch.tensor(gamma, dtype=torch.float32)
    assert torch.equal((s * g) > 0, (torch.sign(s) == g) & (s != 0))
