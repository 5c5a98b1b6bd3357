"""Apply a merge method tensor by tensor.

``merge_tensors`` is the in-memory executor: it reads the base's and the
experts' checkpoint tensors one name at a time, calls the method's pure
per-tensor function, and returns the merged tensors (which the caller loads
into a live model for evaluation; nothing touches the disk). Each tensor gets
its own random generator seeded from (run seed, tensor name), so random
methods are reproducible and independent of tensor order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from tqdm.auto import tqdm

from mergeval.errors import UserError
from mergeval.methods import MergeMethod


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def merge_tensors(method: MergeMethod, cfg, base: Mapping[str, torch.Tensor],
                  experts: list[Mapping[str, torch.Tensor]], seed: int, progress: bool = True) -> dict[str, torch.Tensor]:
    """merged[name] = method.merge(base[name], [e[name] for e in experts], cfg, generator(seed, name))."""
    merged: dict[str, torch.Tensor] = {}
    for name in tqdm(sorted(base), desc=f"merging ({method.name})", unit="tensor", disable=not progress):
        b = base[name]
        inputs = [e[name] for e in experts]
        for which, t in [("base", b), *((f"expert {i}", t) for i, t in enumerate(inputs))]:
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise UserError("modelset", f"{which} tensor {name} contains NaN or Inf",
                                "check that checkpoint; it cannot be merged")
        if not b.is_floating_point():  # integer buffers (e.g. position ids) are not merged
            merged[name] = b.clone()
            continue
        gen = torch.Generator().manual_seed(tensor_seed(seed, name))
        merged[name] = method.merge(b, inputs, cfg, gen)
    return merged
