"""Perplexity of held-out text: the fast proxy of the evaluation guide's first stage.

A model scoring teacher-forced text yields, for every scored token, its
negative log-likelihood ``nll = -ln p(token | prefix)`` (natural log, so
``nll >= 0``). The functions here turn those numbers into perplexities and
into the ranking key of a sweep's first stage; they are pure (the model side
is ``mergeval.staged.nll``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence


def log_perplexity(nlls: Iterable[Sequence[float]]) -> float:
    """Token-weighted mean negative log-likelihood: ``Σ_i Σ_j nll_ij / Σ_i n_i``.

    ``nlls[i]`` holds the per-token NLLs of text ``i`` (``n_i`` tokens). Tokens
    are pooled, not texts: every token weighs the same, so the value does not
    depend on the order of the texts or of their tokens. ``math.fsum`` makes the
    sum exactly rounded, so that invariance holds bit for bit, not just nearly.
    """
    values = [float(v) for text in nlls for v in text]
    if not values:
        raise ValueError("perplexity of no tokens is undefined")
    return math.fsum(values) / len(values)


def perplexity(nlls: Iterable[Sequence[float]]) -> float:
    """Token-weighted perplexity over texts: ``PPL = exp(Σ_i Σ_j nll_ij / Σ_i n_i)``.

    The exponential of :func:`log_perplexity`. Since every ``nll >= 0``,
    ``PPL >= 1``; a model giving every token probability ``1/V`` has
    ``PPL = V`` (it is as unsure as a uniform choice among V tokens). A mean
    NLL beyond the float range (a broken model) gives ``inf``, not an error.
    """
    try:
        return math.exp(log_perplexity(nlls))
    except OverflowError:
        return math.inf


def mean_log_ratio(candidate: Mapping[str, float], reference: Mapping[str, float]) -> float:
    """Mean over tasks of the log perplexity ratio: ``r = (1/T) Σ_t ln(PPL_c(t) / PPL_ref(t))``.

    The first stage's ranking key (lower is better). ``r < 0``: the candidate
    is on average less perplexed than the reference; ``exp(r)`` is the
    geometric mean of the per-task ratios. Subtracting one reference from every
    candidate shifts all keys by the same constant, so the reference never
    changes the ranking, only the early-stop test (:func:`degradation`).
    Tasks are those of ``candidate``; ``reference`` must have each of them.
    """
    if not candidate:
        raise ValueError("no tasks to compare")
    return math.fsum(math.log(candidate[t] / reference[t]) for t in candidate) / len(candidate)


def degradation(candidate: Mapping[str, float], reference: Mapping[str, float]) -> float:
    """Relative perplexity increase over the reference: ``exp(r) - 1`` with ``r`` = :func:`mean_log_ratio`.

    0 means as perplexed as the reference (geometric mean over tasks), 0.5 means
    50% more, negative means less. The early stop compares it with
    ``staged.degrade_threshold``.
    """
    return math.expm1(mean_log_ratio(candidate, reference))
