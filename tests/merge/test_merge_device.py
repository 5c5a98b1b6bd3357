"""merge.device: the executor's device path (execute.Device) tested on the CPU.

A GPU merges each unit (or row block) with the methods' torch definitions on tensors moved there, one unit at a
time; random methods draw there too (methods/draws.py: counter-based, the same bits on any device). Here ``Device("cpu", torch_only=True)`` takes the CPU through that
same path (the moves, the lock, the compiled kernels off on the merging threads), and torch's ``meta`` device
checks that no CPU tensor is mixed into a device computation; tests/test_gpu.py holds the CUDA checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mergeval.core.errors import UserError
from mergeval.merge import execute, merge_into_model, merge_tensors, merge_to_disk
from mergeval.merge.execute import Device, placement
from mergeval.methods import METHODS, fused, get_method
from mergeval.methods.registry import Needs
from mergeval.models.checkpoint import load_model, load_tensors
from tests.merge.test_engine import make_expert

ONE_EXPERT = {"slerp", "nearswap", "arcee_fusion"}  # methods that take exactly one expert
# every method that needs nothing prepared from the models (calibration data, head counts, rankings, stages)
PLAIN = sorted(n for n, m in METHODS.items() if m.needs == Needs() and n != "passthrough")
CONFIGS = {  # beyond the defaults: the random and trimming methods at densities that drop entries
    "ties": {"density": 0.3},
    "dare_ties": {"density": 0.4},
    "dare_linear": {"density": 0.5},
    "breadcrumbs": {"density": 0.6},
    "della": {"density": 0.5},
    "della_linear": {"density": 0.5},
}


@pytest.fixture(scope="module")
def inputs(tiny_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("device")
    return [make_expert(tiny_dir, root / f"e{i}", seed=i + 3, scale=0.02) for i in range(2)]


@pytest.fixture
def small_blocks(monkeypatch):
    """Every tensor of 2+ rows in row blocks of about 300 entries, and the compiled kernels for the CPU path
    wherever numba runs: the default path the device path is held to takes them."""
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    monkeypatch.setattr(fused, "MIN_ENTRIES", 2)


def experts_for(name: str, inputs: list[Path]) -> list[Path]:
    return inputs[:1] if name in ONE_EXPERT else inputs


@pytest.mark.parametrize("name", PLAIN)
def test_the_device_path_merges_the_cpu_paths_bytes_for_every_method(name, tiny_dir, inputs, tmp_path, small_blocks):
    """Streamed to disk (python -m mergeval.merge) and into a live model (a run), with merge.device's path."""
    method = get_method(name)
    cfg = method.config(**CONFIGS.get(name, {}))
    experts = experts_for(name, inputs)
    cpu = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "cpu", seed=3)
    device = Device("cpu", torch_only=True)
    moved = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "device", seed=3, device=device)
    assert (moved / "model.safetensors").read_bytes() == (cpu / "model.safetensors").read_bytes()
    assert device.peak > 0 and device.resident == 0  # every unit went through the device, and left it
    live = merge_into_model(
        load_model(tiny_dir), method, cfg, tiny_dir, experts, seed=3, device=Device("cpu", torch_only=True)
    ).state_dict()
    reference = merge_into_model(load_model(tiny_dir), method, cfg, tiny_dir, experts, seed=3).state_dict()
    for n, t in reference.items():
        assert torch.equal(live[n], t) and torch.equal(live[n].signbit(), t.signbit()), n


def test_the_torch_only_hook_really_leaves_the_kernels_out(tiny_dir, inputs, tmp_path, small_blocks, monkeypatch):
    """The device path's merging threads never call a compiled kernel (a GPU's tensors could not take one)."""
    if not fused.available():
        pytest.skip("numba does not run here: every path is the torch code")
    called = []
    for kernel in ("merge_rows", "keep", "uniform", "placed_by_rank"):
        original = getattr(fused, kernel)
        monkeypatch.setattr(fused, kernel, lambda *a, _k=kernel, _f=original, **kw: called.append(_k) or _f(*a, **kw))
    for name in ("ties", "dare_ties", "della"):
        method = get_method(name)
        cfg = method.config(**CONFIGS[name])
        merge_to_disk(
            method, cfg, tiny_dir, inputs, tmp_path / f"d-{name}", seed=1, device=Device("cpu", torch_only=True)
        )
    assert called == []
    merge_to_disk(
        get_method("dare_ties"),
        get_method("dare_ties").config(**CONFIGS["dare_ties"]),
        tiny_dir,
        inputs,
        tmp_path / "c",
        seed=1,
    )
    assert called  # while the CPU path takes them


def unit_bytes(tensors: list[dict[str, torch.Tensor]]) -> int:
    """The largest tensor's bytes summed over the inputs (base and experts): one whole-tensor unit."""
    return max(sum(t[n].numel() * t[n].element_size() for t in tensors) for n in tensors[0])


def test_one_unit_at_a_time_is_on_the_device(tiny_dir, inputs):
    tensors = [load_tensors(tiny_dir), *(load_tensors(p) for p in inputs)]
    model = sum(t.numel() * t.element_size() for ts in tensors for t in ts.values())
    for name in ("task_arithmetic", "della", "karcher"):
        method = get_method(name)
        device = Device("cpu", torch_only=True)
        merge_tensors(
            method,
            method.config(**CONFIGS.get(name, {})),
            tensors[0],
            tensors[1:],
            seed=0,
            progress=False,
            blocks=False,
            device=device,
        )
        # the largest unit's inputs, never two units' at once (the workers wait for the device), nor the model
        assert device.peak == unit_bytes(tensors) < model, name


def test_row_blocks_go_to_the_device_a_block_at_a_time(tiny_dir, inputs, tmp_path, small_blocks):
    tensors = [load_tensors(tiny_dir), *(load_tensors(p) for p in inputs)]
    per_row = max(t[0].numel() for t in tensors[0].values() if t.dim() > 1)
    block = len(tensors) * 4 * max(300, per_row)  # float32 rows of about 300 entries (at least one row), each input
    for name in ("ties", "dare_linear", "task_arithmetic"):
        method = get_method(name)
        device = Device("cpu", torch_only=True)
        merge_to_disk(
            method, method.config(**CONFIGS.get(name, {})), tiny_dir, inputs, tmp_path / name, seed=0, device=device
        )
        assert 0 < device.peak <= block < unit_bytes(tensors), name  # a block of a tensor, not all of it


class MetaDevice(Device):
    """torch's meta device: shapes without values. Every operation on a moved unit must stay on it (a CPU
    tensor mixed in raises, as it would on a GPU); the results come back as zeros of their shape."""

    def __init__(self):
        super().__init__("meta")
        self.seen: set[str] = set()

    def to_device(self, t):
        self.seen.add(t.device.type)
        return t.to("meta")

    def to_cpu(self, t):
        assert t.device.type == "meta"
        return torch.zeros(t.shape, dtype=t.dtype)


@pytest.mark.parametrize(
    "name,params",
    [
        ("linear", {}),
        ("task_arithmetic", {}),
        ("dare_linear", CONFIGS["dare_linear"]),
        ("dare_ties", CONFIGS["dare_ties"]),
        ("della", CONFIGS["della"]),
        ("della_linear", CONFIGS["della_linear"]),
        ("dare_ties", {"density": 0.4, "compat": "mergekit", "rescale": "none"}),
        ("della", {"density": 0.5, "compat": "mergekit", "rescale": "none"}),  # l1 reads values: not on meta
    ],
)
@pytest.mark.parametrize("blocks", [False, True])
def test_elementwise_and_random_methods_compute_wholly_on_the_device(
    name, params, blocks, tiny_dir, inputs, small_blocks
):
    """The random methods draw on the device (no mask drawn on the CPU and moved: a CPU tensor mixed into the
    meta device's computation raises)."""
    method = get_method(name)
    cfg = method.config(**params)
    base, experts = load_tensors(tiny_dir), [load_tensors(p) for p in inputs]
    device = MetaDevice()
    out = merge_tensors(method, cfg, base, experts, seed=0, progress=False, blocks=blocks, device=device)
    reference = merge_tensors(method, cfg, base, experts, seed=0, progress=False, blocks=blocks)
    assert device.seen == {"cpu"} and device.peak > 0
    for n, t in reference.items():
        assert out[n].shape == t.shape and out[n].dtype == t.dtype, n


# ---------------------------------------------------------------- the config field


def composed(*overrides: str):
    from tests.core.test_precision import composed as compose

    return compose(*overrides)


def test_merge_device_defaults_to_the_evaluations_device():
    assert composed("eval.device=cpu").merge.device == "cpu"
    assert composed("eval.device=cuda:1").merge.device == "cuda:1"
    assert composed("eval.device=cuda", "merge.device=cpu").merge.device == "cpu"


def test_a_device_torch_does_not_have_is_a_one_line_error_naming_the_field_and_the_fix(monkeypatch):
    from mergeval.run.checks import check_merge_device

    monkeypatch.delenv("MERGEVAL_SIMULATED_GPUS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as err:
        check_merge_device(composed("eval.device=cpu", "merge.device=cuda"))
    assert err.value.field == "merge.device" and "no cuda device" in err.value.problem
    assert "merge.device=cpu" in err.value.fix and "\n" not in str(err.value)
    with pytest.raises(UserError) as err:  # the default follows eval.device: the line names what the user set
        check_merge_device(composed("eval.device=cuda"))
    assert err.value.field == "eval.device" and "eval.device=cpu" in err.value.fix
    with pytest.raises(UserError) as err:
        check_merge_device(composed("eval.device=cpu", "merge.device=gpu0"))
    assert err.value.field == "merge.device" and "not a device torch knows" in err.value.problem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_merge_device(composed("eval.device=cpu", "merge.device=cuda:1"))
    with pytest.raises(UserError, match="sees 2 cuda device"):
        check_merge_device(composed("eval.device=cpu", "merge.device=cuda:2"))
    check_merge_device(composed("eval.device=cpu"))  # the CPU is always there


def test_a_simulated_gpu_merges_on_the_cpu(monkeypatch):
    from mergeval.run.checks import check_merge_device

    monkeypatch.setenv("MERGEVAL_SIMULATED_GPUS", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_merge_device(composed("eval.device=cuda:1"))
    assert placement("cuda:1") is None and placement("cpu") is None and placement(None) is None


def test_the_configuration_hash_keeps_the_kind_of_merge_device_and_cpu_merges_their_old_hash():
    from mergeval.run.resume import hashed_config

    assert "merge" not in hashed_config(composed("eval.device=cpu"))  # what every run before merge.device did
    assert hashed_config(composed("eval.device=cpu", "merge.device=cuda:1"))["merge"] == {"device": "cuda"}
    assert hashed_config(composed("eval.device=cuda:3"))["merge"] == {"device": "cuda"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_merge_only_on_a_device_torch_lacks_stops_with_one_line_before_any_work(tmp_path):
    import os

    from tests.child import run_module

    env = {k: v for k, v in os.environ.items() if k != "MERGEVAL_SIMULATED_GPUS"}
    out = run_module(
        "mergeval.merge",
        "+experiment=tiny",
        "merge.device=cuda",
        f"hydra.run.dir={tmp_path / 'job'}",
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert "merge.device" in lines[0] and "set merge.device=cpu" in lines[0]
