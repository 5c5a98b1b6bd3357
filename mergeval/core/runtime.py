"""Process-wide settings of a run: step timings, quiet libraries, the hub's offline switch."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager


class Laps:
    """Wall time of each step of a run in seconds (result.json's ``timings_s``): ``lap(name)`` closes a step."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self._clock, 3)
        self._clock = now


def quiet_transformers(verbose: bool = False) -> None:
    """No per-model progress bars or warnings from transformers inside a run's output (``verbose=true`` keeps them)."""
    import transformers

    if verbose:
        transformers.utils.logging.enable_progress_bar()
        transformers.utils.logging.set_verbosity_warning()
        return
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


@contextmanager
def library_bars(show: bool):
    """Inside the block, progress bars that libraries draw with tqdm (lm-eval's request building, tokenizing,
    generation) are off unless ``show``: mergeval prints one progress line per model instead. lm-eval passes
    ``disable=False`` explicitly, which beats tqdm's TQDM_DISABLE, so the block makes every new bar disabled."""
    if show:
        yield
        return
    from tqdm import tqdm

    original = tqdm.__init__

    def disabled(self, *args, **kwargs):
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    tqdm.__init__ = disabled
    try:
        yield
    finally:
        tqdm.__init__ = original


def apply_offline(offline: bool) -> None:
    """``offline=true``: models and data sets come from local caches only, never the network. Set from the run's
    config (not at import), so ``offline=false`` takes effect; libraries imported earlier are told too."""
    value = "1" if offline else "0"
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[name] = value
    import sys

    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants as hub

        hub.HF_HUB_OFFLINE = offline
    if "datasets" in sys.modules:
        import datasets.config as ds

        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            if hasattr(ds, name):
                setattr(ds, name, offline)


def _cuda_device(device: str | None) -> tuple[str, ...]:
    """The arguments that name the CUDA device whose statistics to read for a run on ``device``: itself
    (``cuda:2``, a parallel sweep's job), else none (torch's current device)."""
    return (device,) if device is not None and device.startswith("cuda:") else ()


def reset_device_memory_peak(device: str | None = None) -> None:
    """Start counting the GPU memory peak afresh (at a run's start: a sweep's jobs can share one process), on
    ``device`` when it names a CUDA device, else on the current one."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(*_cuda_device(device))


def peak_device_memory(device: str | None = None) -> dict | None:
    """The peak GPU memory (MiB) since ``reset_device_memory_peak`` as torch's caching allocator counted it;
    None where CUDA was never initialised (every CPU run). ``allocated_mib``: bytes in live tensors at their
    peak (on the run path, one model plus the evaluation's activations, whatever the number of experts);
    ``reserved_mib``: the most the allocator held from the driver (nvidia-smi shows this plus the CUDA
    context's few hundred MiB)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    cuda = _cuda_device(device)
    return {
        "device": torch.cuda.get_device_name(*cuda),
        "allocated_mib": round(torch.cuda.max_memory_allocated(*cuda) / 2**20, 1),
        "reserved_mib": round(torch.cuda.max_memory_reserved(*cuda) / 2**20, 1),
    }


def release_memory() -> None:
    """Give the memory of a released model back to the operating system.

    Freed tensors go back to glibc's heap, not always to the OS: glibc raises its mmap threshold after large
    frees, so the next model's tensors come from the heap and the freed space stays mapped. Without this, each
    model evaluated in turn would raise the run's peak, which would then grow with the number of experts;
    ``malloc_trim`` hands the free pages back (a no-op where glibc is not the allocator); on a GPU, torch's
    caching allocator releases the model's device memory.
    """
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():  # the caching allocator keeps freed device memory too
        torch.cuda.empty_cache()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass
