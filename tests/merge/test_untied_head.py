"""Models whose ``lm_head`` is its own tensor (most LLMs: Llama-3-8B, Mistral, Qwen2-7B), not tied to the
embeddings as the tiny zoo's: every merge path merges the head like any other tensor. A planted bug that left
the merged head at the base's survived every method and engine test while all test models tied or dropped it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergeval.merge import merge_tensors, merge_to_disk
from mergeval.merge.reader import CheckpointReader
from mergeval.methods import get_method

HEAD = "lm_head.weight"


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A 2-layer Llama with an untied head, saved as a checkpoint, and two experts fine-tuned from it (every
    tensor, the head included, moved by a shared direction and noise of its own: their task vectors correlate,
    as fine-tunes of one base do, so Model Stock's ratio is not 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("untied")
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(root / "base", safe_serialization=True)
    base = load_file(str(root / "base" / "model.safetensors"))
    assert HEAD in base and not torch.equal(base[HEAD], base["model.embed_tokens.weight"])
    shared = torch.Generator().manual_seed(0)
    common = {n: torch.randn(t.shape, generator=shared) for n, t in base.items()}
    experts = []
    for i in (1, 2):
        g = torch.Generator().manual_seed(i)
        tensors = {n: t + 0.02 * common[n] + 0.01 * torch.randn(t.shape, generator=g) for n, t in base.items()}
        (root / f"e{i}").mkdir()
        (root / f"e{i}" / "config.json").write_text((root / "base" / "config.json").read_text())
        save_file(tensors, str(root / f"e{i}" / "model.safetensors"), metadata={"format": "pt"})
        experts.append(root / f"e{i}")
    return root / "base", experts


@pytest.mark.parametrize(
    "name,params",
    [
        ("task_arithmetic", {"lambda_": 0.8}),
        ("ties", {"density": 0.5}),
        ("dare_ties", {"density": 0.5}),
        ("linear", {}),
        ("slerp", {"t": 0.3}),
        ("breadcrumbs", {}),
        ("della", {}),
        ("model_stock", {}),
    ],
)
def test_the_head_is_merged_like_any_tensor(untied, tmp_path, name, params):
    base_dir, expert_dirs = untied
    method = get_method(name)
    cfg = method.config(**params)
    experts = expert_dirs[:1] if name == "slerp" else expert_dirs
    base = load_file(str(base_dir / "model.safetensors"))
    own = [load_file(str(e / "model.safetensors")) for e in experts]
    alone = merge_tensors(method, cfg, {HEAD: base[HEAD]}, [{HEAD: e[HEAD]} for e in own], seed=3)[HEAD]
    in_memory = merge_tensors(method, cfg, base, own, seed=3)
    out = merge_to_disk(method, cfg, base_dir, experts, tmp_path / "out", seed=3)
    on_disk = CheckpointReader(out, "out").get(HEAD)
    assert not torch.equal(in_memory[HEAD], base[HEAD])  # not left at the base's
    assert torch.equal(in_memory[HEAD], alone) and torch.equal(on_disk, alone)


def test_task_arithmetic_gives_the_heads_formula(untied):
    """theta = b + lambda * sum_i (e_i - b), on the head as on every tensor."""
    base_dir, expert_dirs = untied
    method = get_method("task_arithmetic")
    base = load_file(str(base_dir / "model.safetensors"))
    own = [load_file(str(e / "model.safetensors")) for e in expert_dirs]
    merged = merge_tensors(method, method.config(lambda_=0.8), base, own, seed=0)[HEAD]
    expected = base[HEAD] + 0.8 * sum(e[HEAD] - base[HEAD] for e in own)
    torch.testing.assert_close(merged, expected, atol=1e-6, rtol=0)
