"""select.kth_smallest: the order statistic torch's ``kthvalue`` gives, by the radix selection on non-negative
float32 values and by NumPy's introselect on the rest; select.Appended, the one buffer Threshold keeps its
samples and candidates in."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from mergeval.methods.select import Appended, Threshold, _radix_kth, kth_smallest

# magnitudes as TIES sees them (zeros, subnormals, many equal values, both 16-bit halves of the pattern in play)
MAGNITUDES = [0.0, 1e-45, 1e-40, 2.0**-20, 0.0009765625, 0.00098, 0.25, 0.5, 0.50000006, 1.0, 3.0e38]
SIGNED = [*MAGNITUDES, -0.0, -1e-40, -0.5, -2.0]


@given(st.lists(st.sampled_from(MAGNITUDES), min_size=1, max_size=300), st.data())
def test_radix_selection_is_kthvalue_on_magnitudes(values, data):
    a = torch.tensor(values, dtype=torch.float32)
    k = data.draw(st.integers(1, a.numel()))
    assert _radix_kth(a.numpy(), k) is not None
    assert kth_smallest(a, k) == float(a.kthvalue(k).values)


@given(st.lists(st.sampled_from(SIGNED), min_size=1, max_size=300), st.data())
def test_kth_smallest_is_kthvalue_with_signs(values, data):
    """A negative value or -0.0 leaves the radix selection (None) for the introselect: the same value."""
    a = torch.tensor(values, dtype=torch.float32)
    k = data.draw(st.integers(1, a.numel()))
    if any(np.signbit(values)):
        assert _radix_kth(a.numpy(), k) is None
    assert kth_smallest(a, k) == float(a.kthvalue(k).values)
    assert kth_smallest(a.double(), k) == float(a.double().kthvalue(k).values)


def test_radix_selection_on_continuous_values():
    a = torch.rand(100_003, generator=torch.Generator().manual_seed(5)) * 7
    for k in (1, 2, 50_000, 100_002, 100_003):
        assert kth_smallest(a, k) == float(a.kthvalue(k).values)
    assert _radix_kth(np.array([1.0, float("inf")], np.float32), 1) is None
    assert _radix_kth(np.array([1.0, float("nan")], np.float32), 1) is None


@given(st.lists(st.lists(st.floats(0, 10, width=32), max_size=40), max_size=12), st.integers(0, 64))
def test_appended_gives_back_each_chunk_and_their_concatenation(chunks, capacity):
    """Whatever the first buffer's size (0: the first chunk's), growing keeps every value and chunk boundary."""
    buf = Appended(capacity)
    for i, chunk in enumerate(chunks):
        t = torch.tensor(chunk, dtype=torch.float32)
        if i % 2:
            buf.append(t)
        else:  # filled by the caller, as Threshold's NumPy count does
            buf.slot(t.numel(), t).copy_(t)
    assert [c.tolist() for c in buf.chunks()] == [torch.tensor(c, dtype=torch.float32).tolist() for c in chunks]
    assert buf.values().tolist() == [v for c in buf.chunks() for v in c.tolist()]


def test_threshold_keeps_one_buffer_not_a_tensor_per_chunk():
    """A tensor kept per streamed block fragmented glibc's heap (select.Appended); the candidates of 200 chunks
    lie in one buffer, and the result is still the exact k-th largest with its ties per chunk."""
    a = (torch.randn(200 * 4096, generator=torch.Generator().manual_seed(3)) * 64).round().abs()  # many ties
    k = a.numel() // 2
    t = Threshold(a.numel(), k)
    for chunk in a.split(4096):
        t.sample(chunk)
    for chunk in a.split(4096):
        t.count(chunk)
    assert len(t._cands.chunks()) == 200 and t._cands.buf is not None
    tau, c_gt, c_eq = t.result()
    expected = float(a.kthvalue(a.numel() - k + 1).values)
    assert tau == expected and c_gt == int((a > tau).sum()) and c_eq == int((a == tau).sum())
    assert t.chunk_ties == [int((c == tau).sum()) for c in a.split(4096)]
