"""The sparsifying methods (mergeval/methods/sparsify.py: DARE, Breadcrumbs, DELLA, SCE): invariants
(hypothesis) and hand-worked merges."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.methods.draws import Draws
from mergeval.methods.sparsify import breadcrumbs_mask, dare_drop, della_keep_prob, della_magprune
from tests.strategies import merge, t, tensors

SETTINGS = settings(max_examples=40, deadline=None)
LAMBDA_METHODS = ["dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce"]
RANDOM_METHODS = ["dare_linear", "dare_ties", "della", "della_linear"]
SEEDS = 400


@SETTINGS
@given(tensors(), st.sampled_from(LAMBDA_METHODS))
def test_lambda_zero_returns_base(data, name):
    base, experts = data
    assert torch.equal(merge(name, base, experts, lambda_=0.0), base)


@SETTINGS
@given(
    tensors(min_experts=2),
    st.sampled_from(["breadcrumbs_ties", "sce", "dare_ties", "della"]),
    st.booleans(),
    st.floats(0.1, 1.0),
    st.randoms(),
)
def test_election_methods_do_not_depend_on_expert_order(data, name, flag, frac, rnd):
    # The random ones (dare_ties, della) consume their draws in expert order, so only their
    # deterministic setting (keep everything) is order-invariant pointwise; see the module docstring.
    base, experts = data
    params = {
        "breadcrumbs_ties": {"density": frac * 0.9, "gamma": 0.1, "sign_rule": "sum" if flag else "count"},
        "sce": {"select_topk": frac, "normalize": flag},
        "dare_ties": {"density": 1.0, "sign_rule": "sum" if flag else "count"},
        "della": {"density": 1.0, "epsilon": 0.0},
    }[name]
    shuffled = experts[:]
    rnd.shuffle(shuffled)
    assert torch.allclose(merge(name, base, experts, **params), merge(name, base, shuffled, **params), atol=1e-6)


@SETTINGS
@given(tensors(max_experts=1), st.sampled_from(["dare_linear", "breadcrumbs", "della_linear", "sce"]))
def test_one_expert_kept_whole_with_weight_one_returns_it(data, name):
    base, experts = data
    params = {
        "dare_linear": {"density": 1.0, "weights": [1.0]},
        "breadcrumbs": {"density": 1.0, "gamma": 0.0, "weights": [1.0]},
        "della_linear": {"density": 1.0, "epsilon": 0.0, "weights": [1.0]},
        "sce": {},
    }[name]
    assert torch.allclose(merge(name, base, experts, **params), experts[0], atol=1e-6)


@SETTINGS
@given(tensors(), st.sampled_from(["inverse_density", "l1"]), st.floats(-2.0, 2.0), st.data())
def test_dare_with_density_one_is_task_arithmetic_and_ties(data, rescale, lam, draw):
    base, experts = data
    weights = draw.draw(st.lists(st.floats(0.1, 2.0), min_size=len(experts), max_size=len(experts)))
    expected = merge("task_arithmetic", base, experts, lambda_=lam, weights=weights)
    got = merge("dare_linear", base, experts, lambda_=lam, weights=weights, density=1.0, rescale=rescale)
    assert torch.equal(got, expected)
    for sign_rule in ("sum", "count"):
        for before in (False, True):
            tie = dict(lambda_=lam, weights=weights, density=1.0, sign_rule=sign_rule, weights_before_election=before)
            assert torch.allclose(
                merge("dare_ties", base, experts, rescale=rescale, **tie),
                merge("ties", base, experts, **tie),
                atol=1e-6,
            )


@SETTINGS
@given(
    tensors(shapes=((16, 16), (9, 30))), st.sampled_from(RANDOM_METHODS), st.floats(0.1, 0.9), st.integers(0, 2**31 - 1)
)
def test_a_seed_fixes_the_output_and_another_seed_changes_it(data, name, density, seed):
    base, experts = data
    params = {"density": density}
    if name.startswith("della"):
        params["epsilon"] = min(density, 1 - density) / 2
    a = merge(name, base, experts, seed=seed, **params)
    assert torch.equal(a, merge(name, base, experts, seed=seed, **params))
    # >= 256 entries, each kept with probability in [0.05, 0.95]: two seeds agree on every draw
    # with probability <= 0.905 ** 256 < 1e-11.
    assert not torch.equal(a, merge(name, base, experts, seed=seed + 1, **params))


@settings(max_examples=20, deadline=None)
@given(tensors(max_experts=1, shapes=((8, 8),)), st.floats(0.2, 0.9), st.integers(0, 2**31 - 1))
def test_dare_keeps_density_and_is_unbiased(data, density, seed):
    """Over SEEDS generators: kept fraction ~ density and mean rescaled delta ~ delta.

    Kept count ~ Binomial(n * SEEDS, density), so the fraction has standard deviation
    sqrt(density (1 - density) / (n SEEDS)) <= 0.0013 here; each entry's mean of m * d / density has
    standard deviation |d| sqrt((1 - density) / (density SEEDS)). Both bounds are 7 standard deviations
    (a false alarm per check < 1e-11 under the normal approximation, still tiny for the binomial tails
    with >= 80 expected kept draws per entry), plus 1e-6 for float32 rounding.
    """
    _, (delta,) = data
    n = delta.numel()
    outs = torch.stack(
        [dare_drop(delta, density, "inverse_density", Draws(seed + i, "w"), 0) for i in range(SEEDS)]
    ).double()
    kept = (outs != 0).double().mean()
    assert abs(kept - density) <= 7 * math.sqrt(density * (1 - density) / (n * SEEDS))
    sd = delta.double().abs() * math.sqrt((1 - density) / (density * SEEDS))
    assert ((outs.mean(0) - delta.double()).abs() <= 7 * sd + 1e-6).all()
    # every kept entry is exactly delta / density
    ratio = outs / delta.double()
    assert torch.allclose(ratio[outs != 0], torch.full_like(ratio[outs != 0], 1 / density), rtol=1e-6)


@SETTINGS
@given(tensors(max_experts=1), st.floats(0.05, 0.95), st.integers(0, 2**31 - 1))
def test_dare_l1_rescale_keeps_the_l1_norm(data, density, seed):
    _, (delta,) = data
    out = dare_drop(delta, density, "l1", Draws(seed, "w"), 0)
    if (out != 0).any():
        assert torch.allclose(out.abs().sum(), delta.abs().sum(), rtol=1e-5)
        assert torch.equal(out != 0, (out / delta) > 0)  # kept entries keep their sign, others are 0


def test_breadcrumbs_keeps_exactly_the_intended_entries():
    delta = torch.tensor([0.1, -5.0, 3.0, -0.2, 2.0, 1.0, -4.0, 0.5, 0.3, 6.0])
    # n = 10: gamma 0.2 drops the 2 largest |.| (6, -5); density 0.4 keeps the next 4 (-4, 3, 2, 1).
    expected = torch.tensor([0.0, 0.0, 3.0, 0.0, 2.0, 1.0, -4.0, 0.0, 0.0, 0.0])
    assert torch.equal(breadcrumbs_mask(delta, 0.4, 0.2), expected)
    base = torch.ones(10)
    out = merge(
        "breadcrumbs", base, [base + delta, base - delta], density=0.4, gamma=0.2, weights=[2.0, 1.0], lambda_=0.5
    )
    assert torch.allclose(out, base + 0.5 * (2 * expected - expected))
    # gamma below 1/n drops no outlier
    assert torch.equal(breadcrumbs_mask(delta, 0.2, 0.05), torch.tensor([0.0, -5.0] + [0.0] * 7 + [6.0]))


def test_breadcrumbs_outliers_tied_at_the_cut_go_by_position():
    # n = 10, gamma 0.2: two of the three tied 6s are outliers, the first two by position; density 0.2 keeps
    # the next two: the third 6, then the first of the tied 3s
    delta = torch.tensor([1.0, 6.0, -3.0, -6.0, 3.0, 0.5, 6.0, 2.0, 0.1, -0.2])
    expected = torch.tensor([0.0, 0.0, -3.0, 0.0, 0.0, 0.0, 6.0, 0.0, 0.0, 0.0])
    assert torch.equal(breadcrumbs_mask(delta, 0.2, 0.2), expected)


@SETTINGS
@given(st.lists(st.integers(-3, 3), min_size=2, max_size=40), st.floats(0.05, 0.95), st.floats(0.0, 0.5))
def test_breadcrumbs_equals_a_stable_sort_of_the_magnitudes(values, density, gamma):
    """Many ties (small integers): the kept band is positions n_top .. n_top + k of a stable descending sort."""
    delta = torch.tensor(values, dtype=torch.float32)
    n = delta.numel()
    n_top = int(gamma * n + 1e-9)
    density = min(density, 1 - gamma)
    order = torch.sort(delta.abs(), descending=True, stable=True).indices
    rest = delta.clone()
    rest[order[:n_top]] = 0
    reference = torch.zeros_like(delta)
    band = torch.sort(rest.abs(), descending=True, stable=True).indices[: max(1, math.ceil(density * n))]
    reference[band] = rest[band]
    assert torch.equal(breadcrumbs_mask(delta, density, gamma), reference)


@SETTINGS
@given(tensors(), st.floats(0.05, 0.95), st.floats(0.0, 0.5))
def test_breadcrumbs_keeps_a_middle_band_of_magnitudes(data, density, gamma):
    _, experts = data
    delta = experts[0]
    density = min(density, 1 - gamma)
    out = breadcrumbs_mask(delta, density, gamma)
    n = delta.numel()
    n_top = int(gamma * n + 1e-9)
    kept = out != 0
    assert int(kept.sum()) == min(max(1, math.ceil(density * n)), n - n_top)
    assert torch.equal(out[kept], delta[kept])
    mags = delta.abs().flatten().sort(descending=True).values
    if n_top:
        assert delta[kept].abs().max() <= mags[n_top]  # nothing above the outlier band survives
    dropped = delta.abs()[~kept]
    below = dropped[dropped < delta[kept].abs().min()]
    assert below.numel() == n - n_top - int(kept.sum())  # all the rest are below the kept band


@SETTINGS
@given(tensors(min_experts=2), st.floats(0.05, 1.0))
def test_breadcrumbs_ties_without_outliers_is_ties(data, density):
    base, experts = data
    assert torch.allclose(
        merge("breadcrumbs_ties", base, experts, density=density, gamma=0.0),
        merge("ties", base, experts, density=density),
        atol=1e-6,
    )


@SETTINGS
@given(tensors(), st.floats(0.1, 0.9), st.floats(0.0, 1.0))
def test_della_keep_probabilities_span_the_band_by_magnitude(data, density, frac):
    _, experts = data
    delta = experts[0]
    eps = frac * min(density, 1 - density) * 0.99
    p = della_keep_prob(delta, density, eps).flatten()
    order = delta.abs().flatten().argsort(stable=True)
    assert torch.all(p[order].diff() >= 0)  # larger magnitude -> higher keep probability
    assert p.min().item() == pytest.approx(density - eps, abs=1e-6)
    assert p.max().item() == pytest.approx(density + eps, abs=1e-6)
    assert p.mean().item() == pytest.approx(density, abs=1e-5)


def sorted_ranks(delta: torch.Tensor, rank_scope: str) -> torch.Tensor:
    """The reference ranks: positions of a stable ascending sort of |delta| per row (ties by position), / (n - 1)."""
    rows = delta.reshape(delta.shape[0], -1) if rank_scope == "row" and delta.dim() >= 2 else delta.reshape(1, -1)
    n = rows.shape[1]
    rank = torch.empty(rows.shape)
    rank.scatter_(
        1,
        torch.sort(rows.abs(), dim=1, stable=True).indices,
        (torch.arange(n, dtype=torch.float32) / (n - 1)).expand(rows.shape[0], n).contiguous(),
    )
    return rank.view_as(delta)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=3),
    st.integers(1, 6),
    st.sampled_from(["tensor", "row"]),
    st.sampled_from([None, "finite", "infinite"]),
    st.integers(0, 2**31 - 1),
)
def test_della_ranks_are_a_stable_sorts_bit_for_bit(shape, levels, rank_scope, extreme, seed):
    # few distinct magnitudes of both signs and zeros of both signs: many ties, kept by position; the int64-key
    # sort (sparsify._placed_by_rank) must give torch's stable sort's ranks, and so the same probabilities
    g = torch.Generator().manual_seed(seed)
    delta = torch.randint(-levels, levels + 1, shape, generator=g).float() * 0.375
    if extreme:  # subnormals, the largest finite float and -0.0 order by their bits; an infinity: torch's sort
        flat = delta.view(-1)
        big = float("inf") if extreme == "infinite" else 3.4e38
        flat[::4] = torch.tensor([1e-45, -3.4e38, big, -0.0, 5e-39])[torch.arange(flat[::4].numel()) % 5]
    p = della_keep_prob(delta, 0.5, 0.25, rank_scope)
    row_length = delta[0].numel() if rank_scope == "row" and delta.dim() >= 2 else delta.numel()
    if row_length == 1:  # one entry per group: p = density
        assert torch.equal(p, torch.full_like(delta, 0.5))
    else:
        assert torch.equal(p, (0.5 - 0.25) + 2.0 * 0.25 * sorted_ranks(delta, rank_scope))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=3),
    st.integers(1, 6),
    st.sampled_from(["tensor", "row"]),
    st.sampled_from(["inverse_prob", "l1", "none"]),
    st.integers(1, 7),
    st.integers(0, 2**31 - 1),
)
def test_magprune_is_its_formula_bit_for_bit_whatever_the_key_chunks(shape, levels, rank_scope, rescale, chunk, seed):
    # della_magprune in place and in fewer temporaries (sparsify.py) against its definition written out:
    # m = [u < p] with u the draws' uniforms of expert 0, then m * d / p (or as is, or L1-matched); and
    # one-row keys numbered in chunks of any size (KEY_CHUNK, 1M columns, made small) give the same ranks
    from mergeval.methods import sparsify
    from mergeval.methods.task_vector import match_l1

    g = torch.Generator().manual_seed(seed)
    delta = torch.randint(-levels, levels + 1, shape, generator=g).float() * 0.375 + torch.randn(shape, generator=g)
    density, eps = 0.6, 0.3
    reference_p = della_keep_prob(delta, density, eps, rank_scope)
    kept = torch.where(
        Draws(seed, "w").uniform(0, delta.shape) < reference_p,
        delta,
        torch.zeros_like(delta),
    )
    expected = {"inverse_prob": lambda: kept / reference_p, "none": lambda: kept, "l1": lambda: match_l1(delta, kept)}[
        rescale
    ]()
    before = delta.clone()
    chunk_was = sparsify.KEY_CHUNK
    try:
        sparsify.KEY_CHUNK = chunk
        assert torch.equal(della_keep_prob(delta, density, eps, rank_scope), reference_p)
        got = della_magprune(delta, density, eps, rescale, Draws(seed, "w"), 0, rank_scope)
    finally:
        sparsify.KEY_CHUNK = chunk_was
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # -0.0 and +0.0 told apart
    assert torch.equal(delta, before)  # the input is left as it was


@settings(max_examples=20, deadline=None)
@given(tensors(max_experts=1, shapes=((8, 8),)), st.floats(0.3, 0.7), st.integers(0, 2**31 - 1))
def test_della_is_unbiased(data, density, seed):
    """Mean over SEEDS of m * d / p ~ d; same 7-standard-deviation bound as DARE, with p >= 0.15."""
    _, (delta,) = data
    eps = 0.15
    p = della_keep_prob(delta, density, eps).double()
    outs = torch.stack(
        [della_magprune(delta, density, eps, "inverse_prob", Draws(seed + i, "w"), 0) for i in range(SEEDS)]
    ).double()
    sd = delta.double().abs() * torch.sqrt((1 - p) / (p * SEEDS))
    assert ((outs.mean(0) - delta.double()).abs() <= 7 * sd + 1e-6).all()


@SETTINGS
@given(tensors(), st.floats(0.05, 1.0), st.integers(0, 2**31 - 1), st.sampled_from(["sum", "count"]))
def test_della_without_epsilon_is_dare(data, density, seed, sign_rule):
    base, experts = data
    assert torch.equal(
        merge("della", base, experts, seed=seed, density=density, epsilon=0.0, sign_rule=sign_rule),
        merge("dare_ties", base, experts, seed=seed, density=density, sign_rule=sign_rule),
    )
    assert torch.equal(
        merge("della_linear", base, experts, seed=seed, density=density, epsilon=0.0),
        merge("dare_linear", base, experts, seed=seed, density=density),
    )


def test_sce_by_hand():
    base = torch.zeros(4)
    a = torch.tensor([1.0, -2.0, 3.0, 0.0])
    b = torch.tensor([3.0, 1.0, -1.0, 0.0])
    # energies 14, 11 -> w = 14/25, 11/25; sum [4, -1, 2, 0] -> signs [+, -, +, 0]
    out = merge("sce", base, [a, b])
    assert torch.allclose(out, torch.tensor([47 / 25, -28 / 25, 42 / 25, 0.0]))
    assert torch.allclose(merge("sce", base, [a, b], normalize=True), torch.tensor([47 / 25, -2.0, 3.0, 0.0]))
    # variances [1, 2.25, 4, 0]: the top half keeps entries 2 and 1; energies 13, 2
    out = merge("sce", base, [a, b], select_topk=0.5, lambda_=2.0)
    assert torch.allclose(out, 2.0 * torch.tensor([0.0, -26 / 15, 39 / 15, 0.0]))


@SETTINGS
@given(st.lists(st.tuples(st.integers(-2, 2), st.integers(-2, 2)), min_size=2, max_size=40), st.floats(0.05, 0.95))
def test_sce_selects_the_first_of_a_stable_variance_sort(pairs, fraction):
    """Small integers: tied variances everywhere, zero variance where both experts moved alike (kept or not,
    by position, matters there); the selection is the first k of a stable descending sort of the variances."""
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    base = torch.zeros_like(a)
    k = max(1, math.ceil(fraction * a.numel()))
    variance = torch.stack([a, b]).sort(0).values.var(0, unbiased=False)
    keep = torch.zeros_like(a, dtype=torch.bool)
    keep[torch.sort(variance, descending=True, stable=True).indices[:k]] = True
    selected = merge("sce", base, [a * keep, b * keep], select_topk=1.0)
    assert torch.equal(merge("sce", base, [a, b], select_topk=fraction), selected)


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
