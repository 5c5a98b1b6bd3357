"""Passthrough: one model's tensors passed on unchanged (mergekit's ``passthrough``), optionally scaled.

It merges nothing: with ``modelset.slices`` (mergeval/merge/slices.py) it is how a "frankenmerge" stacks
layer ranges of several models into one deeper or shallower model, each output tensor the tensor of the one
slice source it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mergeval.core.errors import UserError
from mergeval.methods.draws import Draws
from mergeval.methods.registry import Mergekit, register


@dataclass
class PassthroughConfig:
    name: str = "passthrough"
    scale: float = 1.0  # mergekit's optional scale: every tensor multiplied by it (rules set it per tensor)


def _validate(cfg: PassthroughConfig, n_experts: int) -> None:
    if n_experts != 0:
        raise UserError(
            "modelset",
            f"passthrough takes one model per tensor, got the base and {n_experts} expert(s) for each",
            "list the layer ranges under modelset.slices with one source per "
            "slice, or choose a method that merges (linear, slerp, ...)",
        )
    if not isinstance(cfg.scale, (int, float)) or cfg.scale != cfg.scale:
        raise UserError("method.scale", f"must be a number, got {cfg.scale!r}", "set scale: 1.0 (unchanged)")


@register("passthrough", PassthroughConfig, _validate, mergekit=Mergekit("passthrough", own=True, slices_only=True))
def passthrough(base: torch.Tensor, experts: list[torch.Tensor], cfg: PassthroughConfig, gen: Draws) -> torch.Tensor:
    """Passthrough (mergekit's ``passthrough``): ``merged = s * b``, the one input tensor ``b`` unchanged when
    ``scale`` s = 1 (the default; returned as is, bit for bit), else multiplied by s in float32 and cast back to
    b's dtype, as mergekit multiplies by its optional per-input ``scale``. Used with ``modelset.slices``: each
    output layer the layer of the one slice source it comes from."""
    if cfg.scale == 1.0:
        return base.clone()
    return (base.float() * cfg.scale).to(base.dtype)
