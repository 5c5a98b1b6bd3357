"""Quantized checkpoints (``quantization_config`` in config.json): dequantized once at load where the format
allows it on a CPU, otherwise one line naming the format and the fix.

Merging adds and scales weights, which a quantized tensor cannot take as it is; a paper's parent that was
published quantized must be dequantized first. Formats:

- ``fp8`` with ``weight_block_size`` (transformers' fine-grained FP8: DeepSeek-V3, Qwen3-FP8): each quantized
  weight W (float8, shape [m, n]) comes with ``<name>_scale_inv`` S of shape [ceil(m/bm), ceil(n/bn)], and

      W_real[i, j] = float(W[i, j]) * S[i // bm, j // bn]

  computed in float32, then stored in the checkpoint's ``torch_dtype`` (bfloat16 for these models). This is
  ``dequantize_fp8_blocks``; the dequantized checkpoint is written into mergeval's cache, keyed by the
  quantized files' fingerprint, with ``quantization_config`` removed from its config.json.
- any other method (bitsandbytes, GPTQ, AWQ, HQQ, compressed-tensors, ...): its kernels or packed layouts need
  libraries and usually a GPU; the run stops with one line naming the method.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mergeval.core.errors import UserError

DEQUANTIZED_VERSION = 1  # raise when dequantization changes: every cached copy is made again
SCALE_SUFFIX = "_scale_inv"


def quantization_of(model_dir: Path) -> dict | None:
    """config.json's ``quantization_config`` (None for an unquantized checkpoint or an unreadable config: the
    checks that read it later say what is wrong)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = config.get("quantization_config") if isinstance(config, dict) else None
    return found if isinstance(found, dict) else None


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W_real[i, j] = float(W[i, j]) * S[i // bm, j // bn] in float32 (module docstring)."""
    bm, bn = block
    m, n = weight.shape
    if scale_inv.shape != (-(-m // bm), -(-n // bn)):
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not tile a {m}x{n} weight in {bm}x{bn} blocks")
    scale = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return weight.float() * scale


def can_dequantize(quant: dict) -> bool:
    block = quant.get("weight_block_size")
    return str(quant.get("quant_method", "")).lower() == "fp8" and isinstance(block, list) and len(block) == 2


def describe(quant: dict) -> str:
    method = str(quant.get("quant_method", "unknown"))
    bits = quant.get("bits") or (
        "4-bit" if quant.get("load_in_4bit") else "8-bit" if quant.get("load_in_8bit") else None
    )
    return f"{method}, {bits}" if isinstance(bits, str) else f"{method}, {bits}-bit" if bits else method


def dequantized(model_dir: Path, quant: dict, cache: Path, field: str) -> Path:
    """The dequantized copy of the quantized checkpoint ``model_dir`` (built once, then read from the cache)."""
    from mergeval.core.paths import atomic_dir, one_builder
    from mergeval.models.fingerprint import fingerprint
    from mergeval.models.safetensors_io import cached_build_usable

    if not can_dequantize(quant):
        raise UserError(
            field,
            f"'{model_dir}' is quantized ({describe(quant)}), which mergeval cannot dequantize "
            "on a CPU (only block-wise fp8)",
            "use the unquantized checkpoint it was made from, or "
            "dequantize it where its kernels run: AutoModelForCausalLM.from_pretrained(DIR)"
            ".dequantize().save_pretrained(OUT), then point the source at OUT",
        )
    block = quant["weight_block_size"]  # [rows, columns] (can_dequantize)
    key = f"{fingerprint(model_dir)}-{DEQUANTIZED_VERSION}"
    target = cache / "dequantized" / f"{model_dir.name}-{key[:16]}"
    if cached_build_usable(target, field):
        return target
    with one_builder(target, f"the dequantized {model_dir.name}") as build:
        if build:
            print(f"mergeval: {field}: dequantizing {model_dir} ({describe(quant)}; once, cached)", flush=True)
            with atomic_dir(target) as tmp:
                _write_dequantized(model_dir, tmp, (int(block[0]), int(block[1])), field)
    return target


def _write_dequantized(model_dir: Path, out: Path, block: tuple[int, int], field: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mergeval.models.safetensors_io import shard_files

    config = json.loads((model_dir / "config.json").read_text())
    dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), torch.bfloat16)
    shards = shard_files(model_dir, field)
    weight_map = {}
    for number, path in enumerate(shards, start=1):
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            tensors = {}
            for name in names:
                if name.endswith(SCALE_SUFFIX):
                    continue
                t = f.get_tensor(name)
                if name + SCALE_SUFFIX in names:
                    try:
                        t = dequantize_fp8_blocks(t, f.get_tensor(name + SCALE_SUFFIX), block).to(dtype)
                    except ValueError as err:
                        raise UserError(field, f"'{path}': {name}: {err}", "re-download that checkpoint") from None
                elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    raise UserError(
                        field,
                        f"'{path}': {name} is float8 without its {name}{SCALE_SUFFIX}",
                        "re-download that checkpoint",
                    )
                tensors[name] = t.contiguous()
        name = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in model_dir.iterdir():
        if extra.is_file() and extra.name != "config.json" and not extra.name.endswith((".safetensors", ".index.json")):
            shutil.copy2(extra, out / extra.name)
