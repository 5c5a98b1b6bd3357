"""Experts padded beyond the base's vocabulary, as MergeBench's Llama-3.2-3B experts are (128,320 embedding and
head rows against the base's 128,256): merged and evaluated in a run and in merge-only, tiny models built in that
shape (the embedding padded, config.json's vocab_size raised, the tokenizer the base's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.child import run_module

PAD = 16  # extra rows, as MergeBench's experts carry 64


def _padded(src: Path, dst: Path, seed: int) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    vocab = [n for n in tensors if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    for name in vocab:
        t = tensors[name]
        tensors[name] = torch.cat([t, torch.randn(PAD, *t.shape[1:], generator=gen, dtype=t.dtype)])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] += PAD
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def padded(tmp_path_factory, cache):
    """The tiny base and two experts fine-tuned from it, the experts padded by PAD rows."""
    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    where = tmp_path_factory.mktemp("padded")
    built = app.run(
        compose_run_config(
            [
                "+experiment=tiny",
                "benchmark.n_items=8",
                "modelset.train.steps=1",
                "eval.dtype=float32",
                f"store.path={where / 'zoo.sqlite'}",
            ]
        ),
        where / "zoo",
    )
    paths = {m.role: Path(m.path) for m in built.models if m.path}
    out = {"base": paths["base"]}
    for seed, role in enumerate(("chem", "units")):
        out[role] = _padded(paths[role], where / role, seed)
    return out


def _overrides(models: dict[str, Path], *extra: str) -> list[str]:
    return [
        "+experiment=tiny",
        "benchmark.n_items=8",
        "eval.dtype=float32",
        f"modelset.base={models['base']}",
        *[
            o
            for role in ("chem", "units")
            for o in (f"modelset.experts.{role}.source={models[role]}", f"modelset.experts.{role}.domain=null")
        ],
        *extra,
    ]


def test_the_default_policy_refuses_padded_experts_and_names_base(padded, tmp_path):
    out = run_module("mergeval", *_overrides(padded, f"store.path={tmp_path / 's.sqlite'}"), cwd=tmp_path, timeout=600)
    assert out.returncode == 2 and "vocab_policy=base" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("policy", ["base", "truncate"])
def test_padded_experts_merge_and_evaluate_in_a_run(policy, padded, tmp_path):
    """base keeps the base's embedding as it is (MergeBench); truncate merges the shared rows. Both give the
    base's shape, so the merge evaluates in the base's architecture (truncate was refused with a reason that is
    false here)."""
    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    cfg = compose_run_config(
        _overrides(padded, f"vocab_policy={policy}", "save_merged=true", f"store.path={tmp_path / 's.sqlite'}")
    )
    outcome = app.run(cfg, tmp_path / "run")
    assert [m.evaluated for m in outcome.models] == ["this run"] * 4
    merged = load_file(str(Path(outcome.models[-1].path) / "model.safetensors"))
    base = load_file(str(padded["base"] / "model.safetensors"))
    chem = load_file(str(padded["chem"] / "model.safetensors"))
    units = load_file(str(padded["units"] / "model.safetensors"))
    name = "model.embed_tokens.weight"
    assert merged[name].shape == base[name].shape
    if policy == "base":
        assert torch.equal(merged[name], base[name])
    else:  # task arithmetic (lambda 1) over the shared rows
        rows = base[name].shape[0]
        want = base[name] + (chem[name][:rows] - base[name]) + (units[name][:rows] - base[name])
        torch.testing.assert_close(merged[name], want, rtol=0, atol=1e-6)
    layer = "model.layers.0.mlp.down_proj.weight"  # the rest is merged as usual
    torch.testing.assert_close(
        merged[layer], base[layer] + (chem[layer] - base[layer]) + (units[layer] - base[layer]), rtol=0, atol=1e-6
    )


def test_padded_experts_merge_to_disk_with_the_base_policy(padded, tmp_path):
    out = run_module(
        "mergeval.merge",
        *_overrides(padded, "vocab_policy=base", f"output={tmp_path / 'out'}"),
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    base = load_file(str(padded["base"] / "model.safetensors"))
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vocab_size"] == json.loads((padded["base"] / "config.json").read_text())["vocab_size"]


def test_truncate_below_the_base_is_still_refused_in_a_run_with_the_true_reason(padded, tmp_path):
    out = run_module(
        "mergeval",
        *_overrides(
            {**padded, "base": padded["chem"], "chem": padded["base"]},
            "vocab_policy=truncate",
            f"store.path={tmp_path / 's.sqlite'}",
        ),
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 2 and "fewer than the base's" in out.stderr, out.stderr[-2000:]
