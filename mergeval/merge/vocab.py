"""Vocabulary policies: what a merge does when inputs have different vocabulary sizes.

Only tensors whose shapes differ in dim 0 alone (and have at least two dims:
embeddings, lm_head) can differ by vocabulary; any other shape difference is an
error. Per tensor with R_b rows in the base and R_i in expert i:

    error     (default) a one-line error naming the tensors and shapes
    truncate  output rows R = min(R_b, R_1, ..., R_N); every input keeps its first R rows
    union     output rows R = R_b; expert i's rows R_i..R_b-1 are the base's rows
              (a zero task vector for the tokens it lacks); R_i > R_b is an error
    base      output = the base's tensor as it is (R_b rows, no task vector): the experts'
              embeddings and head are not merged, whatever rows they have. MergeBench's
              choice for its Llama-3.2-3B experts, padded to 128,320 rows against the
              base's 128,256. Tensors whose shapes agree are merged as usual.

``truncate`` over experts padded beyond the base (R_i >= R_b for all i) merges the
shared rows and gives the base's shape, so its merge evaluates in the base's
architecture too.

No policy maps tokens between different tokenizers: they assume the shared
ids mean the same tokens (an extended tokenizer), as mergekit's truncation
does. Different tokenizers are aligned by token with ``tokenizer_source``
(tokens.py), which no policy accompanies. Which tokenizer the output gets is
decided in ``streaming.output_tokenizer``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mergeval.core.errors import UserError
from mergeval.models.checkpoint import VOCAB_FIX, check_vocab_policy

Shape = tuple[int, ...]


def vocab_rows(
    base: Mapping[str, Shape], experts: list[Mapping[str, Shape]], labels: list[str], policy: str
) -> dict[str, int]:
    """name -> output rows, for every tensor whose inputs differ in rows (empty when all shapes agree)."""
    check_vocab_policy(policy)
    rows: dict[str, int] = {}
    for shapes, label in zip(experts, labels):
        if set(shapes) != set(base):
            odd = sorted(set(shapes) ^ set(base))[:3]
            raise UserError(
                label, f"tensor names differ from the base ({odd})", "merge only checkpoints of the same architecture"
            )
        differ = {n: s for n, s in shapes.items() if s != base[n]}
        for name, shape in differ.items():
            if len(shape) < 2 or shape[1:] != base[name][1:]:
                raise UserError(
                    label,
                    f"tensor {name} has shape {list(shape)} but the base has {list(base[name])}",
                    "merge only checkpoints with identical shapes",
                )
        listed = ", ".join(f"{n} {list(s)} vs the base's {list(base[n])}" for n, s in sorted(differ.items()))
        if differ and policy == "error":
            raise UserError(label, f"vocabulary differs from the base: {listed}", VOCAB_FIX)
        if policy == "union" and any(s[0] > base[n][0] for n, s in differ.items()):
            raise UserError(
                label,
                f"has more vocabulary rows than the base ({listed}), which vocab_policy=union cannot keep",
                "use vocab_policy=truncate, or make the model with the largest vocabulary the base",
            )
        for name, shape in differ.items():
            rows[name] = base[name][0] if policy in ("union", "base") else min(rows.get(name, base[name][0]), shape[0])
    return rows


def keep_base_rows(plan: list, rows: Mapping[str, int], policy: str) -> list:
    """The plan with every unit of a tensor whose inputs differ in rows made a copy of the base's tensor, under
    ``policy`` base (the others unchanged)."""
    import dataclasses

    if policy != "base" or not rows:
        return plan
    out = []
    for unit in plan:
        if not any(name in rows for name in unit.names):
            out.append(unit)
        elif unit.kind == "tensor":
            out.append(dataclasses.replace(unit, kind="copy"))
        else:  # a layer-wise unit holding a vocabulary tensor: its other tensors need the layer
            raise UserError(
                "vocab_policy",
                f"{unit.key} merges {', '.join(unit.names)} together, and the base "
                "policy would keep some of them from the base alone",
                "use vocab_policy=truncate",
            )
    return out


def align(base: torch.Tensor, experts: list[torch.Tensor], rows: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every input with exactly ``rows`` rows: the first ``rows`` (truncate), or padded with the base's (union)."""

    def fit(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] >= rows:
            return t[:rows]
        return torch.cat([t, base[t.shape[0] : rows].to(t.dtype)])

    return fit(base), [fit(e) for e in experts]
