"""PEFT LoRA adapters as constituents: applied to their base once, at load, and cached as a full checkpoint.

Some published experts are LoRA adapters (CMM's GeLLMO, the medical paper's TachyHealth parent): a directory
with ``adapter_config.json`` and ``adapter_model.safetensors`` and no ``config.json``. mergeval merges full
weights, so an adapter given as an expert is applied to the modelset's base exactly as PEFT's
``merge_and_unload`` does it (W + scaling * B @ A on each target module, in the base's stored dtype; PEFT does
the arithmetic) and the result is written into mergeval's cache, keyed by the adapter's files and the base's
identity. Every later step (fingerprints, merges, evaluation) sees an ordinary checkpoint.

An adapter trained on another base is a one-line error: its ``base_model_name_or_path`` is compared with the
modelset's base where both are hub ids or both are directories; and PEFT refuses target modules whose shapes
differ from the base's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mergeval.core.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_VERSION = 1  # raise when how an adapter is applied changes: every cached application is made again


def is_adapter(model_dir: Path) -> bool:
    """A PEFT adapter directory (adapter_config.json and no config.json of a full model)."""
    return (model_dir / ADAPTER_CONFIG).is_file() and not (model_dir / "config.json").is_file()


def adapter_config(adapter_dir: Path, field: str) -> dict:
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            field,
            f"'{adapter_dir / ADAPTER_CONFIG}' is not readable JSON ({type(err).__name__})",
            "re-download or re-save that adapter",
        ) from None
    if not isinstance(config, dict):
        raise UserError(field, f"'{adapter_dir / ADAPTER_CONFIG}' is not a JSON object", "re-save that adapter")
    return config


def check_adapter_base(config: dict, base_spec: str, base_dir: Path, field: str) -> None:
    """The adapter names the modelset's base: hub ids compared as ids, directories as paths. A hub id against a
    directory cannot be compared by name (a downloaded copy lives anywhere); PEFT's shape checks still apply."""
    theirs = config.get("base_model_name_or_path")
    if not theirs:
        return
    ours = base_spec.removeprefix("hf:")
    theirs_is_dir = Path(str(theirs)).expanduser().is_dir()
    ours_is_hub = base_spec.startswith("hf:") or not Path(ours).expanduser().exists()
    if theirs_is_dir and not ours_is_hub:
        same = Path(str(theirs)).expanduser().resolve() == base_dir.resolve()
    elif not theirs_is_dir and ours_is_hub:
        same = str(theirs).lower() == ours.lower()
    else:
        return
    if not same:
        raise UserError(
            field,
            f"is a LoRA adapter for {theirs}, not for the modelset's base {base_spec}",
            f"set modelset.base to {theirs}, or use an adapter trained on {base_spec}",
        )


def applied_adapter(
    adapter_dir: Path, base_dir: Path, base_identity: str, base_spec: str, cache: Path, field: str
) -> Path:
    """The full checkpoint of ``adapter_dir`` applied to ``base_dir`` (built once, then read from the cache)."""
    from blake3 import blake3

    from mergeval.core.paths import atomic_dir, one_builder
    from mergeval.models.safetensors_io import cached_build_usable

    config = adapter_config(adapter_dir, field)
    kind = str(config.get("peft_type", "")).upper()
    if kind != "LORA":
        raise UserError(
            field,
            f"is a PEFT {kind or 'unknown'} adapter; mergeval applies LoRA adapters only",
            "merge it into its base with PEFT (merge_and_unload) and point the source at the result",
        )
    check_adapter_base(config, base_spec, base_dir, field)
    weights = sorted(adapter_dir.glob("adapter_model*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in adapter_dir.glob("adapter_model*.bin"))
        raise UserError(
            field,
            f"'{adapter_dir}' has no adapter_model.safetensors"
            + (f" (only {pickled[0]}, a pickle mergeval does not load)" if pickled else ""),
            "save the adapter with safe_serialization=True",
        )
    h = blake3()
    h.update(f"adapter-{ADAPTER_VERSION}|base|{base_identity}|".encode())
    for path in [adapter_dir / ADAPTER_CONFIG, *weights]:
        h.update(f"{path.name}|{path.stat().st_size}|".encode())
        h.update(path.read_bytes())
    target = cache / "adapters" / f"{adapter_dir.name}-{h.hexdigest(length=8)}"
    if cached_build_usable(target, field):
        return target
    with one_builder(target, f"the adapter {adapter_dir.name} applied to its base") as build:
        if build:
            print(f"mergeval: {field}: applying the LoRA adapter {adapter_dir} to the base (once; cached)", flush=True)
            with atomic_dir(target) as tmp:
                _apply(adapter_dir, base_dir, tmp, field)
    return target


def _apply(adapter_dir: Path, base_dir: Path, out: Path, field: str) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mergeval.models.fingerprint import TOKENIZER_FILES
    from mergeval.models.safetensors_io import read_config

    base_config = read_config(base_dir, "modelset.base")
    stored = base_config.get("torch_dtype") or base_config.get("dtype")
    dtype = getattr(torch, str(stored), torch.float32) if stored else torch.float32
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except Exception as err:  # noqa: BLE001  PEFT raises several types for an adapter that does not fit
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(
            field,
            f"the LoRA adapter does not fit the modelset's base ({type(err).__name__}: {first})",
            "use an adapter trained on the modelset's base",
        ) from None
    merged = model.merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    source = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    (out / "mergeval-adapter.json").write_text(
        json.dumps({"adapter": str(adapter_dir), "base": str(base_dir), "version": ADAPTER_VERSION}, indent=2)
    )
