"""Process-wide settings of a run: step timings, quiet libraries, the hub's offline switch."""

from __future__ import annotations

import os
import time


class Laps:
    """Wall time of each step of a run in seconds (result.json's ``timings_s``): ``lap(name)`` closes a step."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self._clock, 3)
        self._clock = now


def quiet_transformers() -> None:
    """No per-model progress bars or warnings from transformers inside a run's output."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


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
