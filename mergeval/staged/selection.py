"""Ranking and selection between stages (pure).

Stage 1 ranks by :func:`mergeval.metrics.perplexity.mean_log_ratio` against the
experts, each on its own task (lower first). A candidate whose :func:`~mergeval.metrics.perplexity.degradation`
exceeds the threshold is not promoted, whatever its rank; if every candidate
does, the sweep stops there. Stages 2 and 3 rank by mean accuracy over all
benchmark tasks (higher first): the merged model's term of Macro-Gain and
Macro-OG, whose other terms are the same for every candidate, so this ranks
exactly as those do, and it needs no constituent scores at stage 2's reduced
item count. Ties keep the sweep's declaration order (stable sort).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def mean_accuracy(scores: Mapping[str, Mapping[str, float]]) -> float:
    """``(1/T) Σ_t acc_t`` over the tasks of one model's ``{task: {value, ...}}`` (accuracies)."""
    return math.fsum(s["value"] for s in scores.values()) / len(scores)


def best_first(keys: Mapping[str, float], labels: Sequence[str], higher_is_better: bool) -> list[str]:
    """``labels`` sorted by their key, best first; equal keys keep the order of ``labels``."""
    return sorted(labels, key=lambda c: -keys[c] if higher_is_better else keys[c])


def promote(
    keys: Mapping[str, float],
    labels: Sequence[str],
    k: int,
    higher_is_better: bool,
    excluded: frozenset[str] = frozenset(),
) -> list[str]:
    """The best ``k`` of ``labels`` not in ``excluded``."""
    return [c for c in best_first(keys, labels, higher_is_better) if c not in excluded][:k]


def combine(first: Mapping[str, Any], rest: Mapping[str, Any]) -> dict[str, Any]:
    """Accuracy over two disjoint item sets from each one's ``{acc, n}``: ``(c_1 + c_2) / (n_1 + n_2)``.

    ``c_i = round(acc_i · n_i)`` is the number of items answered correctly
    (acc is a mean of 0/1 scores, so the product is an integer up to float
    rounding). The stderr is lm-eval's for a mean of 0/1 scores,
    ``sqrt(p (1 - p) / (n - 1))``.
    """
    n = int(first["n"]) + int(rest["n"])
    correct = round(first["value"] * first["n"]) + round(rest["value"] * rest["n"])
    p = correct / n
    return {
        "metric": first.get("metric", "acc,none"),
        "value": p,
        "stderr": math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan"),
        "n": n,
    }
