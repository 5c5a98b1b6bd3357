"""Model sources, fingerprints and the compatibility check, on the tiny zoo model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergeval.core.errors import UserError
from mergeval.models.checkpoint import check_compatible, load_model, load_tensors
from mergeval.models.fingerprint import fingerprint, fingerprint_state_dict
from mergeval.models.zoo.sources import resolve_source


def copy_with(src, dst, change=None):
    shutil.copytree(src, dst)
    if change:
        tensors = load_file(str(dst / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_fingerprint_is_content_based_and_cached(tiny_dir, tmp_path):
    cache_file = tmp_path / "fp.json"
    fp = fingerprint(tiny_dir, cache_file)
    assert fp == fingerprint_state_dict(load_tensors(tiny_dir))
    assert json.loads(cache_file.read_text())  # cached by (path, size, mtime)
    assert fingerprint(copy_with(tiny_dir, tmp_path / "copy"), cache_file) == fp
    changed = copy_with(tiny_dir, tmp_path / "changed", lambda t: t["model.norm.weight"].add_(1e-3))
    assert fingerprint(changed, cache_file) != fp


def test_fingerprint_cache_is_used(tiny_dir, tmp_path, monkeypatch):
    cache_file = tmp_path / "fp.json"
    fp = fingerprint(tiny_dir, cache_file)
    import mergeval.models.fingerprint as module

    monkeypatch.setattr(module, "_hash_tensor", lambda *a: pytest.fail("re-hashed an unchanged file"))
    assert fingerprint(tiny_dir, cache_file) == fp


def test_fingerprint_is_the_documented_formula(tiny_dir):
    # BLAKE3, 128 bits, over name|dtype|shape| and the raw bytes of each tensor in name order; one thread here,
    # every core in the code: BLAKE3's tree gives the same digest either way
    from blake3 import blake3

    tensors = load_tensors(tiny_dir)
    h = blake3(max_threads=1)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    assert fingerprint_state_dict(tensors) == fingerprint(tiny_dir) == h.hexdigest(length=16)


def test_a_forked_child_of_a_process_that_hashed_can_hash():
    # BLAKE3's threads are a process-wide pool that os.fork does not copy: a child that hashed on every core
    # after its parent had hung for good; children hash on their own thread. 64 MB: large enough for BLAKE3 to
    # use its threads (the tiny model's tensors are not)
    import os
    import time

    tensors = {"w": torch.arange(1 << 24, dtype=torch.float32)}
    want = fingerprint_state_dict(tensors)  # the parent starts the pool
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its fingerprint and leave without running the parent's cleanup
        try:
            os.write(write, fingerprint_state_dict(tensors).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60  # a hang guard, not a speed limit: the child takes milliseconds
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if done == (0, 0):
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    got = os.read(read, 64).decode()
    os.close(read)
    assert done != (0, 0), "the forked child hung hashing"
    assert got == want


def test_a_digest_cached_by_another_scheme_is_not_returned(tiny_dir, tmp_path):
    import mergeval.models.fingerprint as module

    cache_file = tmp_path / "fp.json"
    old_key = "|".join(module._file_key(p) for p in module.safetensors_files(tiny_dir))  # the blake2b cache's key
    cache_file.write_text(json.dumps({old_key: "0" * 32}))
    assert fingerprint(tiny_dir, cache_file) == fingerprint_state_dict(load_tensors(tiny_dir)) != "0" * 32


def test_shape_mismatch_is_a_clear_error(tiny_dir, tmp_path):
    def widen(t):
        t["model.norm.weight"] = torch.ones(33)

    other = copy_with(tiny_dir, tmp_path / "other", widen)
    with pytest.raises(UserError, match=r"model.norm.weight has shape \[33\] but the base has \[32\]") as err:
        check_compatible(tiny_dir, {"bad": other})
    assert err.value.field == "modelset.experts.bad"


def test_architecture_mismatch_is_a_clear_error(tiny_dir, tmp_path):
    other = copy_with(tiny_dir, tmp_path / "deeper")
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="num_hidden_layers"):
        check_compatible(tiny_dir, {"deeper": other})


def test_sources(tiny_dir, cache, tmp_path):
    # the same directory (under xdist the cache's models/ is a link to the workers' shared one)
    assert resolve_source(str(tiny_dir), "f", cache, offline=True).resolve() == tiny_dir.resolve()
    assert resolve_source("zoo:tiny", "f", cache, offline=True).resolve() == tiny_dir.resolve()
    with pytest.raises(UserError, match="no such model directory"):
        resolve_source(str(tmp_path / "missing"), "modelset.base", cache, offline=True)
    with pytest.raises(UserError, match="unknown zoo model"):
        resolve_source("zoo:huge", "modelset.base", cache, offline=True)
    with pytest.raises(UserError, match="offline") as err:
        resolve_source("hf:HuggingFaceTB/SmolLM2-1.7B-Instruct", "modelset.base", cache, offline=True)
    assert err.value.field == "modelset.base"


def test_load_model_with_merged_tensors(tiny_dir):
    tensors = {k: v * 0 for k, v in load_tensors(tiny_dir).items()}
    model = load_model(tiny_dir, tensors)
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())


def test_the_smollm2_conversion_gives_the_pinned_weights(cache):
    # Every expert, score and verdict record was made from these weights: a change in transformers' or gguf's
    # dequantisation, or in how the conversion shares their parsing (smollm2._parsed_once), shows here first.
    from mergeval.models.smollm2 import smollm2_dir

    # (blake2b, the scheme before 2026-12-05, gave e9bbcdac5085b7d65c7873f55f4770aa for these weights)
    assert fingerprint(smollm2_dir(cache, "modelset.base")) == "8da540b186f62fac1a409023a21bdd1a"


def test_the_conversion_shares_gguf_parsing_only_inside_its_block():
    import gguf

    from mergeval.models.smollm2 import _parsed_once

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = next(iter(gguf.MODEL_ARCH_NAMES))
    with _parsed_once():
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.GGUFReader is not reader
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)


def test_the_tokenizer_check_compares_bytes_before_parsing(tiny_dir, tmp_path, monkeypatch):
    """An expert carrying the base's tokenizer.json unchanged is accepted without parsing either file (0.05 s
    each for SmolLM2's, a fixed cost of every merge); one whose file differs in bytes only (another layout,
    another padding setting) is parsed and accepted; one with other tokens is refused."""
    from mergeval.models import checkpoint

    parsed = []
    real = checkpoint._tokenizing_file
    monkeypatch.setattr(checkpoint, "_tokenizing_file", lambda *a: parsed.append(a[0]) or real(*a))
    same = copy_with(tiny_dir, tmp_path / "same")
    check_compatible(tiny_dir, {"same": same})
    assert parsed == []

    layout = copy_with(tiny_dir, tmp_path / "layout")
    doc = json.loads((layout / "tokenizer.json").read_text())
    doc["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Left",
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<pad>",
        "pad_to_multiple_of": None,
    }
    (layout / "tokenizer.json").write_text(json.dumps(doc, indent=4))
    check_compatible(tiny_dir, {"layout": layout})
    assert sorted(Path(p).parent.name for p in parsed) == sorted([tiny_dir.resolve().name, "layout"])

    swapped = copy_with(tiny_dir, tmp_path / "swapped")
    vocab = doc["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match=r"its tokenizer differs from the base's \(model in tokenizer.json\)"):
        check_compatible(tiny_dir, {"swapped": swapped})


def test_a_damaged_build_in_mergevals_own_cache_is_removed_and_built_again(tmp_path, capsys):
    """A truncated file in a checkpoint mergeval built itself (a full disk, a killed copy) is mergeval's to fix:
    the line once told the user to re-download a model they never downloaded."""
    from mergeval.models.zoo.tiny import zoo_dir

    first = zoo_dir("tiny", tmp_path)
    weights = fingerprint(first)
    shard = first / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    again = zoo_dir("tiny", tmp_path)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mergeval:")]
    assert again == first and fingerprint(again) == weights
    assert len(said) == 1 and "zoo:tiny: the cached build" in said[0] and "building it again" in said[0]


def test_a_bin_only_model_is_told_what_it_lacks(tiny_dir, tmp_path):
    model = tmp_path / "bin_only"
    model.mkdir()
    (model / "config.json").write_text((tiny_dir / "config.json").read_text())
    (model / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(
        UserError,
        match=r"has its weights only as pytorch_model.bin .*save_pretrained\(DIR, "
        r"safe_serialization=True\)",
    ) as err:
        resolve_source(str(model), "modelset.base", tmp_path, True)
    assert "no config.json" not in str(err.value)
