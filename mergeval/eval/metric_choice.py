"""Which of a task's lm-eval metrics a run reports: pure functions over metric keys.

lm-eval reports every metric under every filter as a key ``"<metric>,<filter>"``
(``"acc,none"``, ``"acc_norm,none"``, ``"exact_match,flexible-extract"``,
``"word_perplexity,none"``) and does not mark one as primary. mergeval reports
one per task: ``benchmark.metrics[task]`` when given, else ``default_metric``:

1. the metric: ``acc_norm`` if the task reports it (HellaSwag, ARC, MedQA: the
   length-normalized accuracy that papers and leaderboards quote), else the
   first metric of the task's ``metric_list``;
2. the filter: ``flexible-extract`` if the task has it (GSM8K: the number
   extracted from anywhere in the answer, as the papers we encode report it),
   else the task's first filter (``none`` for tasks without filters).

The rule is a convention, not lm-eval's: set ``benchmark.metrics`` where a
paper reports something else (e.g. ``{gsm8k: "exact_match,strict-match"}``).
"""

from __future__ import annotations

PREFERRED_METRIC = "acc_norm"
PREFERRED_FILTER = "flexible-extract"


def metric_keys(metrics: list[str], filters: list[str]) -> list[str]:
    """Every ``metric,filter`` key a task with these metrics and filters reports, filter-major like lm-eval."""
    return [f"{m},{f}" for f in filters for m in metrics]


def default_metric(keys: list[str]) -> str:
    """The key reported when none is configured (module docstring); ``keys`` in the task's own order."""
    if not keys:
        raise ValueError("a task that reports no metric")
    metrics = [k.split(",", 1)[0] for k in keys]
    metric = PREFERRED_METRIC if PREFERRED_METRIC in metrics else metrics[0]
    filters = [k.split(",", 1)[1] for k in keys if k.split(",", 1)[0] == metric]
    return f"{metric},{PREFERRED_FILTER if PREFERRED_FILTER in filters else filters[0]}"


def normalize_key(given: str, keys: list[str]) -> str | None:
    """``given`` as a full key: ``"acc_norm"`` means its only filter (or ``none``); None if the task lacks it."""
    if given in keys:
        return given
    if "," not in given:
        with_filter = [k for k in keys if k.split(",", 1)[0] == given]
        if len(with_filter) == 1:
            return with_filter[0]
        if f"{given},none" in with_filter:
            return f"{given},none"
    return None
