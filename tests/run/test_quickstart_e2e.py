"""The real quickstart path on SmolLM2-135M-Instruct, with reduced settings.

Converts the packaged GGUF, fine-tunes both experts for a few steps, merges and
evaluates all four models on a few items of every task: proof that the main
job works on a fresh machine (about two minutes on two cores).
"""

from __future__ import annotations

import json

from tests.child import run_module


def test_quickstart_reduced(tmp_path, cache):
    args = ["+experiment=quickstart", "modelset.train.steps=3", "modelset.train.batch_size=4", "benchmark.n_items=16"]
    out = run_module("mergeval", *args, cwd=tmp_path, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.rglob("result.json")
    result = json.loads(path.read_text())
    models = {m["role"]: m for m in result["models"]}
    assert models["base"]["source"] == "smollm2"
    assert models["chem"]["source"] == "finetune:chem_count" and models["units"]["source"] == "finetune:unit_convert"
    assert len({m["fingerprint"] for m in models.values()}) == 4
    assert result["scores"]["mergeval_general_facts"]["base"]["n"] == 16
    # SmolLM2 knows common facts: far above the 25% chance level even on 16 items
    assert result["scores"]["mergeval_general_facts"]["base"]["value"] >= 0.5
    assert "Macro-Gain" in out.stdout
    # the quickstart spec's claims that hold at these reduced settings (specs/quickstart.yaml, tag ci)
    check = run_module(
        "mergeval.verify", "quickstart", "--run", str(path), "--tag", "ci", "--strict", cwd=tmp_path, timeout=300
    )
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-1000:]
