"""The safetensors files of a checkpoint, checked before anything trusts them.

Downloads that stop half-way, copies cut short by a full disk and files of
garbage are common with multi-gigabyte checkpoints. Every reader in mergeval
(shapes, fingerprints, the merge engine) goes through ``read_header``, which
checks the format (https://github.com/huggingface/safetensors: 8-byte
little-endian header length N, N bytes of JSON, then the data) against the
file's size, so a damaged file is one line naming the file and the model's
config field, never a library traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mergeval.core.errors import UserError

# safetensors header dtype -> torch dtype (the writer uses the inverse)
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
INDEX = "model.safetensors.index.json"
REFETCH = "re-download or re-save that checkpoint (a transfer that stopped half-way, or a full disk?)"


def shard_files(model_dir: Path, label: str = "modelset") -> list[Path]:
    """The safetensors files of a checkpoint: those its index names (each must exist), else every
    ``*.safetensors``."""
    index = model_dir / INDEX
    if not index.exists():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(label, f"'{index}' is not a valid safetensors index ({type(err).__name__})", REFETCH) from err
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(label, f"'{index}' names {len(missing)} missing shard(s), e.g. {missing[0]}", REFETCH)
    return files


def read_header(path: Path, label: str = "modelset") -> tuple[int, dict]:
    """(offset of the data section, {name: {dtype, shape, data_offsets}}) of one safetensors file, checked:
    header length within the file, JSON header, known dtypes, every tensor's bytes inside the file and of the
    size its shape and dtype need."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if n <= 0 or 8 + n > size:
            raise UserError(
                label, f"'{path}' is not a complete safetensors file (header length {n}, file size {size})", REFETCH
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise UserError(label, f"'{path}' has a damaged header (not JSON)", REFETCH) from err
    if not isinstance(header, dict):
        raise UserError(label, f"'{path}' has a damaged header (not a JSON object)", REFETCH)
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            dtype, shape = DTYPES[entry["dtype"]], [int(d) for d in entry["shape"]]
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(label, f"'{path}': tensor {name} has a damaged or unknown entry", REFETCH) from err
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end <= data:
            raise UserError(
                label, f"'{path}' is truncated: tensor {name} ends at byte {8 + n + end} of {size}", REFETCH
            )
        if end - begin != count * dtype.itemsize:
            raise UserError(
                label,
                f"'{path}': tensor {name} holds {end - begin} bytes, its shape needs {count * dtype.itemsize}",
                REFETCH,
            )
    return 8 + n, header


def read_config(model_dir: Path, label: str = "modelset") -> dict:
    """The checkpoint's config.json as a dict; a missing or damaged one is a one-line error."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise UserError(
            label,
            f"'{model_dir}' has no config.json",
            "point it at a Hugging Face model directory (config.json, *.safetensors, tokenizer files)",
        ) from err
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(label, f"'{path}' is not valid JSON ({err})", REFETCH) from err
    if not isinstance(config, dict):
        raise UserError(label, f"'{path}' is not a JSON object", REFETCH)
    return config


def cached_build_usable(target: Path, label: str) -> bool:
    """Whether a checkpoint mergeval built into its own cache (the converted SmolLM2, a zoo model, a fine-tuned
    expert) is there and whole. A damaged one (a file truncated by a full disk, a killed copy) is mergeval's to
    fix, not the user's: it is removed, with one line saying so, and the caller builds it again."""
    if not target.exists():
        return False
    try:
        check_checkpoint(target, label)
    except UserError as err:
        import shutil
        import sys

        print(
            f"mergeval: {label}: the cached build {target} is damaged ({err.problem}); building it again",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(target, ignore_errors=True)
        return False
    return True


def check_checkpoint(model_dir: Path, label: str) -> dict[str, tuple[int, ...]]:
    """Check config.json and every safetensors file of ``model_dir``; returns tensor name -> shape."""
    read_config(model_dir, label)
    files = shard_files(model_dir, label)
    if not files:
        raise UserError(
            label,
            f"'{model_dir}' holds no *.safetensors weights",
            "convert the checkpoint to safetensors (save_pretrained(..., safe_serialization=True))",
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        shapes.update({name: tuple(e["shape"]) for name, e in read_header(path, label)[1].items()})
    return shapes
