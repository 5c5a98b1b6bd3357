"""Helpers and hypothesis strategies shared by the merge methods' tests (test_task_vector.py, test_sparsify.py,
test_geometric.py, test_registry.py, ...) and the metrics' (test_calibration.py, test_tradeoff.py, ...)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from mergeval.methods import METHODS
from mergeval.methods.draws import Draws

LOW = [torch.bfloat16, torch.float16]


@st.composite
def tensors(draw, min_experts: int = 1, max_experts: int = 4, shapes=((7,), (3, 5), (4, 4, 2))):
    """(base, experts) of one random shape, from a drawn seed."""
    seed = draw(st.integers(0, 2**31 - 1))
    n = draw(st.integers(min_experts, max_experts))
    shape = draw(st.sampled_from(list(shapes)))
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    return base, [base + 0.1 * torch.randn(shape, generator=g) for _ in range(n)]


def merge(name: str, base, experts, seed: int = 0, **params):
    method = METHODS[name]
    cfg = method.config(**params)
    method.validate(cfg, len(experts))
    return method.merge(base, experts, cfg, Draws(seed, "w"))


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


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


# ---------------------------------------------------------------- metrics

unit = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, allow_infinity=False)
