"""Quantized checkpoints: block-wise fp8 (transformers' fine-grained FP8) dequantized once at load and merged
like any model; a format that needs its own kernels (bitsandbytes, GPTQ...) is one line naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from tests.child import run_module

BLOCK = (8, 8)


def _fp8_blocks(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W as float8 with one scale per block (what a published fp8 checkpoint holds)."""
    bm, bn = block
    m, n = w.shape
    scale = torch.ones(-(-m // bm), -(-n // bn))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return (w / full).to(torch.float8_e4m3fn), scale


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 20), st.integers(1, 20), st.integers(0, 2**31 - 1))
def test_dequantize_fp8_blocks_is_the_formula(m, n, seed):
    from mergeval.models.quantized import dequantize_fp8_blocks

    w = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    q, scale = _fp8_blocks(w)
    got = dequantize_fp8_blocks(q, scale, BLOCK)
    want = torch.tensor([[float(q[i, j].float()) * float(scale[i // 8, j // 8]) for j in range(n)] for i in range(m)])
    assert torch.equal(got, want)
    assert torch.allclose(got, w, rtol=0.07, atol=1e-6)  # e4m3 keeps 3 mantissa bits


def _quantized_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        tensors[name], tensors[name + "_scale_inv"] = _fp8_blocks(tensors[name])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_fp8_parent_is_dequantized_and_merged_in_a_run(tiny_dir, tmp_path, cache):
    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    built = app.run(
        compose_run_config(
            [
                "+experiment=tiny",
                "benchmark.n_items=8",
                "modelset.train.steps=1",
                "eval.dtype=float32",
                f"store.path={tmp_path / 'zoo.sqlite'}",
            ]
        ),
        tmp_path / "zoo",
    )
    paths = {m.role: Path(m.path) for m in built.models if m.path}
    chem = _quantized_copy(paths["chem"], tmp_path / "chem_fp8")
    overrides = [
        "+experiment=tiny",
        "benchmark.n_items=8",
        "eval.dtype=float32",
        f"modelset.base={paths['base']}",
        f"modelset.experts.chem.source={chem}",
        "modelset.experts.chem.domain=null",
        f"modelset.experts.units.source={paths['units']}",
        "modelset.experts.units.domain=null",
        f"store.path={tmp_path / 's.sqlite'}",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    outcome = app.run(compose_run_config(overrides), tmp_path / "run")
    assert [m.evaluated for m in outcome.models] == ["this run"] * 4
    used = Path(outcome.models[1].path)
    assert "dequantized" in str(used) and "quantization_config" not in json.loads((used / "config.json").read_text())
    deq = load_file(str(used / "model.safetensors"))
    original = load_file(str(paths["chem"] / "model.safetensors"))
    assert set(deq) == set(original)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert deq[name].dtype == torch.float32 and torch.allclose(deq[name], original[name], rtol=0.07, atol=1e-6)
    check = run_module("mergeval.check", *overrides[:-2], f"cache_dir={tmp_path / 'cache'}", cwd=tmp_path, timeout=600)
    assert check.returncode == 0 and "dequantized when" in check.stdout, check.stdout[-3000:]


@pytest.mark.parametrize(
    "quant,shown",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes, 4-bit"),
        ({"quant_method": "gptq", "bits": 4}, "gptq, 4-bit"),
    ],
)
def test_a_format_that_needs_its_kernels_is_one_line_naming_it(quant, shown, tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "q")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = quant
    (model / "config.json").write_text(json.dumps(config))
    out = run_module(
        "mergeval",
        "+experiment=tiny",
        f"modelset.base={model}",
        f"store.path={tmp_path / 's.sqlite'}",
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert out.stderr.startswith(
        f"mergeval: error: modelset.base: '{model}' is quantized ({shown}), which mergeval cannot dequantize on a CPU"
    ), out.stderr
