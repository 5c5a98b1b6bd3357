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

``metric.consistency``: for each ``[task_a, task_b]`` pair asking the same
items in two formats (a generated task ``X`` as cloze and as lettered
multiple choice ``X_mc``), per model: how often its answers agree
(``calibration.consistency`` over the argmax choices, matched by doc_id), its
accuracy in each format and the share of items it gets right in both
(``calibration.format_agreement``), from the same kept log-likelihoods.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import combinations

from mergeval.metrics.groups import forgetting, group_mean


def group_scores(scores: Mapping[str, Mapping[str, Mapping[str, float]]], roles: list[str], metric) -> dict:
    """role -> group_mean of its accuracies over metric.groups (empty when no groups are configured)."""
    if not metric.groups:
        return {}
    groups = {name: list(g.tasks) for name, g in metric.groups.items()}
    scale = {name: g.scale for name, g in metric.groups.items()}
    weights = dict(metric.weights) if metric.weights else None
    out = {}
    for role in roles:
        accs = {t: scores[t][role]["value"] for tasks in groups.values() for t in tasks}
        out[role] = group_mean(accs, groups, scale, metric.weighting, weights)
    return out


def forgetting_of_merge(scores: Mapping[str, Mapping[str, Mapping[str, float]]], metric, merged: str) -> dict | None:
    if not metric.forgetting_tasks:
        return None
    tasks = list(metric.forgetting_tasks)
    return forgetting({t: scores[t]["base"]["value"] for t in tasks}, {t: scores[t][merged]["value"] for t in tasks})


def similarity(base: Mapping, experts: Mapping[str, Mapping], merged: Mapping | None) -> dict:
    """Overall and per-layer task-vector statistics: expert pairs ("a~b") and expert vs merge ("a~merged")."""
    from mergeval.metrics.similarity import pairwise_stats

    models = {**experts, **({} if merged is None else {"merged": merged})}
    pairs = list(combinations(experts, 2)) + ([(a, "merged") for a in experts] if merged is not None else [])
    stats = pairwise_stats(base, models, pairs)
    return {key: {"overall": s["overall"], "by_layer": s["by_layer"]} for key, s in stats.items()}


def calibration(samples_by_role: Mapping[str, Mapping[str, list[dict]] | None]) -> dict:
    """role -> task -> ECE (None for a model whose evaluation kept no samples, e.g. one stored by an older
    mergeval; eval.force=true re-evaluates it)."""
    from mergeval.metrics.calibration import ece_from_loglikelihoods

    out: dict = {}
    for role, per_task in samples_by_role.items():
        if per_task is None:
            out[role] = None
            continue
        out[role] = {
            task: ece_from_loglikelihoods([r["lls"] for r in rows], [r["gold"] for r in rows])
            for task, rows in per_task.items()
        }
    return out


def consistency(samples_by_role: Mapping[str, Mapping[str, list[dict]] | None], pairs: list[list[str]]) -> dict:
    """role -> "task_a~task_b" -> {agreement, n, acc: {task_a, task_b}, both_correct} (``format_agreement``);
    None for a model whose evaluation kept no samples (eval.force=true re-evaluates it)."""
    from mergeval.metrics.calibration import format_agreement

    out: dict = {}
    for role, per_task in samples_by_role.items():
        if per_task is None:
            out[role] = None
            continue
        out[role] = {}
        for task_a, task_b in pairs:
            stats = format_agreement(per_task[task_a], per_task[task_b])
            out[role][f"{task_a}~{task_b}"] = {
                "agreement": stats["agreement"],
                "n": stats["n"],
                "acc": {task_a: stats["acc_a"], task_b: stats["acc_b"]},
                "both_correct": stats["both_correct"],
            }
    return out
