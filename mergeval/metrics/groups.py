"""Averaging scores over groups of tasks, and forgetting of general skills.

Pure functions on plain Python floats: no I/O.

- ``group_mean``: rescale each benchmark group (e.g. the CMM paper multiplies
  Mol-Instructions' 0-1 scores by 100 before averaging them with ChemBench's
  0-100 scores), then average the groups, weighted by task count, equally, or
  by given weights.
- ``forgetting``: MergeBench's notion of forgetting -- how much a merged model
  drops below the base model on the base model's general tasks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

_WEIGHTINGS = ("tasks", "equal", "given")


def group_mean(
    scores: Mapping[str, float],
    groups: Mapping[str, Sequence[str]],
    scale: Mapping[str, float] | None = None,
    weighting: str = "tasks",
    weights: Mapping[str, float] | None = None,
) -> float:
    """Weighted mean over groups of the rescaled task scores.

        s'_t  = scale[g] * scores[t]                 for each task t in group g
        m_g   = (1 / |g|) * sum_{t in g} s'_t
        mean  = sum_g w_g * m_g / sum_g w_g

    with w_g = |g| for ``weighting="tasks"`` (this equals the plain mean of all
    rescaled tasks, and is computed that way), w_g = 1 for ``"equal"``, and
    w_g = weights[g] for ``"given"``. A group missing from ``scale`` has
    scale 1. Tasks in ``scores`` that belong to no group are ignored.

    Raises ValueError when: no groups, an empty group, a task in two groups, a
    grouped task missing from ``scores``, a non-finite score, a ``scale`` or
    ``weights`` key that is not a group, an unknown weighting, ``weights``
    given without ``weighting="given"`` (or missing with it), a negative or
    missing weight, or weights summing to 0.
    """
    if weighting not in _WEIGHTINGS:
        raise ValueError(f"weighting must be one of {_WEIGHTINGS}, got {weighting!r}")
    if not groups:
        raise ValueError("groups is empty: need at least one group of tasks")
    scale = dict(scale or {})
    unknown = sorted(set(scale) - set(groups))
    if unknown:
        raise ValueError(f"scale names groups that do not exist: {unknown}")
    seen: dict[str, str] = {}
    sums: dict[str, float] = {}
    rescaled_all: list[float] = []
    for g, tasks in groups.items():
        if len(tasks) == 0:
            raise ValueError(f"group {g!r} has no tasks")
        rescaled = []
        for t in tasks:
            if t in seen:
                raise ValueError(f"task {t!r} is in both group {seen[t]!r} and group {g!r}")
            seen[t] = g
            if t not in scores:
                raise ValueError(f"task {t!r} of group {g!r} has no score")
            if not math.isfinite(scores[t]):
                raise ValueError(f"score of task {t!r} is not finite: {scores[t]}")
            rescaled.append(scale.get(g, 1.0) * scores[t])
        sums[g] = math.fsum(rescaled)
        rescaled_all.extend(rescaled)

    if weighting != "given":
        if weights is not None:
            raise ValueError(f'weights are only used with weighting="given", not {weighting!r}')
        if weighting == "tasks":
            return math.fsum(rescaled_all) / len(rescaled_all)
        w = {g: 1.0 for g in groups}
    else:
        if weights is None:
            raise ValueError('weighting="given" needs weights: one per group')
        extra = sorted(set(weights) - set(groups))
        missing = sorted(set(groups) - set(weights))
        if extra or missing:
            raise ValueError(f"weights must name every group exactly: missing {missing}, unknown {extra}")
        if any(not (math.isfinite(v) and v >= 0) for v in weights.values()):
            raise ValueError(f"weights must be finite and >= 0, got {dict(weights)}")
        w = dict(weights)
    total = math.fsum(w.values())
    if total <= 0:
        raise ValueError("weights sum to 0: at least one group needs a positive weight")
    return math.fsum(w[g] * sums[g] / len(groups[g]) for g in groups) / total


def forgetting(base_general: Mapping[str, float], merged_general: Mapping[str, float]) -> dict:
    """Drop of a merged model below the base model on general tasks.

        drop_t = base_general[t] - merged_general[t]    (positive = forgotten)
        mean   = (1 / T) * sum_t drop_t

    Returns ``{"per_task": {t: drop_t}, "mean": mean}``. Both mappings must
    name the same, non-empty set of tasks with finite scores; raises
    ValueError otherwise.
    """
    if set(base_general) != set(merged_general):
        raise ValueError(
            "base and merged must score the same tasks: only in base "
            f"{sorted(set(base_general) - set(merged_general))}, only in merged "
            f"{sorted(set(merged_general) - set(base_general))}"
        )
    if not base_general:
        raise ValueError("no general tasks: need at least one")
    per_task = {}
    for t, b in base_general.items():
        m = merged_general[t]
        if not (math.isfinite(b) and math.isfinite(m)):
            raise ValueError(f"scores of task {t!r} must be finite, got base {b}, merged {m}")
        per_task[t] = b - m
    return {"per_task": per_task, "mean": math.fsum(per_task.values()) / len(per_task)}
