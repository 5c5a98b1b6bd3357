"""Content fingerprints of safetensors checkpoints.

fingerprint = blake2b over, for each tensor in name order: name, dtype, shape
and raw bytes. It identifies the weights, not the path: a copy of a model has
the same fingerprint. Results are cached per file (path, size, mtime) in
``<cache>/fingerprints.json`` so an unchanged file is never hashed twice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from mergeval.models.safetensors_io import read_header
from mergeval.paths import atomic_write_text

_CHUNK = 1 << 24


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _hash_tensor(h: "hashlib._Hash", name: str, t: torch.Tensor) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
    data = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else b""
    for i in range(0, len(data), _CHUNK):
        h.update(data[i:i + _CHUNK])


def fingerprint_state_dict(state: dict[str, torch.Tensor]) -> str:
    """The fingerprint a checkpoint of ``state`` would have (for merges kept in memory)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        _hash_tensor(h, name, state[name])
    return h.hexdigest()


def safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def _read_cache(cache_file: Path | None) -> dict:
    """The fingerprint cache; an unreadable or damaged one is treated as empty (it is only a cache)."""
    try:
        cache = json.loads(cache_file.read_text()) if cache_file else {}
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def fingerprint(model_dir: Path, cache_file: Path | None = None, label: str = "modelset") -> str:
    """Fingerprint of all ``*.safetensors`` in ``model_dir`` (tensor names are unique across shards)."""
    files = safetensors_files(model_dir)
    keys = "|".join(_file_key(p) for p in files)
    cache = _read_cache(cache_file)
    if keys in cache:
        return cache[keys]
    h = hashlib.blake2b(digest_size=16)
    owner = {}
    for path in files:
        owner.update({name: path for name in read_header(path, label)[1]})
    for name in sorted(owner):  # global name order, so sharding does not change the fingerprint
        with safe_open(str(owner[name]), framework="pt") as f:
            _hash_tensor(h, name, f.get_tensor(name))
    digest = h.hexdigest()
    if cache_file:
        cache = _read_cache(cache_file)
        cache[keys] = digest
        atomic_write_text(cache_file, json.dumps(cache, indent=0))
    return digest
