"""select.kth_smallest: the order statistic torch's ``kthvalue`` gives, by the radix selection on non-negative
float32 values and by NumPy's introselect on the rest."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from mergeval.methods.select import _radix_kth, kth_smallest

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
