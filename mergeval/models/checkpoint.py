"""Reading, writing and comparing Hugging Face checkpoint directories.

A checkpoint here is a directory with ``config.json``, ``*.safetensors`` and a
tokenizer. Merging works on the checkpoint's tensors (what the safetensors
files hold, so tied weights appear once), not on a module's state dict.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mergeval.errors import UserError
from mergeval.models.fingerprint import safetensors_files


def tensor_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors headers only (no tensor data)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        tensors.update(load_file(str(path)))
    return tensors


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def check_compatible(base_dir: Path, others: dict[str, Path]) -> None:
    """Fail before merging if an expert's architecture or any tensor shape differs from the base."""
    base_cfg, base_shapes = read_config(base_dir), tensor_shapes(base_dir)
    for name, path in others.items():
        field = f"modelset.experts.{name}"
        cfg = read_config(path)
        for key in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
            if cfg.get(key) != base_cfg.get(key):
                raise UserError(field, f"{key} is {cfg.get(key)!r} but the base has {base_cfg.get(key)!r}",
                                "merge only models of the base's architecture (fine-tuned from the same base)")
        shapes = tensor_shapes(path)
        missing, extra = sorted(set(base_shapes) - set(shapes)), sorted(set(shapes) - set(base_shapes))
        if missing or extra:
            which = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
            raise UserError(field, f"tensor names differ from the base ({which})",
                            "merge only checkpoints of the same architecture")
        for tensor, shape in shapes.items():
            if shape != base_shapes[tensor]:
                raise UserError(field, f"tensor {tensor} has shape {list(shape)} but the base has "
                                f"{list(base_shapes[tensor])}", "merge only checkpoints with identical shapes")


def load_model(model_dir: Path, tensors: dict[str, torch.Tensor] | None = None, dtype: torch.dtype = torch.float32):
    """The causal LM in ``model_dir``; with ``tensors`` (e.g. a merge kept in memory) loaded over its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if tensors is not None:
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"tensors not in {model_dir}'s architecture: {result.unexpected_keys[:3]}")
    return model.to(dtype).eval()
