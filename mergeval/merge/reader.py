"""Tensor sources the engine reads one tensor at a time: checkpoint directories and in-memory mappings.

``CheckpointReader`` reads the safetensors headers of a checkpoint (the files
named by ``model.safetensors.index.json`` when there is one, else all
``*.safetensors``) up front and ``get(name)`` reads that one tensor's bytes
with ``readinto`` into a fresh buffer. It deliberately does not memory-map the
files (as ``safetensors.safe_open`` does): pages of a mapping that were read
stay in the process's resident set until it is unmapped, so a merge through
mappings grows its RSS by the size of all inputs; plain reads leave only the
tensors in use.

Every tensor is checked for NaN/Inf when it is read, so a bad input is found
without a separate pass and named in a one-line error. A row block read with
``check=False`` is left to its reader (the compiled merge kernel counts NaN/Inf
in every entry it reads; the engine then calls ``check_rows`` on a block it
refuses, for the same error).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from mergeval.core.errors import UserError
from mergeval.models.safetensors_io import DTYPES, INDEX, read_header, shard_files  # noqa: F401  (re-exported)


def check_finite(t: torch.Tensor, label: str, name: str, where: str = "") -> torch.Tensor:
    """``t``, or a UserError when it holds NaN or Inf (a NaN makes the min and max NaN: one reduction pass)."""
    if t.is_floating_point() and t.numel() and not all(map(math.isfinite, map(float, torch.aminmax(t)))):
        raise UserError(
            label,
            f"tensor {name}{where} contains NaN or Inf",
            "check that checkpoint (a failed fine-tune or conversion?); it cannot be merged",
        )
    return t


class RowChecks:
    """The NaN/Inf check of a source's row ranges (``label`` and ``where`` name the source in the error), each
    range once: a merger that reads a tensor in several passes (TIES' threshold passes) checks it once."""

    label: str
    where: str
    _finite: set[tuple[str, int, int]]  # ranges checked (adding to a set is atomic under the GIL: workers share it)

    def check_rows(self, name: str, r0: int, r1: int, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (rows r0..r1-1 of tensor ``name``), or a UserError when they hold NaN or Inf."""
        if (name, r0, r1) not in self._finite:
            check_finite(rows, self.label, name, self.where)
            self._finite.add((name, r0, r1))
        return rows


class CheckpointReader(RowChecks):
    """Lazy, read-only view of one checkpoint's tensors; ``label`` names it in errors (e.g. modelset.experts.chem)."""

    def __init__(self, model_dir: Path, label: str):
        if sys.byteorder != "little":  # safetensors stores little-endian data
            raise NotImplementedError("reading safetensors on a big-endian machine")
        self.dir, self.label = Path(model_dir), label
        self.where = f" in {self.dir}"
        self._where: dict[str, tuple[Path, int, dict]] = {}
        self._finite: set[tuple[str, int, int]] = set()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for path in shard_files(self.dir, label):
            start, header = read_header(path, label)
            for name, entry in header.items():
                self._where[name] = (path, start, entry)
                self.shapes[name] = tuple(entry["shape"])
                self.dtypes[name] = DTYPES[entry["dtype"]]

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def get(self, name: str) -> torch.Tensor:
        return self.get_rows(name, 0, self.shapes[name][0] if self.shapes[name] else 1)

    def get_rows(
        self, name: str, r0: int, r1: int, check: bool = True, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows r0..r1-1 (along dim 0) of one tensor, read from its file alone (a 0-dim tensor has one row);
        checked for NaN/Inf unless ``check`` is false. ``out``: a contiguous tensor of those rows' shape and
        dtype to read them into (execute.Blocks reads the experts' rows into one stack that way)."""
        path, start, entry = self._where[name]
        begin, end = entry["data_offsets"]
        shape, dtype = self.shapes[name], self.dtypes[name]
        rows = shape[0] if shape else 1
        row_bytes = (end - begin) // rows if rows else 0
        begin, end = begin + r0 * row_bytes, begin + r1 * row_bytes
        shape = (r1 - r0, *shape[1:]) if shape else shape
        if out is None:
            out = torch.empty(shape, dtype=dtype)  # uninitialised: every byte is read into it below
        elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"get_rows of {name}: out is {list(out.shape)} {out.dtype}, not {list(shape)} {dtype}")
        if end > begin:
            _read_into(path, start + begin, out.view(-1).view(torch.uint8).numpy(), self.label, name)
        return self.check_rows(name, r0, r1, out) if check else out


def _read_into(path: Path, offset: int, buf, label: str, name: str) -> None:
    """Fill ``buf`` with the bytes of ``path`` from ``offset`` (``os.preadv``: no file object, no seek; the read
    releases the GIL)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))  # O_BINARY: Windows' reads would translate
    try:
        view, got = memoryview(buf), 0
        while got < len(view):
            n = _read_at(fd, view[got:], offset + got)
            if not n:
                raise UserError(label, f"'{path}' ends inside tensor {name}", "re-save that checkpoint")
            got += n
    finally:
        os.close(fd)


def _read_at(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset``: ``os.preadv``, or where the platform lacks it (Windows, macOS before
    11) a seek and a read; the number of bytes read."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    os.lseek(fd, offset, os.SEEK_SET)
    with open(fd, "rb", buffering=0, closefd=False) as f:
        return f.readinto(view)


class MemorySource(RowChecks):
    """The same interface over tensors already in memory (the in-memory merge)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str, source_dir: Path | None = None):
        self.tensors, self.label = tensors, label
        self.where = f" in {source_dir}" if source_dir is not None else ""
        self.shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        self.dtypes = {n: t.dtype for n, t in tensors.items()}
        self._finite: set[tuple[str, int, int]] = set()

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def get(self, name: str) -> torch.Tensor:
        return check_finite(self.tensors[name], self.label, name, self.where)

    def get_rows(self, name: str, r0: int, r1: int, check: bool = True) -> torch.Tensor:
        """Rows r0..r1-1 (along dim 0) of one tensor, contiguous as CheckpointReader's are: a view of a contiguous
        tensor (the mergers only read their inputs), a copy of a block of any other layout; checked for NaN/Inf
        unless ``check`` is false."""
        tensor = self.tensors[name]
        rows = (tensor[r0:r1] if tensor.dim() else tensor).contiguous()
        return self.check_rows(name, r0, r1, rows) if check else rows
