"""PEFT LoRA adapters as experts (CMM's GeLLMO, the medical paper's TachyHealth parent): applied to the base at
load as ``merge_and_unload`` would, in runs, merge-only and ``check``; an adapter of another base is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.child import run_module


def _adapter(base_dir: Path, out: Path, seed: int, base_name: str | None = None) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # LoRA's B starts at zero (a no-op): give the adapter something to say
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft.save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base_name or str(base_dir)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dir):
    where = tmp_path_factory.mktemp("adapters")
    return {"chem": _adapter(tiny_dir, where / "chem", 1), "units": _adapter(tiny_dir, where / "units", 2)}


def _overrides(base: Path, experts: dict[str, Path], *extra: str) -> list[str]:
    return [
        "+experiment=tiny",
        "benchmark.n_items=8",
        "eval.dtype=float32",
        f"modelset.base={base}",
        *[
            o
            for role, path in experts.items()
            for o in (f"modelset.experts.{role}.source={path}", f"modelset.experts.{role}.domain=null")
        ],
        *extra,
    ]


def test_an_adapter_is_applied_as_merge_and_unload_would(adapters, tiny_dir, tmp_path, cache):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mergeval.models.adapters import applied_adapter
    from mergeval.models.fingerprint import fingerprint, model_identity

    identity = model_identity(fingerprint(tiny_dir), tiny_dir)
    full = applied_adapter(adapters["chem"], tiny_dir, identity, str(tiny_dir), tmp_path, "modelset.experts.chem")
    want = (
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), str(adapters["chem"])
        )
        .merge_and_unload()
        .state_dict()
    )
    got = load_file(str(full / "model.safetensors"))
    assert set(got) <= set(want) and all(torch.equal(got[n], want[n]) for n in got)
    base = load_file(str(tiny_dir / "model.safetensors"))
    changed = {n for n in got if not torch.equal(got[n], base[n])}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)
    again = applied_adapter(adapters["chem"], tiny_dir, identity, str(tiny_dir), tmp_path, "modelset.experts.chem")
    assert again == full  # cached by the adapter's files and the base


def test_adapters_as_experts_merge_and_evaluate_in_a_run_and_merge_only(adapters, tiny_dir, tmp_path):
    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    outcome = app.run(
        compose_run_config(
            _overrides(tiny_dir, adapters, f"store.path={tmp_path / 's.sqlite'}", f"cache_dir={tmp_path / 'cache'}")
        ),
        tmp_path / "run",
    )
    assert [m.evaluated for m in outcome.models] == ["this run"] * 4
    assert all("adapters" in m.path for m in outcome.models[1:3])
    out = run_module(
        "mergeval.merge",
        *_overrides(tiny_dir, adapters, f"output={tmp_path / 'merged'}", f"cache_dir={tmp_path / 'cache'}"),
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    check = run_module(
        "mergeval.check", *_overrides(tiny_dir, adapters, f"cache_dir={tmp_path / 'cache'}"), cwd=tmp_path, timeout=600
    )
    assert check.returncode == 0 and "(a PEFT adapter" in check.stdout and "ready" in check.stdout, check.stdout[-3000:]


def test_an_adapter_of_another_base_is_one_line(adapters, tiny_dir, tmp_path):
    other = _adapter(tiny_dir, tmp_path / "other", 3, base_name=str(tmp_path))  # names another directory
    out = run_module(
        "mergeval",
        *_overrides(tiny_dir, {"chem": other, "units": adapters["units"]}, f"store.path={tmp_path / 's.sqlite'}"),
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert out.stderr.startswith(
        f"mergeval: error: modelset.experts.chem.source: is a LoRA adapter for {tmp_path}, not for the modelset's base"
    ), out.stderr
    hub = _adapter(tiny_dir, tmp_path / "hub", 4, base_name="meta-llama/Llama-3.2-3B")
    from mergeval.core.errors import UserError
    from mergeval.models.adapters import adapter_config, check_adapter_base

    with pytest.raises(UserError, match="for meta-llama/Llama-3.2-3B, not for the modelset's base hf:org/other"):
        check_adapter_base(adapter_config(hub, "f"), "hf:org/other", tmp_path, "f")
    shutil.rmtree(hub)
