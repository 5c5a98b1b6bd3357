"""Content fingerprints of safetensors checkpoints, and the identity of a model as evaluated.

Two digests, for two questions:

- ``fingerprint`` (the weights): which tensors a checkpoint holds. Two copies of the
  same weights have the same one; ``_refuse_a_copy`` and mergekit parity use it.
- ``model_identity`` (what is evaluated): the weights together with every other file
  that can change a model's outputs or its prompts: config.json (the forward pass:
  activation, norm epsilon, RoPE scaling...), generation_config.json, custom code,
  and the tokenizer's files (its normalizer, special tokens, chat template) of the
  tokenizer the evaluation actually uses. The results store keys evaluations,
  merges, claims and cached statistics by it, so two checkpoints that share their
  weights but not these files never share a score.

fingerprint = BLAKE3 (128-bit output) over, for each tensor in name order:
name, dtype, shape and raw bytes. It identifies the weights, not the path: a
copy of a model has the same fingerprint. Results are cached per file (path,
size, mtime, ``SCHEME``) in ``<cache>/fingerprints.json`` so an unchanged
file is never hashed twice.

Why BLAKE3: a staged sweep or a search fingerprints every candidate it merges
in memory, so hashing sits on the sweep's path. BLAKE3 is a cryptographic hash
like the blake2b used before, and its tree mode spreads one input over every
core with the same digest whatever the thread count, where blake2b runs on one
core at a lower speed: several times faster per checkpoint, which matters most
for the many gigabytes of a large model. The change gave every model
a new fingerprint, so stores and caches keyed by the old ones are not reused
(zoo experts, keyed by their base's fingerprint, are built once more).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from blake3 import blake3
from safetensors import safe_open

from mergeval.core.paths import atomic_write_text
from mergeval.models.safetensors_io import read_header

SCHEME = "blake3-128"  # in the cache's keys: a digest cached under another scheme is never returned


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


_forked = False  # set in a child made by os.fork (multiprocessing's default start method on Linux)


def _mark_forked() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_mark_forked)


def _hasher() -> blake3:
    """A BLAKE3 hasher on every core (the digest does not depend on the thread count), or on the calling thread
    alone in a forked child: BLAKE3's worker threads are a process-wide pool that a fork does not copy, so a
    child of a process that had hashed waited forever for them."""
    return blake3(max_threads=1 if _forked else blake3.AUTO)


def _hash_tensor(h: blake3, name: str, t: torch.Tensor) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().data)


def _digest(h: blake3) -> str:
    return h.hexdigest(length=16)


def fingerprint_state_dict(state: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint a checkpoint of ``state`` would have (for merges kept in memory)."""
    h = _hasher()
    for name in sorted(state):
        _hash_tensor(h, name, state[name])
    return _digest(h)


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
    keys = "|".join([SCHEME] + [_file_key(p) for p in files])
    cache = _read_cache(cache_file)
    if keys in cache:
        return cache[keys]
    h = _hasher()
    owner = {}
    for path in files:
        owner.update({name: path for name in read_header(path, label)[1]})
    for name in sorted(owner):  # global name order, so sharding does not change the fingerprint
        with safe_open(str(owner[name]), framework="pt") as f:
            _hash_tensor(h, name, f.get_tensor(name))
    digest = _digest(h)
    if cache_file:
        cache = _read_cache(cache_file)
        cache[keys] = digest
        atomic_write_text(cache_file, json.dumps(cache, indent=0))
    return digest


# Files a model directory may hold that cannot change what the model computes or how a prompt is tokenized:
# documentation, repository metadata, pictures, and mergeval's own notes (an expert's training log holds losses
# that differ between CPU families). Names are compared in lower case.
INERT_PREFIXES = ("readme", "license", "licence", "notice", "use_policy", "mergeval-")
INERT_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf", ".webp")
# Weights, covered by ``fingerprint`` (in the format mergeval reads) or not read at all (other frameworks'
# formats beside the safetensors files), and the shard index (sharding does not change the weights).
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".npz",
    ".ot",
)
# What AutoTokenizer reads from a directory (besides config.json, read only when tokenizer_config.json does not
# name the tokenizer's class).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Keys of a JSON file that record where or with what it was written, not what it does.
PROVENANCE_KEYS = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")
IDENTITY_SCHEME = "identity-1"  # raise when what the identity covers changes: every stored score is keyed anew


def is_inert(name: str) -> bool:
    """Whether a top-level file ``name`` of a model directory cannot change the model's outputs."""
    low = name.lower()
    return low.startswith(".") or low.startswith(INERT_PREFIXES) or low.endswith(INERT_SUFFIXES)


def _content(path: Path) -> bytes:
    """A file's bytes as the identity sees them: JSON parsed and written canonically without its provenance
    keys (so re-saving a config with another transformers version, or other whitespace, keeps the identity);
    anything else, and JSON that does not parse, as it is."""
    raw = path.read_bytes()
    if path.suffix != ".json":
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in PROVENANCE_KEYS}
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _files_digest(h: blake3, label: str, paths: list[Path]) -> None:
    for path in sorted(paths, key=lambda p: p.name):
        data = _content(path)
        h.update(f"{label}|{path.name}|{len(data)}|".encode())
        h.update(data)


def model_files(model_dir: Path) -> list[Path]:
    """The top-level files of ``model_dir`` that shape the forward pass and generation (config.json,
    generation_config.json, custom code...): everything but the weights, the tokenizer's files and inert
    files."""
    return [
        p
        for p in model_dir.iterdir()
        if p.is_file()
        and not is_inert(p.name)
        and not p.name.lower().endswith(WEIGHT_SUFFIXES)
        and p.name not in TOKENIZER_FILES
    ]


def tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    return [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]


def model_identity(weights: str, model_dir: Path, tokenizer_dir: Path | None = None) -> str:
    """The identity of a model as evaluated: BLAKE3 (128-bit) over ``IDENTITY_SCHEME``, the weights'
    ``fingerprint``, the files of ``model_dir`` that shape its forward pass and generation (``model_files``),
    and the tokenizer files of ``tokenizer_dir`` (the tokenizer the evaluation loads; ``model_dir``'s own by
    default), each file by name and canonical content.

    A merge kept in memory has the base's config and tokenizer: its identity is ``model_identity(<its
    weights' fingerprint>, base_dir)``."""
    h = blake3(max_threads=1)  # a few small files: the thread pool would cost more than it saves
    h.update(f"{IDENTITY_SCHEME}|weights|{weights}|".encode())
    _files_digest(h, "model", model_files(model_dir))
    _files_digest(h, "tokenizer", tokenizer_files(tokenizer_dir or model_dir))
    return _digest(h)
