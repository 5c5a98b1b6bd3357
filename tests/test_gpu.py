"""GPU paths (eval.device=cuda, merge.device, eval.backend=vllm): skipped where torch sees no CUDA device."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.child import run_module

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_scores_equal_cpu_scores_in_float32(tiny_dir, cache):
    from transformers import AutoTokenizer

    from mergeval.eval.harness import Harness
    from mergeval.eval.suite import build_suite
    from mergeval.models.checkpoint import load_model
    from tests.test_registry_tasks import bench, eval_cfg

    suite = build_suite(bench(tasks=["hellaswag", "gsm8k", "wikitext"]), eval_cfg(), cache)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    got = {}
    for device in ("cpu", "cuda"):
        model = load_model(tiny_dir, None, torch.float32).to(device)
        got[device] = Harness(suite, suite.entries, batch_size=8, limit=None).score(model, tok)
    for task, score in got["cpu"].items():
        assert got["cuda"][task].value == pytest.approx(score.value, rel=1e-3, abs=1e-3), task


@cuda
def test_a_run_on_the_gpu_merges_the_same_bits_scores_like_the_cpu_and_records_its_device_memory(tmp_path, cache):
    """The whole run path with eval.device=cuda: the merge streamed into the live model on the CPU, then it and
    each constituent moved to the GPU and evaluated one at a time, against the same run on the CPU."""
    results = {}
    for device in ("cpu", "cuda"):
        job = tmp_path / device
        out = run_module("mergeval", "+experiment=tiny", "method=ties", f"eval.device={device}",
                         f"hydra.run.dir={job}", f"store.path={job / 'results.sqlite'}", cwd=tmp_path,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        results[device] = json.loads((job / "result.json").read_text())
    cpu, gpu = results["cpu"], results["cuda"]
    assert [m["fingerprint"] for m in gpu["models"]] == [m["fingerprint"] for m in cpu["models"]]
    assert cpu["device_memory"] is None and "gpu" not in cpu["hardware"]  # a CPU run never initialises CUDA
    assert gpu["device_memory"]["allocated_mib"] > 0 and gpu["hardware"]["gpu"]
    assert gpu["config"]["eval"]["device"] == "cuda"
    for task, by_role in cpu["scores"].items():
        for role, score in by_role.items():  # float32 on both; one item may flip where two choices nearly tie
            assert abs(gpu["scores"][task][role]["value"] - score["value"]) <= 1 / score["n"] + 1e-9, (task, role)


@cuda
def test_vllm_backend_serves_generation(tiny_dir, cache):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from mergeval.eval.harness import Harness
    from mergeval.eval.suite import build_suite
    from mergeval.models.checkpoint import load_model
    from tests.test_registry_tasks import bench, eval_cfg

    suite = build_suite(bench(tasks=["gsm8k"]), eval_cfg(), cache)
    model = load_model(tiny_dir, None, torch.float32)
    score = Harness(suite, suite.entries, batch_size=8, limit=4, backend="vllm").score(
        model, AutoTokenizer.from_pretrained(tiny_dir))
    assert score["gsm8k"].n == 4 and 0.0 <= score["gsm8k"].value <= 1.0
