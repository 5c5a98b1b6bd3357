"""Tensor sources the engine reads one tensor at a time: checkpoint directories and in-memory mappings.

``CheckpointReader`` reads the safetensors headers of a checkpoint (the files
named by ``model.safetensors.index.json`` when there is one, else all
``*.safetensors``) up front and ``get(name)`` reads that one tensor's bytes
with ``readinto`` into a fresh buffer. It deliberately does not memory-map the
files (as ``safetensors.safe_open`` does): pages of a mapping that were read
stay in the process's resident set until it is unmapped, so a merge through
mappings grew its RSS by the size of all inputs (measured: +190 MB of RssFile
over three 68 MB checkpoints); plain reads leave only the tensors in use.

Every tensor is checked for NaN/Inf when it is read, so a bad input is found
without a separate pass and named in a one-line error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from mergeval.errors import UserError

# safetensors header dtype -> torch dtype (the writer uses the inverse)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
INDEX = "model.safetensors.index.json"


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every ``*.safetensors``."""
    index = model_dir / INDEX
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(model_dir.glob("*.safetensors"))


def check_finite(t: torch.Tensor, label: str, name: str, where: str = "") -> torch.Tensor:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise UserError(label, f"tensor {name}{where} contains NaN or Inf",
                        "check that checkpoint (a failed fine-tune or conversion?); it cannot be merged")
    return t


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, {name: {dtype, shape, data_offsets}}) of one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or 8 + n > size:
            raise UserError("modelset", f"'{path}' is not a valid safetensors file (header length {n})",
                            "re-save or re-download that checkpoint")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in DTYPES or not 0 <= begin <= end <= size - 8 - n:
            raise UserError("modelset", f"'{path}': tensor {name} is truncated or has an unknown dtype "
                            f"({entry['dtype']})", "re-save or re-download that checkpoint")
    return 8 + n, header


class CheckpointReader:
    """Lazy, read-only view of one checkpoint's tensors; ``label`` names it in errors (e.g. modelset.experts.chem)."""

    def __init__(self, model_dir: Path, label: str):
        if sys.byteorder != "little":  # safetensors stores little-endian data
            raise NotImplementedError("reading safetensors on a big-endian machine")
        self.dir, self.label = Path(model_dir), label
        self._where: dict[str, tuple[Path, int, dict]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for path in shard_files(self.dir):
            start, header = read_header(path)
            for name, entry in header.items():
                self._where[name] = (path, start, entry)
                self.shapes[name] = tuple(entry["shape"])
                self.dtypes[name] = DTYPES[entry["dtype"]]

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def get(self, name: str) -> torch.Tensor:
        path, start, entry = self._where[name]
        begin, end = entry["data_offsets"]
        shape, dtype = self.shapes[name], self.dtypes[name]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        buf = bytearray(end - begin)
        with open(path, "rb", buffering=0) as f:
            f.seek(start + begin)
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    raise UserError(self.label, f"'{path}' ends inside tensor {name}", "re-save that checkpoint")
                got += n
        tensor = torch.frombuffer(buf, dtype=dtype).reshape(shape)
        return check_finite(tensor, self.label, name, f" in {self.dir}")


class MemorySource:
    """The same interface over tensors already in memory (the in-memory merge)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str):
        self.tensors, self.label = tensors, label
        self.shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        self.dtypes = {n: t.dtype for n, t in tensors.items()}

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def get(self, name: str) -> torch.Tensor:
        return check_finite(self.tensors[name], self.label, name)
