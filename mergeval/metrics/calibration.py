"""Calibration and answer consistency of a (merged) model.

Pure functions, no I/O. A merging evaluation guide notes that calibration
degrades in badly merged models before accuracy does, and that merged models
may answer the same question differently when it is asked in another format.

- ``expected_calibration_error``: ECE over equal-width confidence bins.
- ``ece_from_loglikelihoods``: ECE of multiple-choice answers, from the
  per-choice log-likelihoods lm-eval logs.
- ``consistency``: agreement between a model's answers to the same questions
  asked in two formats; ``format_agreement`` computes it (with each format's
  accuracy) from two formats' per-choice log-likelihoods.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def expected_calibration_error(confidences: Sequence[float], correct: Sequence[bool | int], n_bins: int = 10) -> float:
    """Expected calibration error over n_bins equal-width bins of [0, 1].

        B_b     = { i : b/n_bins <= conf_i < (b+1)/n_bins },  b = 0..n_bins-1
                  (conf_i = 1 goes into the last bin, as numpy.histogram does)
        acc(B)  = mean_{i in B} correct_i
        conf(B) = mean_{i in B} conf_i
        ECE     = sum_b |B_b| / n * |acc(B_b) - conf(B_b)|

    Empty bins contribute 0; ECE is in [0, 1]. ``correct`` holds booleans or
    0/1. Raises ValueError on empty or misaligned input, a confidence outside
    [0, 1] (or NaN), a correctness value other than 0/1, or n_bins < 1.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    conf = np.asarray(confidences, dtype=float)
    corr = np.asarray(correct, dtype=float)
    if conf.ndim != 1 or conf.size == 0:
        raise ValueError(f"confidences must be a non-empty 1-D sequence, got shape {conf.shape}")
    if corr.shape != conf.shape:
        raise ValueError(f"{len(conf)} confidences but {len(corr)} correctness values")
    if not np.all((conf >= 0.0) & (conf <= 1.0)):
        raise ValueError("confidences must be in [0, 1]")
    if not np.all((corr == 0.0) | (corr == 1.0)):
        raise ValueError("correct must hold booleans or 0/1")
    bins = np.minimum((conf * n_bins).astype(int), n_bins - 1)
    ece = 0.0
    for b in np.unique(bins):
        mask = bins == b
        ece += mask.sum() / conf.size * abs(corr[mask].mean() - conf[mask].mean())
    return float(ece)


def ece_from_loglikelihoods(
    choice_loglikelihoods: Sequence[Sequence[float]],
    gold: Sequence[int],
    n_bins: int = 10,
) -> float:
    """ECE of multiple-choice predictions scored by per-choice log-likelihoods.

    For item i with choice log-likelihoods l_i1..l_iK (as lm-eval logs them:
    the log-probability of each choice's continuation given the prompt):

        p_ij    = exp(l_ij) / sum_k exp(l_ik)     (softmax over the choices)
        pred_i  = argmax_j l_ij                   (first on ties, like lm-eval's acc)
        conf_i  = p_i,pred_i
        correct = (pred_i == gold_i)
        result  = expected_calibration_error(conf, correct, n_bins)

    Raw (not length-normalised) log-likelihoods are used, as for lm-eval's
    ``acc``. Raises ValueError on misaligned input, an item with no choices or
    a non-finite log-likelihood, or a gold index out of range.
    """
    if len(choice_loglikelihoods) != len(gold):
        raise ValueError(f"{len(choice_loglikelihoods)} items but {len(gold)} gold answers")
    confidences, correct = [], []
    for i, (lls, g) in enumerate(zip(choice_loglikelihoods, gold)):
        ll = np.asarray(lls, dtype=float)
        if ll.ndim != 1 or ll.size == 0:
            raise ValueError(f"item {i} must have a non-empty list of choice log-likelihoods")
        if not np.all(np.isfinite(ll)):
            raise ValueError(f"item {i} has a non-finite log-likelihood: {list(lls)}")
        if not 0 <= g < ll.size:
            raise ValueError(f"gold index {g} of item {i} is out of range for {ll.size} choices")
        pred = int(np.argmax(ll))
        # softmax probability of the argmax: 1 / sum_k exp(l_k - l_max), stable
        confidences.append(1.0 / math.fsum(np.exp(ll - ll[pred])))
        correct.append(pred == g)
    return expected_calibration_error(confidences, correct, n_bins)


def consistency(answers_a: Sequence, answers_b: Sequence) -> float:
    """Fraction of questions answered the same way in two formats.

        consistency = (1 / n) * sum_i [answers_a[i] == answers_b[i]]

    answers_a[i] and answers_b[i] are the model's answers to question i asked
    in format A and format B, already mapped to comparable values (e.g. the
    option letter, or a normalised string); equality is Python's ``==``.
    Raises ValueError on empty or misaligned lists.
    """
    if len(answers_a) != len(answers_b):
        raise ValueError(f"{len(answers_a)} answers in format A but {len(answers_b)} in format B")
    if len(answers_a) == 0:
        raise ValueError("no answers: need at least one question")
    return sum(a == b for a, b in zip(answers_a, answers_b)) / len(answers_a)


def format_agreement(rows_a: Sequence[Mapping], rows_b: Sequence[Mapping]) -> dict:
    """A model's answers to the same items asked in two formats, from per-choice log-likelihoods.

    Rows are ``{doc_id, lls, gold}`` (one per item, any order); items are matched by doc_id, and
    choice j of one format is choice j of the other (the lettered format lists the cloze choices in
    order), so answers compare as choice indices:

        pred_f(i)    = argmax_j lls_f(i)_j                 (first on ties, like lm-eval's acc)
        agreement    = consistency(pred_a, pred_b) = (1/n) sum_i [pred_a(i) == pred_b(i)]
        acc_f        = (1/n) sum_i [pred_f(i) == gold_i]
        both_correct = (1/n) sum_i [pred_a(i) == gold_i and pred_b(i) == gold_i]

    Returns ``{"agreement", "n", "acc_a", "acc_b", "both_correct"}``. Raises ValueError when the two
    formats do not hold the same items (doc_ids, gold answers or choice counts differ) or a doc_id repeats.
    """
    a, b = _by_doc(rows_a), _by_doc(rows_b)
    if set(a) != set(b):
        raise ValueError(f"the formats hold different items: doc_ids {sorted(set(a) ^ set(b))[:5]} are in one only")
    docs = sorted(a)
    for d in docs:
        if a[d]["gold"] != b[d]["gold"] or len(a[d]["lls"]) != len(b[d]["lls"]):
            raise ValueError(
                f"doc_id {d} differs between the formats: gold {a[d]['gold']} / {b[d]['gold']}, "
                f"{len(a[d]['lls'])} / {len(b[d]['lls'])} choices"
            )
    pred_a = [int(np.argmax(a[d]["lls"])) for d in docs]  # numpy: the first of equal maxima, like lm-eval's acc
    pred_b = [int(np.argmax(b[d]["lls"])) for d in docs]
    gold = [a[d]["gold"] for d in docs]
    n = len(docs)
    return {
        "agreement": consistency(pred_a, pred_b),
        "n": n,
        "acc_a": sum(p == g for p, g in zip(pred_a, gold)) / n,
        "acc_b": sum(p == g for p, g in zip(pred_b, gold)) / n,
        "both_correct": sum(p == q == g for p, q, g in zip(pred_a, pred_b, gold)) / n,
    }


def _by_doc(rows: Sequence[Mapping]) -> dict:
    out = {row["doc_id"]: row for row in rows}
    if len(out) != len(rows):
        raise ValueError("a doc_id appears twice in one format's rows")
    return out
