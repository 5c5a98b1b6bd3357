"""Name -> merge method. Importing this module registers the built-in methods."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mergeval.errors import UserError

MergeFn = Callable[[torch.Tensor, list[torch.Tensor], Any, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class MergeMethod:
    name: str
    config: type
    merge: MergeFn
    validate: Callable[[Any, int], None]
    doc: str


METHODS: dict[str, MergeMethod] = {}


def register(name: str, config: type, validate: Callable[[Any, int], None]):
    def wrap(fn: MergeFn) -> MergeFn:
        METHODS[name] = MergeMethod(name, config, fn, validate, (fn.__doc__ or "").strip())
        return fn

    return wrap


def get_method(name: str) -> MergeMethod:
    if name not in METHODS:
        raise UserError("method.name", f"unknown merge method '{name}'",
                        f"choose one of: {', '.join(sorted(METHODS))}")
    return METHODS[name]


# Registration happens on import of the method families.
from mergeval.methods import geometric, sparsify, task_vector  # noqa: E402,F401
