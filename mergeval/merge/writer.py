"""Write a merged model directory: sharded safetensors, index, config, tokenizer, model card.

``ShardWriter`` knows every output tensor's name, shape and dtype before the
first one is merged (they follow from the base and the plan), so it fixes the
shard layout and each shard's safetensors header up front and then appends
each tensor's bytes as it arrives: no shard is ever held in memory. The format
(https://github.com/huggingface/safetensors): 8-byte little-endian header
length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]},
"__metadata__": {...}} padded with spaces to a multiple of 8, then the data.

Shards are filled in order up to ``shard_size`` bytes (a larger tensor gets a
shard of its own). One shard is ``model.safetensors``; several are
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``,
as transformers writes them. Callers write into ``paths.atomic_dir``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from mergeval.merge.reader import DTYPES, INDEX
from mergeval.models.fingerprint import TOKENIZER_FILES

DEFAULT_SHARD_SIZE = 5 * 1000**3  # 5 GB, transformers' and mergekit's default
SAFETENSORS_DTYPE = {dtype: code for code, dtype in DTYPES.items()}


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def assign_shards(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], shard_size: int) -> list[list[str]]:
    """Consecutive groups of tensor names, each at most ``shard_size`` bytes (or a single larger tensor)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in specs.items():
        b = nbytes(shape, dtype)
        if shards[-1] and size + b > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    return shards


def _header(names: list[str], specs) -> bytes:
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        shape, dtype = specs[name]
        end = offset + nbytes(shape, dtype)
        entries[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class ShardWriter:
    """Streams tensors, given in the order of ``specs`` (name -> (shape, dtype)), into sharded safetensors."""

    def __init__(
        self,
        out_dir: Path,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        shard_size: int = DEFAULT_SHARD_SIZE,
    ):
        if shard_size < 1:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        self.out_dir, self.specs = Path(out_dir), dict(specs)
        self.shards = assign_shards(self.specs, shard_size)
        n = len(self.shards)
        self.files = (
            ["model.safetensors"] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        )
        self._order = [(k, name) for k, names in enumerate(self.shards) for name in names]
        self._next = 0
        self._file: BinaryIO | None = None

    def write(self, name: str, tensor) -> None:
        """Append the next tensor: a torch.Tensor, an iterable of its row blocks in order, or an execute.Blocks,
        whose blocks the threads that merge them write in place (``_write_in_place``)."""
        shard, expected = self._order[self._next]
        shape, dtype = self.specs[expected]
        if self._file is None:
            self._file = open(self.out_dir / self.files[shard], "wb")
            self._file.write(_header(self.shards[shard], self.specs))
        file = self._file
        if hasattr(tensor, "written"):
            rows = self._write_in_place(file, name, tensor, expected, shape, dtype, self.out_dir / self.files[shard])
        else:
            rows = 0
            for block in [tensor] if isinstance(tensor, torch.Tensor) else tensor:
                rows += self._append(file, name, block, expected, shape, dtype, isinstance(tensor, torch.Tensor))
        if (rows if shape else 1) != (shape[0] if shape else 1):
            raise ValueError(f"writer expected {expected} with {shape[0]} rows, got {rows}")
        self._next += 1
        if self._next == len(self._order) or self._order[self._next][0] != shard:
            file.close()
            self._file = None

    def _append(self, file: BinaryIO, name: str, block: torch.Tensor, expected: str, shape, dtype, whole: bool) -> int:
        """Write one block's bytes after checking it against the spec; its number of rows."""
        _check_block(name, block, expected, shape, dtype, whole)
        if block.numel():
            file.write(_bytes_of(block))
        return block.shape[0] if block.dim() else 1

    def _write_in_place(self, file: BinaryIO, name: str, blocks, expected: str, shape, dtype, path: Path) -> int:
        """Write a tensor's row blocks (an execute.Blocks) at their offsets in the shard, each by the thread that
        merged it (``os.pwrite``), as they are merged; the number of rows written.

        Why: copying the output into the page cache can be the slowest memory traffic of a merge to disk (the
        pages the file gets new are first touched by the copy, far slower than reading the inputs), and one
        consuming thread doing all of it made the workers wait on it at the merge's end; written by the
        threads that merged them, the blocks' copies run in parallel with the merging. Each block's
        write opens the shard by its path: a thread still finishing a block after the merge stopped (an
        interruption, an error) can only write into that shard, never into a file opened later under a
        reused descriptor; the shard is removed with the merge's temporary directory."""
        file.flush()
        start = file.tell()
        row_bytes = nbytes(shape[1:], dtype)

        def write_block(first_row: int, block: torch.Tensor) -> None:
            _check_block(name, block, expected, shape, dtype, whole=False)
            data, at = _bytes_of(block), start + first_row * row_bytes
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_BINARY", 0))
            try:
                while data:
                    done = _write_at(fd, data, at)
                    data, at = data[done:], at + done
            finally:
                os.close(fd)

        rows = sum(blocks.written(write_block))
        file.seek(start + rows * row_bytes)
        return rows

    def finish(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"writer got {self._next} of {len(self._order)} tensors")
        if len(self.files) > 1:
            weight_map = {name: self.files[k] for k, name in self._order}
            total = sum(nbytes(*spec) for spec in self.specs.values())
            (self.out_dir / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
            )

    def close(self) -> None:
        """Release the open shard (after an error; the caller's atomic_dir removes the files)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _check_block(name: str, block: torch.Tensor, expected: str, shape, dtype, whole: bool) -> None:
    """A ValueError (a bug) unless ``block`` is the expected tensor (``whole``) or rows of it, in its dtype."""
    block_shape = tuple(block.shape) if whole else tuple(block.shape[1:])
    if name != expected or block_shape != (shape if whole else shape[1:]) or block.dtype != dtype:
        raise ValueError(
            f"writer expected {expected} {list(shape)} {dtype}, got {name} {list(block.shape)} {block.dtype}"
        )


def _write_at(fd: int, data: memoryview, at: int) -> int:
    """Write ``data`` at offset ``at``: ``os.pwrite``, or where the platform lacks it (Windows) a seek and a write
    on this block's own descriptor; the number of bytes written."""
    if hasattr(os, "pwrite"):
        return os.pwrite(fd, data, at)
    os.lseek(fd, at, os.SEEK_SET)
    return os.write(fd, data)


def _bytes_of(block: torch.Tensor) -> memoryview:
    return block.detach().contiguous().view(-1).view(torch.uint8).numpy().data


def output_specs(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], out_dtype: str | None) -> dict:
    """``specs`` with every floating tensor's dtype replaced by ``out_dtype`` (a torch dtype name; None: as is)."""
    if out_dtype is None:
        return dict(specs)
    to = getattr(torch, out_dtype)
    return {n: (shape, to if dtype.is_floating_point else dtype) for n, (shape, dtype) in specs.items()}


def cast_to(tensor, dtype: torch.dtype):
    """A tensor, an execute.Blocks (each block cast by the thread that merges it) or an iterable of row blocks
    (cast lazily, one at a time), cast to ``dtype``."""
    if isinstance(tensor, torch.Tensor):
        return tensor.to(dtype)
    if hasattr(tensor, "cast"):
        return tensor.cast(dtype)
    return (block.to(dtype) for block in tensor)


def copy_model_files(
    out_dir: Path, base_dir: Path, tokenizer_dir: Path, vocab_size: int | None = None, out_dtype: str | None = None
) -> None:
    """config.json and generation_config.json from the base (vocab_size replaced when given; the dtype it names
    replaced by ``out_dtype`` when given), tokenizer files (chat template included) from ``tokenizer_dir``."""
    config = json.loads((base_dir / "config.json").read_text())
    if vocab_size is not None:
        holder = config if "vocab_size" in config or "text_config" not in config else config["text_config"]
        holder["vocab_size"] = vocab_size
    if out_dtype is not None:  # transformers 5 writes "dtype", 4 "torch_dtype"; both read the latter
        for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
            config[key] = out_dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (base_dir / "generation_config.json").exists():
        shutil.copy2(base_dir / "generation_config.json", out_dir / "generation_config.json")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out_dir / name)
