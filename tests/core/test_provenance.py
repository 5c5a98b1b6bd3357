"""What result.json records about the machine: the hardware block and the run's peak GPU memory."""

from __future__ import annotations

import pytest
import torch

from mergeval.core.provenance import hardware
from mergeval.core.runtime import peak_device_memory, reset_device_memory_peak


def _never(*args, **kwargs):
    raise AssertionError("asked the device, which initialises CUDA")


def test_a_run_that_never_used_the_gpu_does_not_initialise_cuda_to_name_it(monkeypatch):
    """Naming a device initialises CUDA: a CPU run on a GPU machine would pay for a context and hold device
    memory for a fact that cannot change its scores."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # this process never used it
    for name in (
        "get_device_name",
        "device_count",
        "max_memory_allocated",
        "max_memory_reserved",
        "reset_peak_memory_stats",
    ):
        monkeypatch.setattr(torch.cuda, name, _never)
    reset_device_memory_peak()
    assert "gpu" not in hardware() and peak_device_memory() is None


def test_a_run_that_used_the_gpu_records_it_and_its_peak_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 2**31)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    reset_device_memory_peak()  # each run counts its own peak: a sweep's jobs can share one process
    assert resets == [1] and hardware()["gpu"] == ["NVIDIA H200"]
    assert peak_device_memory() == {
        "device": "NVIDIA H200",
        "allocated_mib": pytest.approx(1536.0),
        "reserved_mib": pytest.approx(2048.0),
    }
