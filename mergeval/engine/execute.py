"""Run a plan: read one unit's tensors from every input, merge them, hand the results on, forget them.

The executor is shared by the in-memory merge and the streaming merge, so both
produce the same tensors bit for bit. At any time it holds one unit's inputs
(the base's and each expert's tensors for one tensor or one layer) and outputs,
which bounds memory by the largest unit times the number of inputs, whatever
the model's size. Each unit gets its own random generator seeded from
(run seed, unit key), so random methods are reproducible and independent of
unit order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from mergeval.engine.plan import Unit
from mergeval.engine.vocab import align
from mergeval.methods import MergeMethod


def tensor_seed(seed: int, name: str) -> int:
    """63-bit generator seed = the first 8 bytes (little-endian) of sha256("<seed>:<name>")."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def output_shapes(plan: list[Unit], shapes: dict[str, tuple[int, ...]], rows: dict[str, int]):
    """name -> shape of each output tensor, in plan order (the base's shape; vocab rows per policy)."""
    out = {}
    for unit in plan:
        for name in unit.names:
            out[name] = (rows[name], *shapes[name][1:]) if name in rows else shapes[name]
    return out


def run_plan(plan: list[Unit], method: MergeMethod, base, experts: list, seed: int, rows: dict[str, int],
             progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, merged tensor) in plan order; ``base`` / ``experts`` are reader.py sources."""
    # disable=None: a bar only on a terminal, so piped stderr keeps errors on one line
    for unit in tqdm(plan, desc=f"merging ({method.name})", unit="unit", disable=None if progress else True):
        if unit.kind == "copy":  # integer buffers (e.g. position ids) are not merged
            (name,) = unit.names
            yield name, base.get(name).clone()
            continue
        b = {n: base.get(n) for n in unit.names}
        es = [{n: e.get(n) for n in unit.names} for e in experts]
        for n in unit.names:
            if n in rows:
                b[n], aligned = align(b[n], [e[n] for e in es], rows[n])
                for e, t in zip(es, aligned):
                    e[n] = t
        gen = torch.Generator().manual_seed(tensor_seed(seed, unit.key))
        if unit.kind == "tensor":
            (name,) = unit.names
            out = {name: method.merge(b[name], [e[name] for e in es], unit.cfg, gen)}
        else:
            out = method.merge_layer(b, es, unit.cfg, gen)
            _check_layer_output(method.name, unit, b, out)
        dtypes = {n: t.dtype for n, t in b.items()}
        del b, es  # the inputs can go before the outputs are consumed
        for name in unit.names:
            yield name, out.pop(name).to(dtypes[name])


def _check_layer_output(method: str, unit: Unit, base: dict[str, torch.Tensor], out: dict[str, torch.Tensor]):
    """A layer method must return exactly its layer's tensors with the base's shapes (a bug otherwise)."""
    if set(out) != set(unit.names):
        raise ValueError(f"{method}.merge_layer returned {sorted(set(out) ^ set(unit.names))[:3]} "
                         f"differently from the layer {unit.key}'s tensors")
    for n, t in out.items():
        if t.shape != base[n].shape:
            raise ValueError(f"{method}.merge_layer returned {n} with shape {list(t.shape)}, "
                             f"expected {list(base[n].shape)}")
