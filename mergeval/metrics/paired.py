"""Standard errors of scores and their differences when models answer the same items (paired).

Pure functions, no I/O.

What a claim compares is linear in task scores: a score, a group mean,
Macro-Gain, a drop below the base, one of those minus another. Such a value
is a ``Linear`` combination

    V = sum_k c_k * mean_i x_{k,i}

where k is one model's outcomes on one task (``Outcomes``) and i runs over
the task's items. Models scored on the same items are correlated (an easy
item is easy for all of them), so V's variance is not the sum of its parts'.
Per task t, with z_i = sum_{k on t} c_k x_{k,i} over the items of t:

    var_t  = s^2(z) / n_t          s^2: sample variance (n - 1), as lm-eval's stderr
    se(V)  = sqrt(sum_t var_t)     different tasks hold different items: independent

For one score this is lm-eval's stderr, s(x)/sqrt(n). For a difference of two
models on one task, s^2(x - y) = s^2(x) + s^2(y) - 2 cov(x, y): the unpaired
sqrt(se_x^2 + se_y^2) when the sample covariance is 0, smaller when the two
are positively correlated, larger when negatively.

Terms of a task that lack per-item outcomes (results from before they were
kept, metrics that are not means of items) or whose items differ from the
others' are taken as independent: they add (c_k * se_k)^2.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Outcomes:
    """One model's result on one task: its reported stderr and, where kept, each item's value (ids aligned)."""

    task: str
    stderr: float
    ids: tuple = ()
    values: tuple[float, ...] = ()

    @property
    def paired(self) -> bool:
        return len(self.values) > 1


@dataclass(frozen=True)
class Linear:
    """sum_k c_k * mean(outcomes_k): ``terms`` maps a key (unique per model and task) to (outcomes, c_k)."""

    terms: dict[Hashable, tuple[Outcomes, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, key: Hashable, outcomes: Outcomes) -> Linear:
        return cls({key: (outcomes, 1.0)})

    def __add__(self, other: Linear) -> Linear:
        terms = dict(self.terms)
        for key, (outcomes, c) in other.terms.items():
            terms[key] = (outcomes, terms[key][1] + c if key in terms else c)
        return Linear(terms)

    def __mul__(self, factor: float) -> Linear:
        return Linear({key: (outcomes, c * factor) for key, (outcomes, c) in self.terms.items()})

    __rmul__ = __mul__

    def __sub__(self, other: Linear) -> Linear:
        return self + other * -1.0

    @property
    def paired(self) -> bool:
        """Whether every term has per-item outcomes (else the stderr takes some terms as independent)."""
        return all(outcomes.paired for outcomes, _ in self.terms.values())

    @property
    def items(self) -> int:
        """The most items any of its tasks holds (0 where none are kept)."""
        return max((len(outcomes.values) for outcomes, _ in self.terms.values()), default=0)


def total(forms: Sequence[Linear]) -> Linear:
    out = Linear()
    for form in forms:
        out = out + form
    return out


def sample_variance(values: Sequence[float]) -> float:
    """s^2 = sum_i (v_i - mean)^2 / (n - 1); 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = math.fsum(values) / n
    return math.fsum((v - mean) ** 2 for v in values) / (n - 1)


def paired_stderr(form: Linear) -> float:
    """se(V) of the module docstring: per task, the per-item combination's sample variance over n."""
    by_task: dict[str, list[tuple[Outcomes, float]]] = {}
    for outcomes, c in form.terms.values():
        if c != 0.0:
            by_task.setdefault(outcomes.task, []).append((outcomes, c))
    var = []
    for terms in by_task.values():
        items = [(o, c) for o, c in terms if o.paired]
        alone = [(o, c) for o, c in terms if not o.paired]
        if items:
            ids = items[0][0].ids
            same = [(o, c) for o, c in items if o.ids == ids]
            alone += [(o, c) for o, c in items if o.ids != ids]
            z = [math.fsum(c * o.values[i] for o, c in same) for i in range(len(ids))]
            var.append(sample_variance(z) / len(z))
        var.extend((c * o.stderr) ** 2 for o, c in alone)
    return math.sqrt(math.fsum(var))


def items_to_decide(margin: float, stderr_margin: float, n: int, by: float = 2.0) -> int | None:
    """Items per task a comparison needs for its verdict to be ``by`` standard errors from its threshold, if the
    effect stays as measured on ``n`` items.

    With z = (d + t) / se the measured effect in stderrs (``margin`` = z - k, k = ``stderr_margin``) and se
    shrinking as 1/sqrt(n), n' items give z' = z sqrt(n'/n); the verdict is decided when |z' - k| >= by:

        already (|z - k| >= by)  -> n
        z > 0                    -> n' = n ((k + by) / z)^2       (it passes)
        z < 0, k < by            -> n' = n ((by - k) / -z)^2      (it fails)
        z = 0                    -> None (no effect measured: no number of items decides it)

    None too where that would take more than a billion items.
    """
    z = margin + stderr_margin
    if abs(margin) >= by:
        return n
    if z == 0:
        return None
    ratio = ((stderr_margin + by) / z) ** 2 if z > 0 else ((by - stderr_margin) / -z) ** 2
    return math.ceil(n * ratio) if n * ratio <= 1e9 else None


def items_to_pass(margin: float, stderr_margin: float, n: int) -> int | None:
    """Items per task a comparison that falls short of its ``stderr_margin`` (``margin`` < 0) needs to pass it,
    if the effect stays as measured on ``n`` items: z' = z sqrt(n'/n) >= k, so n' = n (k / z)^2 for z > 0
    (z = margin + k); ``n`` where it passes already; None where the effect is not on the pass side at all
    (z <= 0) or it would take more than a billion items."""
    z = margin + stderr_margin
    if margin >= 0:
        return n
    if z <= 0:
        return None
    ratio = (stderr_margin / z) ** 2
    return math.ceil(n * ratio) if n * ratio <= 1e9 else None
