"""The in-place forms of the merge kernels give the bits of the plain formulas they replaced.

weighted_sum, disjoint_merge and TIES' row-block trim reuse buffers instead of allocating a temporary
per product; each is checked here against the straightforward expression (Python's ``sum``, the
``where``-based mask) on values chosen to catch an order or sign-of-zero change: -0.0, subnormals,
ties at the cut, weights of 1 and not 1.
"""

from __future__ import annotations

import types

import torch
from hypothesis import given
from hypothesis import strategies as st

import mergeval.methods.select as select
from mergeval.methods.draws import Draws
from mergeval.methods.select import Threshold, exact, first_ties_drop, first_ties_mask, keep_only_, zero_dropped_
from mergeval.methods.task_vector import disjoint_merge, sign_of_sum, weighted_sum

VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, -0.75, 3.0, 1e-40, -1e-40, 2.0**-20, 1e30, -7.25])
WEIGHTS = st.sampled_from([1.0, 0.5, -0.25, 2.0, 1.0, 1.0])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@st.composite
def stacks(draw, max_n: int = 6):
    n = draw(st.integers(1, max_n))
    m = draw(st.integers(1, 40))
    data = draw(st.lists(VALUES, min_size=n * m, max_size=n * m))
    return torch.tensor(data, dtype=torch.float32).view(n, m)


@given(stacks(), st.lists(WEIGHTS, min_size=6, max_size=6))
def test_weighted_sum_is_pythons_sum_bit_for_bit(terms, w):
    w = w[: terms.shape[0]]
    expected = sum(wi * t for wi, t in zip(w, terms.clone()))
    got = weighted_sum(list(terms.clone()), w, terms[0])
    assert torch.equal(bits(got), bits(expected + torch.zeros_like(terms[0])))  # sum([]) is 0: a tensor here


def in_order(stacked: torch.Tensor) -> torch.Tensor:
    """The sum over the experts as the definition adds them: in order, from +0.0 (torch's ``sum(0)`` may pair
    them otherwise, which moves a sum such as 1e30 + 1e30 + 5e29 by one ulp)."""
    total = torch.zeros_like(stacked[0])
    for row in stacked:
        total = total + row
    return total


def reference_disjoint_merge(sparse: torch.Tensor, cfg) -> torch.Tensor:
    """disjoint_merge as it was written before the in-place form (paper mode)."""
    w = cfg.weights or [1.0] * sparse.shape[0]
    wt = torch.tensor(w, dtype=torch.float32).view(-1, *([1] * (sparse.dim() - 1)))
    unit = all(x == 1.0 for x in w)
    weighted = sparse if unit else wt * sparse
    voters = weighted if cfg.weights_before_election else sparse
    gamma = sign_of_sum(voters) if cfg.sign_rule == "sum" else torch.sign(torch.sign(voters).sum(0))
    agree = ((sparse * gamma) > 0).to(sparse.dtype)
    tau = in_order(weighted * agree)
    if not cfg.normalize:
        return tau
    mass = in_order(agree if unit else wt * agree)
    return tau / mass.where(mass != 0, torch.ones_like(mass))


@given(
    stacks(),
    st.lists(WEIGHTS, min_size=6, max_size=6),
    st.booleans(),
    st.sampled_from(["sum", "count"]),
    st.booleans(),
    st.booleans(),
)
def test_disjoint_merge_gives_the_plain_formulas_bits(sparse, w, weighted, sign_rule, before, normalize):
    cfg = types.SimpleNamespace(
        weights=w[: sparse.shape[0]] if weighted else None,
        sign_rule=sign_rule,
        weights_before_election=before,
        normalize=normalize,
        compat="paper",
    )
    expected = reference_disjoint_merge(sparse.clone(), cfg)
    given_in = sparse.clone()
    got = disjoint_merge(given_in, cfg)
    assert torch.equal(bits(got), bits(expected))
    assert torch.equal(bits(given_in), bits(sparse))  # the input is left as it was


@given(st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0]), min_size=1, max_size=60), st.integers(0, 60))
def test_first_ties_drop_is_the_masks_complement(values, quota):
    a = torch.tensor(values)
    tau = 2.0
    quota = min(quota, int((a == tau).sum()))
    assert torch.equal(first_ties_drop(a, tau, quota), ~first_ties_mask(a, tau, quota))


@given(
    st.lists(
        st.sampled_from(
            [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 1e-45, -1e-45, 3.4e38, float("inf"), -float("inf"), float("nan")]
        ),
        min_size=1,
        max_size=80,
    ),
    st.sampled_from([0.0, 1e-45, 1.0, 2.0, 3.4e38, float("inf")]),
    st.floats(0.0, 1.0),
    st.booleans(),
)
def test_zero_dropped_is_masked_fill_of_the_drop_mask_bit_for_bit(values, tau, share, view_of_a_row):
    """The bit-level fast path (float32 on the CPU) against the torch formula it replaces: NaN kept, -0.0 and
    the tied entries past the quota dropped to +0.0, infinities compared as magnitudes."""
    d = torch.tensor(values, dtype=torch.float32)
    quota = int(share * int((d.abs() == tau).sum()))  # how many of the entries tied at the cut are kept
    expected = d.clone().masked_fill_(first_ties_drop(d.abs(), tau, quota), 0.0)
    if view_of_a_row:  # as TiesRows.trim_ gets it: one expert's row of the stack
        stack = torch.stack([torch.full_like(d, 5.0), d, torch.full_like(d, -5.0)])
        got = zero_dropped_(stack[1], tau, quota)
        assert torch.equal(bits(stack[0]), bits(torch.full_like(d, 5.0))) and torch.equal(bits(got), bits(stack[1]))
    else:
        got = zero_dropped_(d.clone(), tau, quota)
    assert torch.equal(bits(got), bits(expected))


@given(
    st.lists(
        st.tuples(st.sampled_from([0.0, -0.0, 1.0, -2.5, 1e-45, -1e-45, float("inf"), float("nan")]), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_keep_only_is_masked_fill_of_the_complement_bit_for_bit(pairs):
    """DARE's sparsifier in row blocks (rows.DareRows): the kept entries as they were, the others +0.0."""
    d = torch.tensor([v for v, _ in pairs], dtype=torch.float32)
    keep = torch.tensor([k for _, k in pairs])
    expected = d.clone().masked_fill_(~keep, 0.0)
    assert torch.equal(bits(keep_only_(d.clone(), keep)), bits(expected))


@given(
    st.lists(st.sampled_from([0.0, 1e-40, 0.25, 0.5, 1.0, 2.0, 4.0, float("inf")]), min_size=1, max_size=7),
    st.integers(0, 2**31),
    st.floats(0.0, 1.0),
    st.integers(1, 9),
)
def test_thresholds_numpy_count_is_its_torch_count(palette, seed, fraction, chunks):
    """Threshold.count by NumPy (float32 on the CPU) gives the torch path's candidates, counts and ties on
    tensors large enough for finite sampled bounds, with many ties at the cut."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.tensor(palette)[torch.randint(0, len(palette), (120_000,), generator=gen)]
    k = max(1, min(a.numel(), round(fraction * a.numel())))
    found = {}
    for fast in (True, False):
        t = Threshold(a.numel(), k)
        pieces = a.tensor_split(chunks)
        for p in pieces:
            t.sample(p)
        original = select._plain_cpu_float32
        select._plain_cpu_float32 = original if fast else (lambda x: False)
        try:
            for p in pieces:
                t.count(p)
        finally:
            select._plain_cpu_float32 = original
        found[fast] = (t.result(), t.chunk_ties)
    assert found[True] == found[False]
    if found[True][0] is not None:
        assert found[True][0] == exact(a, k)


@given(
    st.lists(st.sampled_from([0.0, 1e-40, 0.25, 0.5, 1.0, 2.0, 4.0]), min_size=40, max_size=400),
    st.integers(1, 400),
    st.integers(1, 7),
)
def test_threshold_counts_chunks_handed_in_one_reused_buffer(values, k, chunks):
    a = torch.tensor(values)
    k = min(k, a.numel())
    pieces = a.tensor_split(chunks)
    t = Threshold(a.numel(), k)
    for p in pieces:
        t.sample(p)
    buffer = torch.empty(max(p.numel() for p in pieces))
    for p in pieces:  # as TiesRows.prepare: every chunk's |d_i| computed into the same buffer
        view = buffer[: p.numel()]
        view.copy_(p)
        t.count(view)
        buffer.fill_(float("nan"))  # the caller reuses its buffer: what was handed in must not be kept
    found = t.result()
    if found is not None:
        assert found == exact(a, k)
        assert sum(t.chunk_ties) == found[2]


def reference_cmm(base: torch.Tensor, experts: list[torch.Tensor], cfg, gen) -> torch.Tensor:
    """cmm's additive and interpolate updates as written before the in-place form."""
    from mergeval.methods.curriculum import merge_order, schedule

    b = base.float()
    theta = b.clone()
    order = merge_order(cfg.order, cfg.validation_scores, len(experts))
    for c, i in zip(schedule(cfg.schedule, cfg.start, cfg.end, len(experts)), order):
        e = experts[i].float()
        theta = theta + c * (e - b) if cfg.update == "additive" else (1 - c) * theta + c * e
    return (b + cfg.lambda_ * (theta - b)).to(base.dtype)


@given(
    stacks(max_n=5),
    st.sampled_from(["additive", "interpolate"]),
    st.sampled_from([1.0, 0.7, -0.5]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.sampled_from(["linear", "constant"]),
)
def test_cmm_in_place_gives_the_plain_updates_bits(models, update, lam, dtype, kind):
    from mergeval.methods import get_method

    if models.shape[0] < 2:
        return
    method = get_method("cmm")
    cfg = method.config(update=update, lambda_=lam, order="given", start=0.3, end=0.6, schedule=kind)
    base, experts = models[0].to(dtype), [m.to(dtype) for m in models[1:]]
    got = method.merge(base, [e.clone() for e in experts], cfg, Draws(0, "w"))
    expected = reference_cmm(base, experts, cfg, Draws(0, "w"))
    assert torch.equal(
        got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
    assert torch.equal(base, models[0].to(dtype))  # the base is left as it was
