"""The precision models compute in by default: bfloat16 where the hardware multiplies it natively, else float32.

Why not always bfloat16: on an x86 CPU without AVX-512 (AVX2 only) oneDNN has
no bfloat16 kernels and PyTorch's bfloat16 matrix products fall back to slow
reference code, more than an order of magnitude slower than float32: fine-tuning
and evaluation, the quickstart included, would become impractically slow there.

``eval.dtype`` and ``modelset.train.dtype`` default to the interpolation
``${mergeval_dtype:<device>}``, which resolves here, when the config is read,
to ``bfloat16`` or ``float32``: so the resolved config (result.json, the
results store's keys, a sweep's resume hash) always holds the precision that
actually ran, and a machine with native bfloat16 resolves to what the default
was before. Set either field to ``bfloat16`` or ``float32`` to force it (a
forced bfloat16 on such a CPU is only slow, not wrong). Scores differ between
the two precisions, as they do between CPU families; the specs' claims are
the portable check (README, "Precision follows the hardware").
"""

from __future__ import annotations

import functools

RESOLVER = "mergeval_dtype"
BACKEND_RESOLVER = "mergeval_backend"
DEVICE_RESOLVER = "mergeval_device"


def auto_device(device: str = "auto") -> str:
    """``device`` as given, or for ``auto`` a CUDA GPU where torch sees one (or one is simulated:
    ``core/gpus.py``), else the CPU. A job of a parallel sweep then claims one of the node's GPUs
    (``run/devices.py``)."""
    if device != "auto":
        return device
    import torch

    from mergeval.core.gpus import simulated

    return "cuda" if torch.cuda.is_available() or simulated() else "cpu"


@functools.cache
def bf16_native(device: str = "cpu") -> bool:
    """Whether ``device`` runs bfloat16 matrix products in native kernels: a CUDA GPU that supports bfloat16, or
    a CPU where oneDNN has bfloat16 kernels (AVX-512 or newer x86, Arm with BF16)."""
    import torch

    kind = auto_device(device).split(":")[0]
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True  # another accelerator (mps, xpu...): its own bfloat16 support, as the user's config asks


def auto_dtype(device: str = "cpu") -> str:
    """``bfloat16`` where ``device`` multiplies it natively, else ``float32``."""
    return "bfloat16" if bf16_native(device) else "float32"


def auto_backend(dtype: str) -> str:
    """The default scorer for a precision: the shared-prefix scorer in float32, where it gives lm-eval's answers
    (each choice's log-likelihood within 1e-4 of HFLM's: tests/eval/test_scorer.py), and lm-eval's own HFLM in any
    other precision, where the two round differently and move a few percent of answers
    (tests/eval/test_scorer_bf16.py): the default numbers are always the ``lm_eval`` command line's."""
    return "shared_prefix" if dtype == "float32" else "hflm"


def register_resolver() -> None:
    """``${mergeval_dtype:<device>}``, ``${mergeval_backend:<dtype>}`` and ``${mergeval_device:auto}`` for the
    configs, and ``${mergeval_gpus:...}`` for the launcher presets (idempotent)."""
    from omegaconf import OmegaConf

    from mergeval.core import gpus

    gpus.register_resolver()
    if not OmegaConf.has_resolver(DEVICE_RESOLVER):
        OmegaConf.register_new_resolver(DEVICE_RESOLVER, lambda device="auto": auto_device(str(device)))
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda device="cpu": auto_dtype(str(device)))
    if not OmegaConf.has_resolver(BACKEND_RESOLVER):
        OmegaConf.register_new_resolver(BACKEND_RESOLVER, lambda dtype="float32": auto_backend(str(dtype)))
