"""What a run produced, as plain data: read by the orchestrators, reports and specs (never by lower layers).

A score is ``{"metric": "acc_norm,none", "value": 0.61, "stderr": 0.02, "n": 200}``:
the value of the metric lm-eval reports under that ``metric,filter`` name.
result.json files written before mergeval reported other metrics hold
``{"acc", "stderr", "n"}``; ``score_value`` reads both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

MERGED = "merged"
OLD_METRIC = "acc,none"  # the only metric of result.json files from before per-task metrics


@dataclass
class ModelInfo:
    role: str  # "base", an expert's name, or "merged"
    source: str
    # models.fingerprint.model_identity: the weights and every file that can change the model's outputs as this
    # run evaluates it (its config, the tokenizer it is evaluated with). The results store keys scores by it.
    fingerprint: str
    path: str | None = None
    task: str | None = None  # the expert's own task
    evaluated: str | None = None  # "this run", "reused from the results store" or "partly reused ..." (some tasks)
    merge: str | None = None  # merged model only: "this run" or "reused from the results store" (not redone)
    weights: str | None = None  # models.fingerprint.fingerprint: the tensors alone (None for a merge not redone)

    def directory(self) -> Path:
        """The model's directory: every constituent has one, a merge once it is on disk."""
        assert self.path is not None, f"{self.role} has no directory"
        return Path(self.path)


@dataclass
class Outcome:
    models: list[ModelInfo]
    tasks: list[str]  # every row shown: the benchmark's entries and their groups' members
    scores: dict[str, dict[str, dict]]  # task -> model role -> {metric, value, stderr, n}
    aggregates: dict
    task_digests: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)
    merge_info: dict = field(default_factory=dict)  # what the method decided (e.g. CMM's order)
    run_id: str = ""  # the run's row in the results store (set by run())
    versions: dict = field(default_factory=dict)
    git: dict = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)  # provenance.hardware(): what kernels, hence rounding, ran
    device_memory: dict | None = None  # runtime.peak_device_memory(): the run's peak GPU memory, None on the CPU
    # task -> {metric, higher_is_better, output_type, entry, counted}: what each row reports and whether the
    # aggregates count it
    rows: dict[str, dict] = field(default_factory=dict)
    # task -> {num_fewshot, generates}: its part of the store key's settings (eval/settings.py, PerTask)
    task_settings: dict[str, Mapping] = field(default_factory=dict)
    # task -> model role -> {"ids", "values"}: each item's outcome in the reported metric, where the metric is
    # a mean over items (paired comparisons: metrics/paired.py)
    items: dict[str, dict[str, dict]] = field(default_factory=dict)


def score_value(score: dict) -> float:
    """The reported value of a score, from this mergeval's result.json or an older one (``acc``)."""
    return score["value"] if "value" in score else score["acc"]


def score_metric(score: dict) -> str:
    return score.get("metric", OLD_METRIC)


def fixed(value: float, digits: int = 2) -> str:
    """``value`` with ``digits`` decimals, never ``-0.00``."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def score_text(score: dict) -> str:
    """``0.612 ± 0.021``; values of 100 and more (perplexities) with 1 decimal; no stderr, no ``±``."""
    value, stderr = score_value(score), score.get("stderr")
    digits = 3 if abs(value) < 100 else 1
    text = f"{value:.{digits}f}"
    return text if stderr is None or stderr != stderr else f"{text} ± {stderr:.{digits}f}"


def result_text(result: dict) -> str:
    """result.json's text: indented JSON, the per-item outcomes (last key) one compact line per task."""
    rest = {k: v for k, v in result.items() if k != "items"}
    text = json.dumps(rest, indent=2)
    if not result.get("items"):
        return text[:-2] + ',\n  "items": {}\n}'
    lines = ",\n".join(
        f"    {json.dumps(task)}: {json.dumps(per, separators=(',', ':'))}" for task, per in result["items"].items()
    )
    return text[:-2] + ',\n  "items": {\n' + lines + "\n  }\n}"
