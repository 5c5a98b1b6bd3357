"""mergeval/methods/geometric.py: the definitions and invariants of NearSwap and of mergekit's spherical methods
(NuSLERP, Multi-SLERP, the Karcher mean), and SLERP's and Model Stock's invariants and hand-worked merges; the
parity of all of them with mergekit 0.1.5 is in test_mergekit_parity.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.methods import get_method
from mergeval.methods.draws import Draws
from tests.strategies import t, tensors

SETTINGS = settings(max_examples=40, deadline=None)

NEARSWAP = get_method("nearswap")


def nearswap(base: torch.Tensor, expert: torch.Tensor, t: float) -> torch.Tensor:
    return NEARSWAP.merge(base, [expert], NEARSWAP.config(t=t), Draws(0, "w"))


pairs = st.integers(1, 64).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n),
        st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n),
    )
)


@settings(max_examples=200, deadline=None)
@given(pairs, st.floats(0, 3))
def test_each_entry_moves_toward_the_expert_by_at_most_t(pair, t):
    b, e = (torch.tensor(x, dtype=torch.float32) for x in pair)
    merged = nearswap(b, e, t)
    gap = (e - b).abs()
    lo, hi = torch.minimum(b, e), torch.maximum(b, e)
    assert bool(((merged >= lo - 1e-6) & (merged <= hi + 1e-6)).all())  # between the two
    # within t of each other: the expert's value; farther: t toward it (up to float32 rounding)
    near = gap <= t
    assert torch.allclose(merged[near], e[near], atol=1e-6, rtol=0)
    far = gap > max(t, 1e-6)
    torch.testing.assert_close((merged - b).abs()[far], torch.full_like(gap[far], t), atol=1e-5, rtol=1e-5)


def test_endpoints_and_a_hand_computed_case():
    b = torch.tensor([0.0, 0.0, 0.0, 1.0])
    e = torch.tensor([0.005, 0.02, -0.5, 1.0])
    assert torch.equal(nearswap(b, e, 0.0), b)
    assert torch.equal(nearswap(b, e, 10.0), e)
    torch.testing.assert_close(nearswap(b, e, 0.01), torch.tensor([0.005, 0.01, -0.01, 1.0]), atol=1e-7, rtol=0)


def test_the_result_keeps_the_base_dtype():
    b = torch.zeros(8, dtype=torch.bfloat16)
    assert nearswap(b, b + 1, 0.5).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "t,experts,field", [(-0.1, 1, "method.t"), (float("nan"), 1, "method.t"), (0.1, 2, "modelset.experts")]
)
def test_bad_settings_name_the_field(t, experts, field):
    with pytest.raises(UserError) as err:
        NEARSWAP.validate(NEARSWAP.config(t=t), experts)
    assert err.value.field == field


# ---------------------------------------------------------------- NuSLERP, Multi-SLERP, Karcher

CLOSE = dict(atol=1e-5, rtol=1e-5)  # a few float32 roundings of values of size ~1


def merge(name: str, base: torch.Tensor, experts: list[torch.Tensor], **params) -> torch.Tensor:
    method = get_method(name)
    cfg = method.config(**params)
    method.validate(cfg, len(experts))
    return method.merge(base, experts, cfg, Draws(0, "w"))


@st.composite
def points(draw, at_least: int = 2, at_most: int = 4):
    """(base, experts): at_least..at_most models of one shape, seeded, the first the base; they share a
    direction (angles well inside (0, pi)) and each has its own norm."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = draw(st.sampled_from([(7,), (3, 5), (4, 3, 2)]))
    n = draw(st.integers(at_least, at_most))
    common = torch.randn(shape, generator=g)
    models = [
        (common + draw(st.sampled_from([0.3, 1.0])) * torch.randn(shape, generator=g)) * draw(st.floats(0.25, 4.0))
        for _ in range(n)
    ]
    return models[0], models[1:]


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm()


@settings(max_examples=60, deadline=None)
@given(
    points(3, 3),
    st.sampled_from([{}, {"nuslerp_flatten": False}, {"nuslerp_flatten": False, "nuslerp_row_wise": True}]),
)
def test_nuslerp_with_all_the_weight_on_one_model_returns_it(data, shape):
    base, experts = data
    for i in range(2):
        w = [1.0 - i, float(i)]
        torch.testing.assert_close(merge("nuslerp", base, experts, weights=w, **shape), experts[i], **CLOSE)
        both = [base, experts[0]]
        torch.testing.assert_close(
            merge("nuslerp", base, experts[:1], weights=w, include_base=True, **shape), both[i], **CLOSE
        )


@settings(max_examples=60, deadline=None)
@given(points(2, 2), st.floats(0.0, 1.0))
def test_nuslerp_of_unit_vectors_stays_on_the_sphere_at_angle_t_theta(data, t):
    """slerp_t(u_0, u_1) is the unit vector at angle t theta from u_0 in their plane."""
    x, (y,) = data
    u0, u1 = unit(x).reshape(-1), unit(y).reshape(-1)
    out = merge("nuslerp", u0, [u1], weights=[1 - t, t], include_base=True).double()
    assert abs(out.norm().item() - 1) < 1e-5
    theta = torch.arccos(torch.dot(u0.double(), u1.double()).clamp(-1, 1)).item()
    angle = torch.arccos(torch.dot(unit(out), u0.double()).clamp(-1, 1)).item()
    assert abs(angle - t * theta) < 2e-3  # arccos of a float32 cosine near 1: ~5e-4


@settings(max_examples=60, deadline=None)
@given(points(2, 2), st.floats(-2.0, 3.0))
def test_nuslerp_weights_give_t_and_rows_are_slerped_alone(data, t):
    base, (expert,) = data
    m = base.reshape(base.shape[0], -1) if base.dim() > 1 else base.reshape(1, -1)
    e = expert.reshape(m.shape)
    rows = merge("nuslerp", m, [e], weights=[1 - t, t], include_base=True, nuslerp_flatten=False)
    for i in range(m.shape[0]):  # one angle per row: each row is the flattened slerp of that row
        torch.testing.assert_close(
            rows[i], merge("nuslerp", m[i], [e[i]], weights=[1 - t, t], include_base=True), **CLOSE
        )
    columns = merge(
        "nuslerp", m, [e], weights=[1 - t, t], include_base=True, nuslerp_flatten=False, nuslerp_row_wise=True
    )
    transposed = merge(
        "nuslerp", m.T.contiguous(), [e.T.contiguous()], weights=[1 - t, t], include_base=True, nuslerp_flatten=False
    )  # row_wise: the columns are the vectors
    torch.testing.assert_close(columns, transposed.T, **CLOSE)
    scaled = merge("nuslerp", m, [e], weights=[3 * (1 - t), 3 * t], include_base=True)
    torch.testing.assert_close(scaled, merge("nuslerp", m, [e], weights=[1 - t, t], include_base=True), **CLOSE)


@settings(max_examples=60, deadline=None)
@given(points(1, 1), st.floats(0.0, 1.0))
def test_identical_models_give_themselves(data, t):
    base, _ = data
    expert = base * 1.5 - 0.25
    same = [expert.clone(), expert.clone(), expert.clone()]
    torch.testing.assert_close(merge("nuslerp", base, same[:2], weights=[1 - t, t + 0.1]), expert, **CLOSE)
    torch.testing.assert_close(
        merge("nuslerp", expert, same[:1], weights=[1 - t, t + 0.1], include_base=True), expert, **CLOSE
    )
    torch.testing.assert_close(merge("multislerp", base, same, weights=[1.0, t, 2.0]), expert, **CLOSE)
    torch.testing.assert_close(merge("karcher", base, same), expert, **CLOSE)
    torch.testing.assert_close(merge("karcher", expert, same, include_base=True), expert, **CLOSE)


@settings(max_examples=60, deadline=None)
@given(points(1, 1))
def test_one_model_is_returned_as_it_is(data):
    base, _ = data
    expert = base + 1
    assert torch.equal(merge("karcher", base, [expert]), expert)
    assert torch.equal(merge("multislerp", base, [expert]), expert)
    assert torch.equal(merge("multislerp", expert, [], include_base=True), expert)
    assert torch.equal(merge("karcher", expert, [], include_base=True), expert)


@settings(max_examples=60, deadline=None)
@given(points(3, 3))
def test_two_models_at_equal_weights_meet_at_the_midpoint_of_the_arc(data):
    """At equal weights all three reduce to the geodesic midpoint of the directions, times the mean norm:
    karcher(x, y) = multislerp(x, y) = (|x| + |y|) / 2 * slerp_0.5(x/|x|, y/|y|)."""
    base, (x, y) = data
    mid = (x.norm() + y.norm()) / 2 * merge("nuslerp", unit(x), [unit(y)], include_base=True)
    torch.testing.assert_close(merge("karcher", base, [x, y]), mid, **CLOSE)
    torch.testing.assert_close(merge("multislerp", x, [y], include_base=True), mid, **CLOSE)
    torch.testing.assert_close(
        merge("multislerp", base, [x, y], weights=[2.0, 2.0]),  # normalised weights
        base + _task_midpoint(base, x, y),
        **CLOSE,
    )
    if abs(x.norm() - y.norm()) < 1e-6 * x.norm():  # equal norms: NuSLERP's t = 0.5 is the same point
        torch.testing.assert_close(merge("nuslerp", x, [y], include_base=True), mid, **CLOSE)


def _task_midpoint(base: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    d, e = x - base, y - base
    return (d.norm() + e.norm()) / 2 * merge("nuslerp", unit(d), [unit(e)], include_base=True)


@settings(max_examples=60, deadline=None)
@given(points(3, 4), st.lists(st.floats(0.1, 3.0), min_size=3, max_size=3))
def test_multislerp_norm_is_the_weighted_mean_norm(data, weights):
    """|merged| = sum_i w_i |x_i| with normalised weights: the direction cos(r) mu + sin(r)/r v is a unit vector
    (mu and v orthogonal, r = |v| up to eps)."""
    base, experts = data
    w = weights[: len(experts)]
    merged = merge("multislerp", base, experts, weights=w)
    mean_norm = sum(wi * (e - base).norm() for wi, e in zip(w, experts)) / sum(w)
    assert (merged - base).norm().item() == pytest.approx(mean_norm.item(), rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(points(4, 4))
def test_karcher_mean_is_a_fixed_point_with_the_mean_norm(data):
    """|merged| = mean_i |x_i|, and its direction mu zeroes the Riemannian gradient mean_i log_mu(u_i)
    (computed here in float64) to within float32's precision of the angles."""
    base, experts = data
    merged = merge("karcher", base, experts, max_iter=200, tol=1e-7).double()
    xs = [x.double().reshape(-1) for x in experts]
    assert merged.norm().item() == pytest.approx(sum(x.norm().item() for x in xs) / len(xs), rel=1e-5)
    mu = merged.reshape(-1) / merged.norm()
    grad = torch.zeros_like(mu)
    for x in xs:
        u = x / x.norm()
        cos = torch.dot(mu, u).clamp(-1, 1)
        theta = torch.arccos(cos)
        grad += (theta / torch.sin(theta)) * (u - cos * mu) / len(xs)
    assert grad.norm().item() < 1e-5  # measured: below 2e-7
    assert merge("karcher", base, experts, max_iter=0).norm().item() == pytest.approx(merged.norm().item(), rel=1e-5)


def test_karcher_leaves_zero_models_out_of_the_direction_but_counts_their_norm():
    x, y = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 0.0])
    torch.testing.assert_close(merge("karcher", x, [x, y]), torch.tensor([1.5, 0.0]))
    assert torch.equal(merge("karcher", x, [y, y]), torch.zeros(2))


def test_multislerp_of_cancelling_models():
    """Two opposite task vectors at equal weights: the weighted unit vectors cancel and the two are lerped
    (mergekit's fallback); with three the merge has no direction and is refused."""
    b = torch.tensor([1.0, 2.0])
    d = torch.tensor([0.5, -0.25])
    assert torch.equal(merge("multislerp", b, [b + d, b - d]), b)
    with pytest.raises(UserError) as err:
        merge("multislerp", b, [b + d, b - d, b + d], weights=[1.0, 2.0, 1.0])
    assert err.value.field == "method.weights"


def test_the_hand_computed_quarter_turn():
    """u_0 = (1, 0), u_1 = (0, 1): a third of the way is (cos 30deg, sin 30deg); the Karcher and Multi-SLERP
    means of the two are (1, 1) / sqrt(2), of norm the mean norm."""
    e0, e1 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    half = 2**-0.5
    torch.testing.assert_close(
        merge("nuslerp", e0, [e1 / 3], weights=[2.0, 1.0], include_base=True), torch.tensor([3**0.5 / 2, 0.5])
    )
    torch.testing.assert_close(merge("karcher", e0, [e0, e1]), 2 * torch.tensor([half, half]))
    torch.testing.assert_close(merge("multislerp", e0, [e1], include_base=True), 2 * torch.tensor([half, half]))
    torch.testing.assert_close(merge("nuslerp", torch.zeros(2), [e0, e1 / 3]), torch.tensor([half, half]))


@pytest.mark.parametrize("name", ["nuslerp", "multislerp", "karcher"])
def test_the_spherical_methods_keep_the_base_dtype(name):
    b = torch.linspace(-1, 1, 8).to(torch.bfloat16)
    n = 2 if name == "nuslerp" else 3
    assert merge(name, b, [b * (1 + i) + 0.5 for i in range(n)]).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "name,params,experts,field",
    [
        ("nuslerp", {}, 1, "modelset.experts"),
        ("nuslerp", {}, 3, "modelset.experts"),
        ("nuslerp", {"include_base": True}, 2, "modelset.experts"),
        ("nuslerp", {"weights": [1.0]}, 2, "method.weights"),
        ("nuslerp", {"include_base": True, "weights": [1.0, 2.0, 3.0]}, 1, "method.weights"),
        ("multislerp", {"eps": -1.0}, 2, "method.eps"),
        ("multislerp", {"weights": [1.0, -1.0]}, 2, "method.weights"),
        ("multislerp", {"include_base": True, "weights": [1.0, 1.0]}, 2, "method.weights"),
        ("karcher", {"max_iter": -1}, 2, "method.max_iter"),
        ("karcher", {"tol": float("nan")}, 2, "method.tol"),
        ("karcher", {}, 0, "modelset.experts"),
    ],
)
def test_bad_spherical_settings_name_the_field(name, params, experts, field):
    method = get_method(name)
    with pytest.raises(UserError) as err:
        method.validate(method.config(**params), experts)
    assert err.value.field == field


def test_weights_summing_to_zero_without_normalising_are_allowed():
    method = get_method("multislerp")
    method.validate(method.config(weights=[1.0, -1.0], normalize_weights=False), 2)
    nu = get_method("nuslerp")  # |w_1 + w_2| < 1e-6: t = 0.5, as mergekit
    b, x, y = torch.zeros(2), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    torch.testing.assert_close(
        nu.merge(b, [x, y], nu.config(weights=[1.0, -1.0]), Draws(0, "w")), torch.tensor([2**-0.5, 2**-0.5])
    )


@SETTINGS
@given(tensors(max_experts=1))
def test_slerp_endpoints(data):
    base, experts = data
    assert torch.equal(merge("slerp", base, experts, t=0.0), base)
    assert torch.equal(merge("slerp", base, experts, t=1.0), experts[0])


@SETTINGS
@given(tensors(max_experts=1), st.floats(0.1, 3.0), st.floats(0.0, 1.0))
def test_slerp_of_colinear_tensors_is_lerp(data, scale, t):
    base, _ = data
    expert = scale * base
    assert torch.allclose(merge("slerp", base, [expert], t=t), (1 - t) * base + t * expert, atol=1e-6)


@SETTINGS
@given(tensors(max_experts=1, shapes=((16,), (4, 8))), st.floats(0.0, 1.0))
def test_slerp_keeps_the_norm_of_equal_norm_tensors(data, t):
    base, _ = data
    other = torch.randn(base.shape, generator=torch.Generator().manual_seed(1))
    expert = other * (base.norm() / other.norm())
    out = merge("slerp", base, [expert], t=t)
    assert out.norm().item() == pytest.approx(base.norm().item(), rel=1e-5)


def test_slerp_by_hand():
    out = merge("slerp", torch.tensor([1.0, 0.0]), [torch.tensor([0.0, 1.0])], t=0.5)
    assert torch.allclose(out, torch.tensor([math.sqrt(0.5), math.sqrt(0.5)]))
    out = merge("slerp", torch.tensor([1.0, 0.0]), [torch.tensor([0.0, 1.0])], t=1 / 3)
    assert torch.allclose(out, torch.tensor([math.cos(math.pi / 6), math.sin(math.pi / 6)]))


@SETTINGS
@given(tensors(max_experts=1), st.integers(2, 4), st.booleans())
def test_model_stock_of_identical_experts_returns_the_expert(data, copies, filter_wise):
    base, (expert,) = data
    assert torch.allclose(merge("model_stock", base, [expert] * copies, filter_wise=filter_wise), expert, atol=1e-6)


def test_model_stock_by_hand():
    base = torch.zeros(2)
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.5, math.sqrt(3) / 2])  # cos 0.5 -> t = 1 / 1.5
    assert torch.allclose(merge("model_stock", base, [e1, e2]), (2 / 3) * (e1 + e2) / 2)
    base = torch.ones(2)
    out = merge("model_stock", base, [base + e1, base - e1])  # cos -1, clamped to 0 -> t = 0
    assert torch.equal(out, base)


@SETTINGS
@given(tensors(min_experts=2), st.booleans(), st.randoms())
def test_model_stock_does_not_depend_on_expert_order(data, filter_wise, rnd):
    base, experts = data
    shuffled = experts[:]
    rnd.shuffle(shuffled)
    assert torch.allclose(
        merge("model_stock", base, experts, filter_wise=filter_wise),
        merge("model_stock", base, shuffled, filter_wise=filter_wise),
        atol=1e-6,
    )


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
