"""What a result.json records so a run can be reproduced: versions and the code's commit."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = [
    "mergeval",
    "torch",
    "transformers",
    "lm_eval",
    "hydra-core",
    "omegaconf",
    "safetensors",
    "datasets",
    "numpy",
    "tokenizers",
    "gguf",
]


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit() -> dict[str, str | bool | None]:
    """The commit of the mergeval checkout this code runs from (None when installed from a wheel)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    return {"commit": commit, "dirty": dirty}


# CPU flags that select different matmul/softmax kernels (oneDNN, MKL, torch's own), hence different rounding:
# the same run gives bit-identical scores only on machines that agree on these and on the thread counts.
KERNEL_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "asimd",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)


def hardware() -> dict:
    """The machine as far as it can change a score: CPU model and the kernel-selecting ISA flags, core and
    thread counts, torch's kernel settings, the GPU where this process used one, ``CUDA_VISIBLE_DEVICES`` where
    set, and ``simulated_gpus`` under ``MERGEVAL_SIMULATED_GPUS`` (core/gpus.py)."""
    import os

    import torch

    from mergeval.core.gpus import simulated
    from mergeval.core.precision import bf16_native

    model, flags = _cpu_info()
    info = {
        "machine": platform.machine(),
        "cpu": model,
        "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "bf16_native": bf16_native("cpu"),  # what eval.dtype / modelset.train.dtype default to (precision.py)
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }
    # Only where this process used the GPU: asking a device's name initialises CUDA, which costs a CPU run on a
    # GPU machine its context (seconds, and device memory other jobs may need) for a fact that cannot change its
    # scores.
    if os.environ.get("CUDA_VISIBLE_DEVICES"):  # which of the machine's GPUs this process saw (Ray, Slurm set it)
        info["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    if simulated() is not None:  # a testing aid: eval.device names a GPU only simulated, the run used the CPU
        info["simulated_gpus"] = simulated()
    if torch.cuda.is_initialized():
        info["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def _cpu_info() -> tuple[str | None, set[str]]:
    """(model name, flags) from /proc/cpuinfo on Linux; (platform.processor(), empty) elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None, set()
    model: str | None = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and model is None:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model or platform.processor() or None, flags
