"""mergeval/methods/geometric.py: NearSwap's definition and invariants (SLERP's and Model Stock's tests are in
test_methods_exact.py and test_methods_more.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.methods import get_method

NEARSWAP = get_method("nearswap")


def nearswap(base: torch.Tensor, expert: torch.Tensor, t: float) -> torch.Tensor:
    return NEARSWAP.merge(base, [expert], NEARSWAP.config(t=t), torch.Generator())


pairs = st.integers(1, 64).flatmap(lambda n: st.tuples(
    st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n),
    st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n)))


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


@pytest.mark.parametrize("t,experts,field", [(-0.1, 1, "method.t"), (float("nan"), 1, "method.t"),
                                             (0.1, 2, "modelset.experts")])
def test_bad_settings_name_the_field(t, experts, field):
    with pytest.raises(UserError) as err:
        NEARSWAP.validate(NEARSWAP.config(t=t), experts)
    assert err.value.field == field
