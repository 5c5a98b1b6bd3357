"""Curriculum Model Merging (CMM; the chemical-LLM paper, seeds/cmm-chem-openreview-excerpt.txt).

CMM ranks the experts by a validation score and merges them one per step,
from the weakest to the strongest, giving later (stronger) experts larger
coefficients. Per tensor, with base ``b``, task vectors ``d_i = e_i - b``, the
merge order ``pi`` (a permutation of the experts) and step coefficients
``c_1..c_N`` from the schedule:

- ``update="interpolate"`` (default): each step's task vector is taken against
  the model merged so far, ``theta_k = theta_{k-1} + c_k (e_{pi(k)} - theta_{k-1})
  = (1 - c_k) theta_{k-1} + c_k e_{pi(k)}``, ``theta_0 = b``; the result is
  ``b + lambda * (theta_N - b)``, where ``theta_N - b = sum_k c_k prod_{j>k}
  (1 - c_j) d_{pi(k)}`` is still a weighted sum of all task vectors.
- ``update="additive"``: ``theta_k = theta_{k-1} + c_k d_{pi(k)}``, so the result
  ``b + lambda * sum_k c_k d_{pi(k)}`` *is* task arithmetic with each expert
  weighted by its step's coefficient (tests/methods/test_curriculum_pipeline.py).
- ``update="ties_step"``: each step merges the model so far and the next expert
  with TIES around the base, ``theta_k = TIES(b; [theta_{k-1}, e_{pi(k)}],
  weights [1 - c_k, c_k], density)`` (trim, elect sign, disjoint mean;
  methods/task_vector.py); the result is ``b + lambda * (theta_N - b)``.

Why interpolate is the default. The paper does not print its update rule; the
review discussion (seed cmm-chem-openreview-excerpt.txt) constrains it: (1) the
baselines TA, TIES, DARE_TA and SCE used "the same weights" and CMM beat the best
of them; (2) reversing the order drops the overall score from 56.62 to 41.67;
(3) an expert's SAR falls slightly as later experts are merged; (4) "tau_new is
the sum of all task vectors". ``additive`` violates (1) and (2): it equals
same-weight task arithmetic, and the order changes nothing once the weights
are fixed. ``interpolate`` satisfies all four: it differs from same-weight task
arithmetic, it depends on the order beyond the weights, each later step scales
the earlier experts by (1 - c_k), and its result is a weighted sum of the task
vectors. ``ties_step`` satisfies (1)-(3) (order (2) from three experts on: with
two and equal weights its disjoint mean is symmetric) but not (4) (its sign
election and trimming make the result no linear sum). result.json records which one ran.

Schedules over the N steps (k = 1..N, ``u = (k-1)/(N-1)``, u = 0 when N = 1):
``constant``: c_k = start; ``linear``: c_k = start + (end - start) u (the paper's
best: 0.3 -> 0.6); ``exponential``: c_k = start (end/start)^u (geometric).

Order: ``ranked`` (ascending validation score: weakest first, the paper),
``reverse`` (strongest first: the paper's reversed-order ablation), ``given``
(the modelset's order; no validation needed). Ties in the score keep the
modelset's order. ``validation_scores`` (one per expert, in modelset order)
are filled by the run from mergeval's evaluator on the validation split, or
may be given (e.g. a paper's own S_i) to skip that evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergeval.core.errors import UserError
from mergeval.methods.draws import Draws
from mergeval.methods.registry import Needs, Ranking, register

SCHEDULES = ("constant", "linear", "exponential")
ORDERS = ("ranked", "reverse", "given")
UPDATES = ("interpolate", "additive", "ties_step")


@dataclass
class CmmConfig:
    name: str = "cmm"
    order: str = "ranked"
    schedule: str = "linear"
    start: float = 0.3
    end: float = 0.6
    lambda_: float = 1.0
    update: str = "interpolate"
    density: float = 0.5  # update=ties_step only: the share of each step's deltas TIES keeps
    rank_by: str = "mean"  # "mean": each expert's mean validation accuracy over all tasks; "own_task": its own task
    validation_items: int = 100  # items per task in the validation split used for ranking
    validation_scores: list[float] | None = None  # one per expert (modelset order); null: measured by the run


def schedule(kind: str, start: float, end: float, n: int) -> list[float]:
    """The step coefficients c_1..c_n (see the module docstring)."""
    us = [k / (n - 1) if n > 1 else 0.0 for k in range(n)]
    if kind == "constant":
        return [start] * n
    if kind == "linear":
        return [start + (end - start) * u for u in us]
    return [start * (end / start) ** u for u in us]


def merge_order(order: str, scores: list[float] | None, n: int) -> list[int]:
    """Expert indices in merge order: by ascending score (ranked), descending (reverse), or as given."""
    if order == "given":
        return list(range(n))
    assert scores is not None, "validation_scores must be resolved before merging"
    ranked = sorted(range(n), key=lambda i: (scores[i], i))
    return ranked if order == "ranked" else sorted(range(n), key=lambda i: (-scores[i], i))


def _validate(cfg: CmmConfig, n_experts: int) -> None:
    if cfg.order not in ORDERS:
        raise UserError("method.order", f"unknown order '{cfg.order}'", f"use one of: {', '.join(ORDERS)}")
    if cfg.schedule not in SCHEDULES:
        raise UserError("method.schedule", f"unknown schedule '{cfg.schedule}'", f"use one of: {', '.join(SCHEDULES)}")
    if cfg.update not in UPDATES:
        raise UserError("method.update", f"unknown update '{cfg.update}'", f"use one of: {', '.join(UPDATES)}")
    if cfg.rank_by not in ("mean", "own_task"):
        raise UserError("method.rank_by", f"unknown ranking '{cfg.rank_by}'", "use mean or own_task")
    for field in ("start", "end", "lambda_"):
        if not math.isfinite(getattr(cfg, field)):
            raise UserError(f"method.{field}", f"must be a finite number, got {getattr(cfg, field)}", "set a number")
    if cfg.schedule == "exponential" and (cfg.start <= 0 or cfg.end <= 0):
        raise UserError(
            "method.start",
            f"an exponential schedule needs start and end > 0, got {cfg.start}, {cfg.end}",
            "use positive coefficients or schedule=linear",
        )
    if cfg.update in ("interpolate", "ties_step") and not all(0 <= c <= 1 for c in (cfg.start, cfg.end)):
        raise UserError(
            "method.start",
            f"update={cfg.update} needs coefficients in [0, 1]",
            "set start and end within [0, 1] or use update=additive",
        )
    if not 0 < cfg.density <= 1:
        raise UserError("method.density", f"must be in (0, 1], got {cfg.density}", "set e.g. method.density=0.5")
    if cfg.validation_items < 1:
        raise UserError(
            "method.validation_items",
            f"must be positive, got {cfg.validation_items}",
            "set e.g. method.validation_items=100",
        )
    if cfg.validation_scores is not None and len(cfg.validation_scores) != n_experts:
        raise UserError(
            "method.validation_scores",
            f"{len(cfg.validation_scores)} scores for {n_experts} experts",
            f"give {n_experts} scores in the modelset's order, or null to measure them",
        )


def _ranking_pending(cfg: CmmConfig) -> bool:
    """An order by validation score whose scores are not given must measure them first."""
    return cfg.order != "given" and cfg.validation_scores is None


def details(cfg: CmmConfig, expert_names: list[str]) -> dict:
    """The merge order (expert names) and step coefficients this config gives, for result.json."""
    order = merge_order(cfg.order, cfg.validation_scores, len(expert_names))
    return {
        "order": [expert_names[i] for i in order],
        "coefficients": schedule(cfg.schedule, cfg.start, cfg.end, len(expert_names)),
    }


# version 2: ties at the trim cut kept by position (1: in torch.topk's order)
@register(
    "cmm",
    CmmConfig,
    _validate,
    version=2,
    needs=Needs(ranking=Ranking(_ranking_pending, "give {at}validation_scores or set {at}order=given")),
    details=details,
)
def cmm(base: torch.Tensor, experts: list[torch.Tensor], cfg: CmmConfig, gen: Draws) -> torch.Tensor:
    """Curriculum merge: theta_0 = b; theta_k = (1 - c_k) theta_{k-1} + c_k e_pi(k) (interpolate),
    theta_{k-1} + c_k d_pi(k) (additive) or TIES(b; [theta_{k-1}, e_pi(k)], [1 - c_k, c_k]) (ties_step);
    result = b + lambda (theta_N - b)."""
    from mergeval.methods.task_vector import TiesConfig, ties

    b = base.float()
    order = merge_order(cfg.order, cfg.validation_scores, len(experts))
    coeffs = schedule(cfg.schedule, cfg.start, cfg.end, len(experts))
    theta = b.clone()
    step = torch.empty_like(b)  # each step's term, in one buffer (in place: x * y == y * x, x + y == y + x exactly)
    for c, i in zip(coeffs, order):
        e = experts[i].float()
        if cfg.update == "additive":
            theta.add_(torch.sub(e, b, out=step).mul_(c))
        elif cfg.update == "interpolate":
            theta.mul_(1 - c).add_(torch.mul(e, c, out=step))
        else:
            theta = ties(b, [theta, e], TiesConfig(density=cfg.density, weights=[1 - c, c]), gen)
    return theta.sub_(b).mul_(cfg.lambda_).add_(b).to(base.dtype)
