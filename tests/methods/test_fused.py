"""The compiled kernels (mergeval/methods/fused.py) give the torch code's bits.

``keep`` and ``uniform`` (the counter-based draws) against the torch definition in ``draws.py``, at any
offset, beyond 2^32 included; ``merge_rows`` against ``sparsify._combine`` with the row-block sparsifier it replaces (DARE's
``keep_only_`` and divide), with TIES' election or the weighted sum, on values chosen to catch an order, rounding or
sign-of-zero change: -0.0, subnormals, infinities, NaN, huge values, deltas that cancel, weights of 1 and
not 1, bfloat16 inputs, up to eight experts. And what ``task_vector.sum_in_order`` relies on: torch's sum over
the experts' axis adds the rows in order from +0.0 for up to TORCH_ROWS_IN_ORDER rows.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.methods import draws, fused, get_method
from mergeval.methods.select import keep_only_
from mergeval.methods.sparsify import _combine
from mergeval.methods.task_vector import TORCH_ROWS_IN_ORDER, sum_in_order

pytestmark = pytest.mark.skipif(not fused.available(), reason="numba is not installed")

SPECIAL = [
    0.0,
    -0.0,
    1e-45,
    -1e-45,
    1e-38,
    -3e38,
    3e38,
    float("inf"),
    float("-inf"),
    float("nan"),
    1.0,
    -1.0,
    2.0,
    -2.0,
    0.5,
]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, any NaN equal to any NaN (torch and the kernel may carry different NaN payloads)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = torch.int32 if a.dtype == torch.float32 else torch.int16
    equal = a.view(ints) == b.view(ints)
    return bool((equal | (a.isnan() & b.isnan())).all())


# ---------------------------------------------------------------- the draws

STARTS = st.one_of(
    st.integers(0, 10**7), st.integers(2**32 - 3000, 2**32 + 3000), st.integers(2**32, 2**44), st.just(2**63 - 5001)
)


@settings(max_examples=80, deadline=None)
@given(
    key=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    start=STARTS,
    n=st.integers(0, 5000),
    density=st.sampled_from([0.0, 1e-9, 0.1, 0.5, 0.6, 0.7, 0.9, 0.999999999, 1 - 2**-25, 1.0]),
)
def test_the_compiled_draws_are_the_definitions(key, start, n, density):
    """Bit for bit at any offset (not a multiple of anything, across the counter's high word, beyond 2^32)."""
    assert torch.equal(fused.uniform(key, start, n), draws.uniform(key, start, n))
    assert torch.equal(fused.keep(key, start, n, draws.keep_threshold(density)), draws.keep(key, start, n, density))


def test_the_compiled_draws_of_row_blocks_are_the_whole_tensors():
    key = (0x13198A2E, 0x03707344)
    start, sizes = 2**32 - 70_001, [1, 623, 624, 625, 4096, 262_144, 300_003]
    whole = draws.keep(key, start, sum(sizes), 0.37)
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    pieces = torch.cat([fused.keep(key, start + o, n, draws.keep_threshold(0.37)) for o, n in zip(offsets, sizes)])
    assert torch.equal(pieces, whole)
    assert 0.36 < whole.double().mean() < 0.38


def test_compiled_draws_take_the_kernels_for_large_cpu_draws_only(monkeypatch):
    """fused.CompiledDraws (the engine's) gives the definition's bits by whichever path, and leaves small draws,
    other devices and a thread that is ``off`` to the torch definition."""
    called = []
    for kernel in ("keep", "uniform"):
        original = getattr(fused, kernel)
        monkeypatch.setattr(fused, kernel, lambda *a, _k=kernel, _f=original: called.append(_k) or _f(*a))
    gen, plain = fused.CompiledDraws(3, "w"), draws.Draws(3, "w")
    shape = (fused.MIN_ENTRIES // 64 + 3, 64)  # MIN_ENTRIES and more: the kernels
    for start in (0, 2**32 - 1000):
        assert torch.equal(gen.uniform(1, shape, start), plain.uniform(1, shape, start))
        assert torch.equal(gen.keep(1, shape, 0.4, start), plain.keep(1, shape, 0.4, start))
    assert called == ["uniform", "keep"] * 2
    called.clear()
    assert torch.equal(gen.stream(2).keep(0, shape, 0.4), plain.stream(2).keep(0, shape, 0.4))
    assert called == ["keep"] and type(gen.stream(2)) is fused.CompiledDraws
    called.clear()
    gen.uniform(1, (7, 5)), gen.keep(1, shape, 0.4, device="meta")
    fused.off()
    try:
        gen.keep(1, shape, 0.4)
    finally:
        fused.off(False)
    assert called == []


# ---------------------------------------------------------------- one block


@st.composite
def blocks(draw):
    """(base, experts) with deltas that are often zero, cancel between experts or are special values."""
    n_exp = draw(st.integers(1, 8))  # more than torch adds in order (task_vector.TORCH_ROWS_IN_ORDER)
    n = draw(st.integers(1, 1300))  # several CHUNKs and a partial one
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b = rng.standard_normal(n).astype(np.float32)
    e = b + (rng.standard_normal((n_exp, n)) * draw(st.sampled_from([1e-3, 0.1, 10.0]))).astype(np.float32)
    unchanged = rng.random((n_exp, n)) < 0.2
    e[unchanged] = np.broadcast_to(b, (n_exp, n))[unchanged]
    special = rng.random((n_exp, n)) < draw(st.sampled_from([0.0, 0.03]))
    e[special] = rng.choice(np.array(SPECIAL, np.float32), size=int(special.sum()))
    if n_exp > 1 and draw(st.booleans()):
        e[1] = 2 * b - e[0]  # deltas that cancel: a zero sum, the election's tie
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return torch.from_numpy(b).to(dtype), [torch.from_numpy(x.copy()).to(dtype) for x in e], rng


def combine_config(draw, n_exp: int, elect: bool):
    weights = draw(st.lists(st.sampled_from([1.0, 1.0, 0.5, 0.3, -0.7, 2.0]), min_size=n_exp, max_size=n_exp))
    lam = draw(st.sampled_from([1.0, 0.7, 1.3]))
    normalize = draw(st.booleans())
    if elect:
        vote = draw(st.booleans())
        cfg = get_method("ties").config(weights=weights, lambda_=lam, normalize=normalize, weights_before_election=vote)
        return cfg, {"weights": weights, "elect": True, "lambda_": lam, "vote_weighted": vote, "normalize": normalize}
    cfg = get_method("dare_linear").config(weights=weights, lambda_=lam, normalize=normalize)
    divide = sum(weights) if normalize and abs(sum(weights)) >= 1e-8 else 0.0
    return cfg, {"weights": weights, "elect": False, "lambda_": lam, "divide_by": divide}


@settings(max_examples=150, deadline=None)
@given(data=st.data(), block=blocks(), elect=st.booleans())
def test_a_dare_block_is_combine_with_keep_only_and_the_divide(data, block, elect):
    base, experts, rng = block
    cfg, options = combine_config(data.draw, len(experts), elect)
    n = base.numel()
    masks = [torch.from_numpy(rng.random(n) < 0.5) if data.draw(st.booleans()) else None for _ in experts]
    divisors = [data.draw(st.sampled_from([0.0, 0.5, 0.3, 0.9])) if m is not None else 0.0 for m in masks]

    def sparsify(d, i):
        if masks[i] is None:
            return d
        keep_only_(d, masks[i].view_as(d))
        return d.div_(divisors[i]) if divisors[i] else d

    expected = _combine(base, experts, cfg, None, elect, sparsify)
    got = fused.merge_rows(base, experts, masks=masks, divisors=divisors, **options)
    assert same_bits(got, expected)


def test_an_election_near_zero_takes_the_sorted_sums_sign():
    # 1 + 2^-24 - 1 - 2^-24 in order is 0 (+2^-24 is lost), sorted it is -2^-24 + ... : only the sorted sum's
    # sign is the same in every order (task_vector.sign_of_sum), so three experts here need the sort
    base = torch.zeros(4)
    experts = [torch.full((4,), x) for x in (1.0, 2.0**-24, -1.0 - 2.0**-23)]
    cfg = get_method("ties").config(weights=[1.0] * 3)
    expected = _combine(base, experts, cfg, None, True, lambda d, i: d)
    got = fused.merge_rows(base, experts, weights=[1.0] * 3, elect=True, lambda_=1.0)
    assert same_bits(got, expected)


@pytest.mark.parametrize("rows", range(1, TORCH_ROWS_IN_ORDER + 1))
@pytest.mark.parametrize("n", [1, 7, 63, 1000, 4099])
def test_torch_sums_up_to_four_rows_in_order_from_zero(rows, n):
    """What sum_in_order's shortcut assumes of torch's ``sum(0)`` (with 5 or more rows its order differs in
    places: task_vector.TORCH_ROWS_IN_ORDER)."""
    rng = np.random.default_rng(rows * 10_000 + n)
    x = (rng.standard_normal((rows, n)) * 10.0 ** rng.integers(-8, 8, (rows, n))).astype(np.float32)
    x[rng.random((rows, n)) < 0.2] = -0.0
    in_order = np.zeros(n, np.float32)
    for row in x:
        in_order = in_order + row
    assert same_bits(torch.from_numpy(x).sum(0), torch.from_numpy(in_order))


@pytest.mark.parametrize("rows", range(1, 10))
@pytest.mark.parametrize("n", [1, 7, 63, 1000, 4099])
def test_sum_in_order_adds_the_rows_in_order_from_zero_for_any_number(rows, n):
    rng = np.random.default_rng(rows * 10_000 + n + 7)
    x = (rng.standard_normal((rows, n)) * 10.0 ** rng.integers(-8, 8, (rows, n))).astype(np.float32)
    x[rng.random((rows, n)) < 0.2] = -0.0
    in_order = np.zeros(n, np.float32)
    for row in x:
        in_order = in_order + row
    assert same_bits(sum_in_order(torch.from_numpy(x)), torch.from_numpy(in_order))


def test_mergeval_numba_0_turns_the_kernels_off():
    check = "from mergeval.methods import fused; print(fused.available(), fused.usable(1 << 30))"
    off = subprocess.run(
        [sys.executable, "-c", check],
        env={**os.environ, "MERGEVAL_NUMBA": "0"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert off.stdout.split() == ["False", "False"], off.stderr[-2000:]


LOADING = """
from mergeval.methods import fused
small = fused.MIN_ENTRIES // 4  # SmolLM2-135M's key and value projections: 110,592 entries
before = [fused.usable(small), fused.usable(fused.MIN_ENTRIES // 16)]
fused.available()  # loads the kernels (a tensor of MIN_ENTRIES or more would)
print(*before, fused.usable(small), fused.usable(fused.MIN_ENTRIES // 16))
"""


@pytest.mark.skipif(not fused.available(), reason="numba is not installed")
def test_smaller_tensors_take_the_kernels_once_loaded():
    """A tensor of MIN_ENTRIES / 8 or more takes the compiled path once a larger one has loaded it (its load was
    the only reason not to)."""
    out = subprocess.run([sys.executable, "-c", LOADING], capture_output=True, text=True, timeout=300, check=False)
    assert out.stdout.split() == ["False", "False", "True", "False"], out.stdout + out.stderr[-2000:]


def stable_sort_placed(rows: torch.Tensor, by_rank: torch.Tensor) -> torch.Tensor:
    """The definition: by_rank placed at each entry's position in a stable ascending sort of |rows| per row."""
    out = torch.empty(rows.shape)
    out.scatter_(1, torch.sort(rows.abs(), dim=1, stable=True).indices, by_rank.expand(rows.shape).contiguous())
    return out


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 9), st.integers(1, 3000), st.integers(1, 6), st.booleans(), st.integers(0, 2**31 - 1))
def test_ranks_by_radix_sort_are_a_stable_sorts(n_rows, row_len, levels, special, seed):
    # many ties (few magnitudes of both signs, zeros of both signs), kept by position; subnormals and the
    # largest finite floats order by their bits; rows ranked apart from each other
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-levels, levels + 1, (n_rows, row_len), generator=g).float() * 0.375
    if special:
        flat = rows.view(-1)
        flat[::3] = torch.tensor([1e-45, -3.4e38, 3.4e38, -0.0, 5e-39, 1e-38, -1e-45])[
            torch.arange(flat[::3].numel()) % 7
        ]
    by_rank = torch.randn(row_len, generator=g)  # any values: each must land at its rank
    assert torch.equal(fused.placed_by_rank(rows, by_rank), stable_sort_placed(rows, by_rank))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_ranks_by_radix_sort_leave_non_finite_tensors_to_torch(bad):
    rows = torch.randn(3, 50)
    rows[2, 7] = bad
    assert fused.placed_by_rank(rows, torch.zeros(50)) is None


@pytest.mark.parametrize("rank_scope", ["tensor", "row"])
def test_della_ranks_of_a_tensor_large_enough_for_the_kernel_are_a_stable_sorts(rank_scope):
    from mergeval.methods.sparsify import della_keep_prob

    g = torch.Generator().manual_seed(3)
    delta = (torch.randn(1024, 300, generator=g) * 1e-3).to(torch.bfloat16).float()  # bf16-born: ties
    delta[5, :40] = 0.0
    assert fused.usable(delta.numel())
    rows = delta.reshape(1024, -1) if rank_scope == "row" else delta.reshape(1, -1)
    n = rows.shape[1]
    by_rank = torch.arange(n, dtype=torch.float32).div_(n - 1).mul_(2 * 0.05).add_(0.6 - 0.05)
    expected = stable_sort_placed(rows, by_rank).view_as(delta)
    assert torch.equal(della_keep_prob(delta, 0.6, 0.05, rank_scope), expected)
