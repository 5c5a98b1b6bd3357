"""Linear, task arithmetic and TIES (mergeval/methods/task_vector.py): invariants (hypothesis), hand-worked
merges, low-precision (bfloat16/float16) inputs against the float64 formula, and hyperparameter checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.methods import METHODS, get_method
from mergeval.methods.draws import Draws
from mergeval.methods.task_vector import kept_count, trim_to_density
from tests.strategies import LOW, low_precision_models, merge, t, tensors

SETTINGS = settings(max_examples=40, deadline=None)
SETTINGS_60 = settings(max_examples=60, deadline=None)
# Unit roundoff of the output dtype (round to nearest: half an ulp, relative): bfloat16 keeps 8 significant
# bits, float16 11. The float32 arithmetic in between adds at most a few 2^-24 of the terms' magnitudes.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
F32_SLACK = 2.0**-20


@SETTINGS_60
@given(tensors(), st.sampled_from(["task_arithmetic", "ties"]))
def test_lambda_zero_returns_base(data, name):
    base, experts = data
    assert torch.equal(merge(name, base, experts, lambda_=0.0), base)


@SETTINGS_60
@given(tensors(max_experts=1), st.sampled_from(["linear", "task_arithmetic", "ties"]))
def test_one_expert_with_weight_one_returns_it(data, name):
    base, experts = data
    params = {} if name == "linear" else {"lambda_": 1.0}
    if name == "ties":
        params["density"] = 1.0
    assert torch.allclose(merge(name, base, experts, weights=[1.0], **params), experts[0], atol=1e-6)


@SETTINGS_60
@given(tensors(max_experts=1), st.integers(1, 4), st.sampled_from(["linear", "ties"]))
def test_merging_identical_models_returns_that_model(data, copies, name):
    base, (expert,) = data
    params = {} if name == "linear" else {"density": 1.0}
    assert torch.allclose(merge(name, base, [expert] * copies, **params), expert, atol=1e-6)


@SETTINGS_60
@given(tensors(min_experts=2), st.sampled_from(["linear", "task_arithmetic", "ties"]), st.randoms())
def test_order_of_experts_does_not_matter(data, name, rnd):
    base, experts = data
    shuffled = experts[:]
    rnd.shuffle(shuffled)
    assert torch.allclose(merge(name, base, experts), merge(name, base, shuffled), atol=1e-6)


@SETTINGS_60
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


@SETTINGS
@given(
    st.integers(3, 6),
    st.lists(
        st.sampled_from([0.0, 1.0, -1.0, 3.0, -3.0, 1e-7, -1e-7, 1e8, -1e8, 0.1, -0.1, 0.3, -0.2]),
        min_size=6,
        max_size=240,
    ),
    st.randoms(use_true_random=False),
)
def test_the_sign_vote_is_the_sorted_sums_sign_without_sorting_everything(n, values, rng):
    """sign_of_sum sorts only where a rounding-level sum could flip: it must equal the sign of the sorted
    sum everywhere, on values built to cancel (x, -x, big + tiny) and in every expert order."""
    from mergeval.methods.task_vector import _sorted_sum, sign_of_sum

    voters = torch.tensor(values[: len(values) // n * n] or [0.0] * n, dtype=torch.float32).view(n, -1)
    order = list(range(n))
    rng.shuffle(order)
    for v in (voters, voters[order]):
        assert torch.equal(sign_of_sum(v), torch.sign(_sorted_sum(voters)))


def tolerance(dtype: torch.dtype, ref: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """|merged - ref| allowed entry-wise: one rounding to ``dtype`` of the exact result (relative, and below the
    smallest normal number the subnormals' fixed spacing), plus float32 slack on ``magnitude`` (the sum of the
    absolute terms the result was computed from)."""
    return UNIT_ROUNDOFF[dtype] * (ref.abs() + torch.finfo(dtype).smallest_normal) + F32_SLACK * magnitude


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
