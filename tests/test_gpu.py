"""GPU paths (eval.device=cuda, merge.device, eval.backend=vllm): skipped where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

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
