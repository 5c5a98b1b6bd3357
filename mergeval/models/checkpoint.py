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


VOCAB_POLICIES = ("error", "truncate", "union")
VOCAB_FIX = ("merge models that share the base's tokenizer, or set vocab_policy=truncate (all to the smallest "
             "vocabulary) or vocab_policy=union (the base's vocabulary; the base's rows for tokens an expert lacks)")


def check_vocab_policy(policy: str) -> None:
    if policy not in VOCAB_POLICIES:
        raise UserError("vocab_policy", f"unknown policy '{policy}'", f"use one of: {', '.join(VOCAB_POLICIES)}")


def vocab_size(config: dict) -> int | None:
    """``vocab_size`` of a model config (top level, or in ``text_config`` for multimodal configs)."""
    return config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))


def vocab_tensors(base_shapes: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]],
                  base_vocab: int | None, vocab: int | None) -> dict[str, tuple[int, ...]]:
    """The tensors whose shapes differ from the base's only because the vocabularies differ.

    A tensor is one when it has rows = the model's vocab_size in each model (dim 0:
    embeddings, lm_head) and otherwise the base's shape. Returns name -> its shape here.
    """
    return {name: shape for name, shape in shapes.items()
            if name in base_shapes and shape != base_shapes[name] and len(shape) >= 2
            and shape[1:] == base_shapes[name][1:] and shape[0] == vocab and base_shapes[name][0] == base_vocab}


def check_compatible(base_dir: Path, others: dict[str, Path], vocab_policy: str = "error") -> None:
    """Fail before merging if an expert's architecture or any tensor shape differs from the base.

    Vocabulary differences (vocab_size and the embedding / lm_head rows) are an
    error naming the tensors and shapes unless ``vocab_policy`` is truncate or
    union; union also refuses an expert with more rows than the base.
    """
    check_vocab_policy(vocab_policy)
    base_cfg, base_shapes = read_config(base_dir), tensor_shapes(base_dir)
    for name, path in others.items():
        field = f"modelset.experts.{name}"
        cfg = read_config(path)
        for key in ("model_type", "num_hidden_layers", "hidden_size"):
            if cfg.get(key) != base_cfg.get(key):
                raise UserError(field, f"{key} is {cfg.get(key)!r} but the base has {base_cfg.get(key)!r}",
                                "merge only models of the base's architecture (fine-tuned from the same base)")
        shapes = tensor_shapes(path)
        missing, extra = sorted(set(base_shapes) - set(shapes)), sorted(set(shapes) - set(base_shapes))
        if missing or extra:
            which = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
            raise UserError(field, f"tensor names differ from the base ({which})",
                            "merge only checkpoints of the same architecture")
        vocab = vocab_tensors(base_shapes, shapes, vocab_size(base_cfg), vocab_size(cfg))
        for tensor, shape in shapes.items():
            if shape != base_shapes[tensor] and tensor not in vocab:
                raise UserError(field, f"tensor {tensor} has shape {list(shape)} but the base has "
                                f"{list(base_shapes[tensor])}", "merge only checkpoints with identical shapes")
        if vocab or vocab_size(cfg) != vocab_size(base_cfg):
            _check_vocab(field, vocab, base_shapes, vocab_size(base_cfg), vocab_size(cfg), vocab_policy)


def _check_vocab(field: str, vocab: dict[str, tuple[int, ...]], base_shapes: dict[str, tuple[int, ...]],
                 base_vocab: int | None, other_vocab: int | None, policy: str) -> None:
    listed = ", ".join(f"{t} {list(s)} vs the base's {list(base_shapes[t])}" for t, s in sorted(vocab.items()))
    if policy == "error":
        raise UserError(field, f"vocabulary differs from the base: vocab_size {other_vocab} vs {base_vocab}"
                        + (f"; {listed}" if listed else ""), VOCAB_FIX)
    if policy == "union" and other_vocab is not None and base_vocab is not None and other_vocab > base_vocab:
        raise UserError(field, f"has a larger vocabulary than the base ({other_vocab} > {base_vocab}"
                        + (f"; {listed}" if listed else "") + "), which vocab_policy=union cannot keep",
                        "use vocab_policy=truncate, or make the model with the largest vocabulary the base")


def load_model(model_dir: Path, tensors: dict[str, torch.Tensor] | None = None, dtype: torch.dtype = torch.float32):
    """The causal LM in ``model_dir``; with ``tensors`` (e.g. a merge kept in memory) loaded over its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if tensors is not None:
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"tensors not in {model_dir}'s architecture: {result.unexpected_keys[:3]}")
    return model.to(dtype).eval()
