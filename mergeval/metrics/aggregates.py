"""Aggregate scores for judging a merged model against the models it was merged from.

Pure functions on plain Python floats: no I/O, no torch. Every score list is
per task, aligned across models (same length, same task order).

- ``macro_gain`` / ``macro_og``: the task-averaged gain of a merged model over
  the mean / the best of its constituents (Ueda et al. 2025, arXiv:2511.02451).
- ``normalized_score`` / ``mean_normalized_score`` / ``band``: where a merged
  model lands between the base model (0) and a task's expert (1).
- ``accuracy_stderr``: the standard error lm-eval reports for an accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

_SCALES = {"fraction": 1.0, "percent": 100.0}

# The aggregates of a result.json that hold numbers (summary.aggregate's, then the opt-in metrics app.py adds):
# the first ones are numbers, the others tables of them (``forgetting.mean``, ``groups.<group>.merged``).
NUMBERS = ("macro_gain", "macro_og", "normalized_mean")
TABLES = ("normalized", "groups", "forgetting", "calibration", "consistency", "similarity")


def _mean(xs: Sequence[float]) -> float:
    # fsum is correctly rounded, so the mean does not depend on the order of xs.
    return math.fsum(xs) / len(xs)


def _task_averages(
    merged: Sequence[float], constituents: Sequence[Sequence[float]], scale: str
) -> tuple[float, list[float], float]:
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {sorted(_SCALES)}, got {scale!r}")
    if len(merged) == 0:
        raise ValueError("merged scores are empty: need at least one task")
    if len(constituents) == 0:
        raise ValueError("no constituents: need at least one constituent's scores")
    for i, c in enumerate(constituents):
        if len(c) != len(merged):
            raise ValueError(
                f"constituent {i} has {len(c)} task scores but merged has "
                f"{len(merged)}: scores must be aligned per task"
            )
    return _mean(merged), [_mean(c) for c in constituents], _SCALES[scale]


def macro_gain(
    merged: Sequence[float],
    constituents: Sequence[Sequence[float]],
    *,
    scale: str = "fraction",
) -> float:
    """Gain of the merged model over the arithmetic mean of its constituents.

        avg_m    = mean_t merged[t]
        avg_i    = mean_t constituents[i][t]          for i = 1..N
        macro_gain = avg_m - (1/N) * sum_i avg_i

    The paper defines it for N = 2 (``avg_m - mean(avg_c1, avg_c2)``); this is
    the same formula with the mean taken over all N >= 1 constituents.
    ``scale="percent"`` multiplies the result by 100; ``"fraction"`` (default)
    returns it in the units of the scores. Raises ValueError on empty or
    misaligned input or an unknown scale.
    """
    avg_m, avgs, factor = _task_averages(merged, constituents, scale)
    return factor * (avg_m - _mean(avgs))


def macro_og(
    merged: Sequence[float],
    constituents: Sequence[Sequence[float]],
    *,
    scale: str = "fraction",
) -> float:
    """Gain of the merged model over its best constituent ("overall gain").

        avg_m    = mean_t merged[t]
        avg_i    = mean_t constituents[i][t]          for i = 1..N
        macro_og = avg_m - max_i avg_i

    The paper defines it for N = 2 (``avg_m - max(avg_c1, avg_c2)``); this is
    the same formula with the max taken over all N >= 1 constituents. Since
    max >= mean, macro_og <= macro_gain; they are equal when N == 1.
    ``scale`` and errors as for ``macro_gain``.
    """
    avg_m, avgs, factor = _task_averages(merged, constituents, scale)
    return factor * (avg_m - max(avgs))


def normalized_score(merged: float, base: float, expert: float, eps: float = 1e-12) -> float | None:
    """Where the merged score lies between base (0) and expert (1).

        normalized = (merged - base) / (expert - base)

    Returns None (undefined) when |expert - base| <= eps; never divides by zero.
    """
    denom = expert - base
    if abs(denom) <= eps:
        return None
    return (merged - base) / denom


def mean_normalized_score(values: Iterable[float | None]) -> float | None:
    """Mean of the defined normalized scores: mean { v : v is not None }.

    Returns None when no value is defined.
    """
    defined = [v for v in values if v is not None]
    return _mean(defined) if defined else None


def band(normalized: float | None) -> str:
    """Verdict for a normalized score, with thresholds from a merging evaluation guide.

    "good"      if x > 0.8            (the guide: "scores above 0.8 are considered good")
    "moderate"  if 0.5 <= x <= 0.8    ("between 0.5 and 0.8 indicate moderate degradation")
    "failing"   if x < 0.5
    "undefined" if x is None
    """
    if normalized is None:
        return "undefined"
    # A mean such as (0.4 + 0.6) / 2 lands a rounding error below 0.5: compare at the precision the value
    # is shown and reasoned about, so a printed 0.50 is never "failing".
    x = round(normalized, 9)
    if x > 0.8:
        return "good"
    if x >= 0.5:
        return "moderate"
    return "failing"


def accuracy_stderr(acc: float, n: int) -> float:
    """Standard error of an accuracy over n examples, as lm-eval reports it.

        stderr = sqrt(acc * (1 - acc) / (n - 1))

    i.e. the sample standard error of a mean of n 0/1 values. Requires n >= 2
    and 0 <= acc <= 1; raises ValueError otherwise.
    """
    if n < 2:
        raise ValueError(f"n must be >= 2 for a sample stderr, got {n}")
    if not 0.0 <= acc <= 1.0:
        raise ValueError(f"acc must be in [0, 1], got {acc}")
    return math.sqrt(acc * (1.0 - acc) / (n - 1))
