"""A run's aggregates from its score table: the metrics wired to the run's models and tasks.

Only rows whose metric is higher-is-better and whose values lie in [0, 1] for
every model enter Macro-Gain, Macro-OG and normalized scores (their formulas
assume both); a lower-is-better metric such as perplexity is shown in the
table and listed under ``excluded`` with the reason.
"""

from __future__ import annotations

from mergeval.core.outcome import MERGED, ModelInfo
from mergeval.metrics.aggregates import band, macro_gain, macro_og, mean_normalized_score, normalized_score
from mergeval.metrics.composed import forgetting_of_merge, group_scores

OUT_OF_RANGE = "values outside [0, 1]: shown, kept out of the aggregates"
LOWER_IS_BETTER = "lower is better: shown, kept out of the aggregates"


def aggregable(scores: dict, rows: dict[str, dict], tasks: list[str]) -> tuple[list[str], dict[str, str]]:
    """(tasks the aggregates count, task -> why each other one is left out). ``rows``: task -> {higher_is_better,
    counted}; a task missing from ``rows`` counts (generated tasks of older callers)."""
    counted, excluded = [], {}
    for task in tasks:
        row = rows.get(task, {"higher_is_better": True, "counted": True})
        if not row.get("counted", True) and row.get("higher_is_better", True):
            continue  # a group's member: shown, counted through its group
        if not row.get("higher_is_better", True):
            excluded[task] = LOWER_IS_BETTER
        elif any(not 0.0 <= s["value"] <= 1.0 for s in scores[task].values()):
            excluded[task] = OUT_OF_RANGE
        else:
            counted.append(task)
    return counted, excluded


def constituent_roles(choice, roles: list[str]) -> list[str]:
    """The roles Macro-Gain / Macro-OG compare the merge against (``metric.constituents``): ``experts`` (every
    role but base and merged), ``base_and_experts``, or an explicit list of roles."""
    experts = [r for r in roles if r not in ("base", MERGED)]
    if choice == "experts":
        return experts
    if choice == "base_and_experts":
        return ["base", *experts]
    return list(choice)


def aggregate(scores: dict[str, dict[str, dict]], tasks: list[str], models: list[ModelInfo], metric) -> dict:
    """Macro-Gain / Macro-OG over ``tasks`` against the constituents ``metric.constituents`` names (default: the
    experts), normalized scores per expert task, and what the metric group adds (group means per role,
    forgetting; see metrics/composed.py)."""
    if isinstance(metric, str):  # a bare scale: no groups, no forgetting
        from mergeval.run.config import MetricConfig

        metric = MetricConfig(scale=metric)
    scale = metric.scale
    experts = [m for m in models if m.role not in ("base", MERGED)]
    roles = constituent_roles(getattr(metric, "constituents", "experts"), [m.role for m in models])
    merged = [scores[t][MERGED]["value"] for t in tasks]
    constituents = [[scores[t][role]["value"] for t in tasks] for role in roles]
    normalized, unlearned = {}, []
    own: dict[str, str] = {}  # task -> the expert it is normalized by: of two naming it, the better on it
    for e in experts:
        if (
            e.task is not None
            and e.task in tasks
            and (e.task not in own or scores[e.task][e.role]["value"] > scores[e.task][own[e.task]]["value"])
        ):
            own[e.task] = e.role
    for task, role in own.items():
        s = scores[task]
        normalized[task] = normalized_score(s[MERGED]["value"], s["base"]["value"], s[role]["value"])
        if s[role]["value"] <= s["base"]["value"]:  # no gain to keep: the ratio says nothing about the merge
            unlearned.append(task)
    # the mean and its band count only the tasks whose expert beats the base (an expert that lost to the base
    # gave a "good" band from ratios the table calls meaningless); undefined when none does
    mean = mean_normalized_score(v for t, v in normalized.items() if t not in unlearned)
    return {
        "scale": scale,
        "constituents": roles,
        "macro_gain": macro_gain(merged, constituents, scale=scale),
        "macro_og": macro_og(merged, constituents, scale=scale),
        "normalized": normalized,
        "normalized_mean": mean,
        "normalized_not_counted": unlearned,
        "normalized_band": band(mean),
        "groups": group_scores(scores, [m.role for m in models], metric),
        "forgetting": forgetting_of_merge(scores, metric, MERGED),
    }
