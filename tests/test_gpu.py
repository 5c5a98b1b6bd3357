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
    from tests.eval.test_registry_tasks import bench, eval_cfg

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
        out = run_module(
            "mergeval",
            "+experiment=tiny",
            "method=ties",
            f"eval.device={device}",
            f"hydra.run.dir={job}",
            f"store.path={job / 'results.sqlite'}",
            cwd=tmp_path,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
            timeout=900,
        )
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
    from tests.eval.test_registry_tasks import bench, eval_cfg

    suite = build_suite(bench(tasks=["gsm8k"]), eval_cfg(), cache)
    model = load_model(tiny_dir, None, torch.float32)
    score = Harness(suite, suite.entries, batch_size=8, limit=4, backend="vllm").score(
        model, AutoTokenizer.from_pretrained(tiny_dir)
    )
    assert score["gsm8k"].n == 4 and 0.0 <= score["gsm8k"].value <= 1.0


# merge.device=cuda (mergeval/merge/execute.py's Device). The same bits as the CPU where every step is elementwise,
# a selection (TIES' cut, DELLA's stable ranks) or a random mask, which the GPU draws itself (methods/draws.py: a
# function of each entry's index, the same bits on any device); paper mode (compat=mergekit follows torch's
# unstable sort at tied magnitudes, whose order is the device's own)
SAME_BITS = {
    "linear": {},
    "task_arithmetic": {"lambda_": 0.7},
    "ties": {"density": 0.3},
    "dare_ties": {"density": 0.4},
    "dare_linear": {"density": 0.5},
    "della": {"density": 0.5},
    "della_linear": {"density": 0.5},
    "breadcrumbs": {"density": 0.6},
    "breadcrumbs_ties": {"density": 0.6},
}
ONE_EXPERT = {"slerp", "nearswap", "arcee_fusion"}


def _gpu_inputs(tiny_dir, tmp_path):
    from tests.merge.test_engine import make_expert

    return [make_expert(tiny_dir, tmp_path / f"e{i}", seed=i + 3, scale=0.02) for i in range(2)]


@cuda
def test_a_gpu_merge_has_the_cpus_bits_for_elementwise_and_random_methods_and_rounding_for_reductions(
    tiny_dir, tmp_path
):
    """The random methods (dare_*, della*) too: the GPU draws their masks itself, with the CPU's bits."""
    from mergeval.merge import merge_into_model, merge_to_disk
    from mergeval.merge.execute import Device
    from mergeval.methods import METHODS, get_method
    from mergeval.methods.registry import Needs
    from mergeval.models.checkpoint import load_model
    from tests.merge.test_engine import read_dir

    inputs = _gpu_inputs(tiny_dir, tmp_path)
    for name in sorted(n for n, m in METHODS.items() if m.needs == Needs() and n != "passthrough"):
        method = get_method(name)
        cfg = method.config(**SAME_BITS.get(name, {}))
        experts = inputs[:1] if name in ONE_EXPERT else inputs
        cpu = read_dir(merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / f"cpu-{name}", seed=3))
        device = Device("cuda")
        gpu = read_dir(merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / f"gpu-{name}", seed=3, device=device))
        live = merge_into_model(
            load_model(tiny_dir), method, cfg, tiny_dir, experts, seed=3, device="cuda"
        ).state_dict()
        assert device.peak > 0, name
        for n, t in cpu.items():
            for got in (gpu[n], live[n].to(t.dtype)):
                if name in SAME_BITS:
                    assert torch.equal(got, t) and torch.equal(got.signbit(), t.signbit()), (name, n)
                else:  # float32 reductions in the GPU's order
                    assert torch.allclose(got.float(), t.float(), rtol=1e-5, atol=1e-6), (name, n)


@cuda
def test_merge_only_on_the_gpu_holds_about_one_tensor_not_the_model():
    """Twenty-four 4M-entry tensors (16 MiB each in float32): the peak GPU memory of a streamed merge is a few
    times one tensor's inputs, far below the model's."""
    from mergeval.merge import merge_tensors
    from mergeval.methods import get_method

    g = torch.Generator().manual_seed(0)
    shape = (2048, 2048)
    base = {f"model.layers.{i}.mlp.w.weight": torch.randn(shape, generator=g) for i in range(24)}
    experts = [{n: t + 0.01 * torch.randn(shape, generator=g) for n, t in base.items()} for _ in range(2)]
    tensor = 4 * shape[0] * shape[1]
    inputs = 3 * tensor  # one tensor of the base and of each expert
    for name, params in (
        ("task_arithmetic", {}),
        ("ties", {"density": 0.3}),
        ("dare_ties", {"density": 0.4}),
        ("della", {"density": 0.5}),
        ("karcher", {}),
    ):
        method = get_method(name)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        merge_tensors(method, method.config(**params), base, experts, seed=0, progress=False, device="cuda")
        peak = torch.cuda.max_memory_allocated()
        assert peak <= 3 * inputs < 24 * inputs, (name, peak / tensor)
