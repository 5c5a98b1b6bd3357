"""mergeval/methods/masks.py: RAM's, RAM+'s and Arcee Fusion's definitions and invariants (mergekit's own methods:
tests/methods/test_mergekit_parity.py holds them to mergekit 0.1.5's tensors; Consensus TA and Localize-and-Stitch are
tested with the other methods, test_cli_methods.py and test_layers.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.methods import get_method
from mergeval.methods.draws import Draws
from mergeval.methods.masks import fusion_importance

RAM, RAMPLUS, FUSION = get_method("ram"), get_method("ramplus_tl"), get_method("arcee_fusion")


def merge(method, base: torch.Tensor, experts: list[torch.Tensor], **params) -> torch.Tensor:
    cfg = method.config(**params)
    method.validate(cfg, len(experts))
    return method.merge(base, experts, cfg, Draws(0, "w"))


values = st.floats(-2, 2, width=32)
# (base, experts): 1 to 6 experts (above 4 the sum over experts is no longer torch's own order) of 1 to 48 entries
inputs = st.tuples(st.integers(1, 48), st.integers(1, 6)).flatmap(
    lambda nk: st.tuples(
        st.lists(values, min_size=nk[0], max_size=nk[0]),
        st.lists(st.lists(values, min_size=nk[0], max_size=nk[0]), min_size=nk[1], max_size=nk[1]),
    )
)
epsilons = st.sampled_from([0.0, 1e-5, 0.1, 0.5, 1.0])


def tensors(pair) -> tuple[torch.Tensor, list[torch.Tensor]]:
    base, experts = pair
    return torch.tensor(base), [torch.tensor(e) for e in experts]


# ---------------------------------------------------------------- RAM


@settings(max_examples=150, deadline=None)
@given(inputs, epsilons)
def test_ram_is_the_mean_change_of_the_experts_that_changed_each_entry(pair, epsilon):
    b, es = tensors(pair)
    d = torch.stack([e - b for e in es])
    a = d.abs() > epsilon  # in float32, as the method (and mergekit) compare
    expected = b.double() + (d.double() * a).sum(0) / a.sum(0).clamp(min=1)
    # up to 6 float32 roundings of terms up to 4
    torch.testing.assert_close(merge(RAM, b, es, epsilon=epsilon).double(), expected, atol=5e-6, rtol=1e-6)


@settings(max_examples=150, deadline=None)
@given(inputs, epsilons)
def test_entries_no_expert_changed_by_more_than_epsilon_stay_the_base_s(pair, epsilon):
    b, es = tensors(pair)
    untouched = torch.stack([(e - b).abs() <= epsilon for e in es]).all(0)
    for method, params in [(RAM, {}), (RAMPLUS, {}), (RAMPLUS, {"r": 2.0, "alpha": 3.0})]:
        merged = merge(method, b, es, epsilon=epsilon, **params)
        assert torch.equal(merged[untouched], b[untouched])


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 48).flatmap(
        lambda n: st.tuples(
            st.lists(values, min_size=n, max_size=n),
            st.lists(st.floats(2**-6, 2, width=32) | st.floats(-2, -(2**-6), width=32), min_size=n, max_size=n),
            st.lists(st.integers(-1, 4), min_size=n, max_size=n),
        )
    ),
    st.integers(1, 5),
)
def test_ram_of_disjoint_task_vectors_is_task_arithmetic_bit_for_bit(data, n_experts):
    """Each entry changed by one expert at most: it takes that expert's change, as task arithmetic's sum does."""
    base, change, owner = (torch.tensor(x) for x in data)
    experts = [torch.where(owner == i, base + change, base) for i in range(n_experts)]
    ta = get_method("task_arithmetic")
    assert torch.equal(merge(RAM, base, experts), merge(ta, base, experts))
    assert torch.equal(merge(RAMPLUS, base, experts, r=0.0), merge(ta, base, experts))


@settings(max_examples=100, deadline=None)
@given(inputs, st.integers(1, 6))
def test_ram_of_identical_task_vectors_is_their_mean(pair, copies):
    """Identical experts: every changed entry is shared by all (or the one), so RAM is their mean: the expert."""
    b, (e, *_) = tensors(pair)
    merged = merge(RAM, b, [e] * copies, epsilon=0.0)
    linear = merge(get_method("linear"), b, [e] * copies)  # the mean of the copies
    torch.testing.assert_close(merged, linear, atol=5e-6, rtol=1e-6)
    if copies <= 2:  # d / 2 + d / 2 == d exactly, where halving d is exact (not for the subnormals' last bit)
        d = e - b
        exact = (d == 0) | (d.abs() >= 2 * torch.finfo(torch.float32).tiny)  # d / 2 is then representable
        assert torch.equal(merged[exact], (b + d)[exact])


# ---------------------------------------------------------------- RAM+


@settings(max_examples=150, deadline=None)
@given(inputs, epsilons, st.floats(0, 3), st.floats(0, 3))
def test_ramplus_with_r_0_is_ram_bit_for_bit_and_else_scales_only_the_unique_entries(pair, epsilon, r, alpha):
    b, es = tensors(pair)
    ram = merge(RAM, b, es, epsilon=epsilon)
    assert torch.equal(merge(RAMPLUS, b, es, epsilon=epsilon, r=0.0, alpha=alpha), ram)
    plus = merge(RAMPLUS, b, es, epsilon=epsilon, r=r, alpha=alpha)
    d = torch.stack([e - b for e in es])
    a = d.abs() > epsilon
    unique = a.sum(0) == 1
    assert torch.equal(plus[~unique], ram[~unique])  # shared and untouched entries: RAM's
    # a unique entry: its one expert's change times lambda_t in [1, 1 + r alpha]
    change, base = (d * a).sum(0)[unique].double(), b[unique].double()
    ends = torch.stack([base + change, base + change * (1 + r * alpha)])
    slack = 1e-6 * (base.abs() + change.abs() * (1 + r * alpha))
    got = plus[unique].double()
    assert bool(((got >= ends.min(0).values - slack) & (got <= ends.max(0).values + slack)).all())


def test_ramplus_hand_computed():
    """Expert 0 changes entries 0-3, expert 1 entries 2-4: expert 0 has 2 unique and 2 shared (rho = 1), expert 1
    1 unique and 2 shared (rho = 2); r = 0.5, alpha = 1.5: lambda = 1.5 and 1.75."""
    b = torch.zeros(6)
    e0 = torch.tensor([1.0, 2.0, 4.0, 8.0, 0.0, 0.0])
    e1 = torch.tensor([0.0, 0.0, 2.0, 4.0, 16.0, 0.0])
    expected = torch.tensor([1.5, 3.0, 3.0, 6.0, 16.0 * 1.75, 0.0])
    assert torch.equal(merge(RAMPLUS, b, [e0, e1], r=0.5, alpha=1.5), expected)
    assert torch.equal(merge(RAM, b, [e0, e1]), torch.tensor([1.0, 2.0, 3.0, 6.0, 16.0, 0.0]))


def test_ramplus_with_epsilon_0_and_an_expert_equal_to_the_base_stays_finite():
    """rho = 0 / 0 for that expert (mergekit 0.1.5 returns NaN for the whole tensor): here it is 0."""
    b, e = torch.zeros(4), torch.tensor([1.0, 0.0, -2.0, 3.0])
    assert torch.equal(merge(RAMPLUS, b, [e, b.clone()], epsilon=0.0), merge(RAMPLUS, b, [e], epsilon=0.0))


# ---------------------------------------------------------------- Arcee Fusion


matrices = st.tuples(st.integers(1, 6), st.integers(1, 12)).flatmap(
    lambda shape: st.tuples(
        st.just(shape), *[st.lists(values, min_size=shape[0] * shape[1], max_size=shape[0] * shape[1])] * 2
    )
)


@settings(max_examples=100, deadline=None)
@given(matrices)
def test_arcee_fusion_takes_each_entry_from_the_base_or_the_expert_the_most_important_first(data):
    shape, base, expert = data
    b, e = torch.tensor(base).view(shape), torch.tensor(expert).view(shape)
    merged = merge(FUSION, b, [e])
    moved = b + (e - b)  # the expert's entry as the formula rounds it
    took = merged != b
    assert torch.equal(merged[took], moved[took])
    assert torch.equal(merge(FUSION, b, [b.clone()]), b)  # the expert equal to the base: the base
    importance = fusion_importance(b, e)
    if bool((took & (moved != b)).any()):  # every entry as important as one taken is taken (where it shows)
        assert not bool((~took & (importance >= importance[took].min()) & (moved != b)).any())


def test_arcee_fusion_hand_computed():
    """One row, changes 1..7 and 40: the importances are the changes times one KL; Q1, median and Q3 are the
    2nd, 4th and 6th smallest (2, 4, 6 times it), so theta = 10 times it and only the change of 40 is taken."""
    b = torch.zeros(8)
    e = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 40.0]) * 0.1
    assert torch.equal(merge(FUSION, b, [e]), torch.tensor([0.0] * 7 + [4.0]))


def test_arcee_fusion_takes_the_quartiles_of_every_entry_above_a_million():
    """mergekit 0.1.5 draws 10^6 entries (unseeded) for the quartiles of larger tensors; mergeval uses all of them:
    the fence is the one a full sort gives, and the merge is the same on every call."""
    g = torch.Generator().manual_seed(1)
    b = torch.randn(1100, 1000, generator=g)
    e = b + 0.01 * torch.randn(1100, 1000, generator=g)
    importance = fusion_importance(b, e)
    ordered = importance.flatten().sort().values
    n = ordered.numel()
    q1, median, q3 = (ordered[j * (n - 1) // 4] for j in (1, 2, 3))
    expected = b + (e - b) * (importance >= median + 1.5 * (q3 - q1))
    merged = merge(FUSION, b, [e])
    assert torch.equal(merged, expected) and torch.equal(merge(FUSION, b, [e]), merged)
    assert 0 < int((merged != b).sum()) < n // 4


def test_arcee_fusion_keeps_a_row_whose_softmax_did_not_change():
    """Adding a constant to a row leaves its softmax, so its KL (~0) and importances, below the fence."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(8, 16, generator=g)
    e = b + 0.5 * torch.randn(8, 16, generator=g)
    e[3] = b[3] + 2.0
    merged = merge(FUSION, b, [e])
    assert torch.equal(merged[3], b[3]) and not torch.equal(merged, b)


def test_the_results_keep_the_base_dtype():
    b = torch.zeros(8, dtype=torch.bfloat16)
    e = torch.arange(8, dtype=torch.bfloat16)
    for method in (RAM, RAMPLUS, FUSION):
        assert merge(method, b, [e]).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "method,params,experts,field",
    [
        (RAM, {"epsilon": -1e-5}, 2, "method.epsilon"),
        (RAM, {"epsilon": float("nan")}, 2, "method.epsilon"),
        (RAMPLUS, {"epsilon": -1.0}, 2, "method.epsilon"),
        (RAMPLUS, {"r": float("inf")}, 2, "method.r"),
        (RAMPLUS, {"alpha": -0.1}, 2, "method.alpha"),
        (RAMPLUS, {"compat": "nope"}, 2, "method.compat"),
        (FUSION, {}, 2, "modelset.experts"),
        (FUSION, {}, 0, "modelset.experts"),
    ],
)
def test_bad_settings_name_the_field(method, params, experts, field):
    with pytest.raises(UserError) as err:
        method.validate(method.config(**params), experts)
    assert err.value.field == field
