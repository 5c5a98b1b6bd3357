"""The optional metrics a ``conf/metric/`` group turns on, composed from the pure functions.

``metric.groups``: for every model role, ``group_mean`` of its task accuracies
over the named groups (each group's scores times its ``scale``; groups weighted
by task count, equally, or by ``metric.weights``), e.g. the CMM paper's overall
score = ChemBench (9 tasks, 0-100) and Mol-Instructions (2 tasks, 0-1 x 100)
weighted by task count.

``metric.forgetting_tasks``: MergeBench's forgetting, the merged model's drop
below the base on general tasks (``forgetting``; positive = forgotten).

``metric.similarity``: parameter-space similarity of task vectors
(``task_vector_stats``): every pair of experts, and each expert against the
merge (whose ``sar_a_in_b`` is the CMM rebuttal's SAR of that expert).

``metric.calibration``: expected calibration error per model and task from
the per-choice log-likelihoods kept with each evaluation
(``ece_from_loglikelihoods``: softmax over the choices, 10 bins).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import combinations

from mergeval.errors import UserError
from mergeval.metrics.groups import forgetting, group_mean


def check_metric_config(metric, tasks: list[str]) -> None:
    """One-line errors for groups / forgetting tasks that name no benchmark task, or a bad weighting."""
    for name, group in (metric.groups or {}).items():
        if not group.tasks:
            raise UserError(f"metric.groups.{name}.tasks", "empty group", "list some of benchmark.tasks")
        unknown = [t for t in group.tasks if t not in tasks]
        if unknown:
            raise UserError(f"metric.groups.{name}.tasks", f"{unknown} not in benchmark.tasks",
                            f"use tasks from {tasks}")
    if metric.weighting not in ("tasks", "equal", "given"):
        raise UserError("metric.weighting", f"unknown weighting '{metric.weighting}'", "use tasks, equal or given")
    if metric.weighting == "given" and set(metric.weights or {}) != set(metric.groups or {}):
        raise UserError("metric.weights", "weighting=given needs one weight per group",
                        f"set metric.weights for {sorted(metric.groups or {})}")
    unknown = [t for t in metric.forgetting_tasks if t not in tasks]
    if unknown:
        raise UserError("metric.forgetting_tasks", f"{unknown} not in benchmark.tasks", f"use tasks from {tasks}")


def group_scores(scores: Mapping[str, Mapping[str, Mapping[str, float]]], roles: list[str], metric) -> dict:
    """role -> group_mean of its accuracies over metric.groups (empty when no groups are configured)."""
    if not metric.groups:
        return {}
    groups = {name: list(g.tasks) for name, g in metric.groups.items()}
    scale = {name: g.scale for name, g in metric.groups.items()}
    weights = dict(metric.weights) if metric.weights else None
    out = {}
    for role in roles:
        accs = {t: scores[t][role]["acc"] for tasks in groups.values() for t in tasks}
        out[role] = group_mean(accs, groups, scale, metric.weighting, weights)
    return out


def forgetting_of_merge(scores: Mapping[str, Mapping[str, Mapping[str, float]]], metric, merged: str) -> dict | None:
    if not metric.forgetting_tasks:
        return None
    tasks = list(metric.forgetting_tasks)
    return forgetting({t: scores[t]["base"]["acc"] for t in tasks}, {t: scores[t][merged]["acc"] for t in tasks})


def similarity(base: Mapping, experts: Mapping[str, Mapping], merged: Mapping | None) -> dict:
    """Overall and per-layer task-vector statistics: expert pairs ("a~b") and expert vs merge ("a~merged")."""
    from mergeval.metrics.similarity import task_vector_stats

    pairs = [(a, b, experts[a], experts[b]) for a, b in combinations(experts, 2)]
    if merged is not None:
        pairs += [(a, "merged", experts[a], merged) for a in experts]
    out = {}
    for a, b, ta, tb in pairs:
        stats = task_vector_stats(base, ta, tb)
        out[f"{a}~{b}"] = {"overall": stats["overall"], "by_layer": stats["by_layer"]}
    return out


def calibration(samples_by_role: Mapping[str, Mapping[str, list[dict]] | None]) -> dict:
    """role -> task -> ECE (None for a model whose evaluation kept no samples, e.g. one stored by an older
    mergeval; eval.force=true re-evaluates it)."""
    from mergeval.metrics.calibration import ece_from_loglikelihoods

    out: dict = {}
    for role, per_task in samples_by_role.items():
        if per_task is None:
            out[role] = None
            continue
        out[role] = {task: ece_from_loglikelihoods([r["lls"] for r in rows], [r["gold"] for r in rows])
                     for task, rows in per_task.items()}
    return out
