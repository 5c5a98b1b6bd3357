"""Linear averaging and the task-vector family (task arithmetic, TIES).

Notation, per tensor: ``b`` the base, ``e_i`` expert i (i = 1..N),
``d_i = e_i - b`` its task vector, ``w_i`` its weight (default 1), ``lambda``
the scale of the merged task vector. Arithmetic runs in float32 and the result
is cast back to the base's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergeval.errors import UserError
from mergeval.methods.registry import register


@dataclass
class LinearConfig:
    name: str = "linear"
    weights: list[float] | None = None
    normalize: bool = True
    include_base: bool = False


@dataclass
class TaskArithmeticConfig:
    name: str = "task_arithmetic"
    lambda_: float = 1.0
    weights: list[float] | None = None


@dataclass
class TiesConfig:
    name: str = "ties"
    lambda_: float = 1.0
    density: float = 0.5
    weights: list[float] | None = None
    sign_rule: str = "sum"  # "sum": sign of the summed trimmed deltas (paper); "count": majority vote
    weights_before_election: bool = False  # True: mergekit's order (weights applied, then election)


def _check_weights(weights: list[float] | None, n: int) -> None:
    if weights is None:
        return
    if len(weights) != n:
        raise UserError("method.weights", f"{len(weights)} weights for {n} merged models",
                        f"give exactly {n} weights or leave method.weights null")
    if not all(math.isfinite(w) for w in weights):
        raise UserError("method.weights", f"non-finite weight in {weights}", "use finite numbers")


def _check_lambda(lam: float) -> None:
    if not math.isfinite(lam):
        raise UserError("method.lambda_", f"must be a finite number, got {lam}", "set e.g. method.lambda_=1.0")


def _validate_linear(cfg: LinearConfig, n_experts: int) -> None:
    n = n_experts + (1 if cfg.include_base else 0)
    _check_weights(cfg.weights, n)
    if cfg.normalize and cfg.weights is not None and abs(sum(cfg.weights)) < 1e-12:
        raise UserError("method.weights", "weights sum to 0 and method.normalize=true",
                        "use weights with a non-zero sum or set method.normalize=false")


def _validate_ta(cfg: TaskArithmeticConfig, n_experts: int) -> None:
    _check_lambda(cfg.lambda_)
    _check_weights(cfg.weights, n_experts)


def _validate_ties(cfg: TiesConfig, n_experts: int) -> None:
    _validate_ta(cfg, n_experts)  # same lambda_ and weights rules
    if not (0.0 < cfg.density <= 1.0):
        raise UserError("method.density", f"must be in (0, 1], got {cfg.density}", "set e.g. method.density=0.5")
    if cfg.sign_rule not in ("sum", "count"):
        raise UserError("method.sign_rule", f"unknown rule '{cfg.sign_rule}'", "use 'sum' or 'count'")


def _weights(weights: list[float] | None, n: int) -> list[float]:
    return list(weights) if weights is not None else [1.0] * n


@register("linear", LinearConfig, _validate_linear)
def linear(base: torch.Tensor, experts: list[torch.Tensor], cfg: LinearConfig, gen: torch.Generator) -> torch.Tensor:
    """Weighted average of the models (a model soup).

    merged = sum_i w_i * e_i / sum_i w_i          (normalize=true, the default)
    merged = sum_i w_i * e_i                      (normalize=false)
    The base joins the average as one more model only when include_base=true.
    """
    models = ([base] if cfg.include_base else []) + experts
    w = _weights(cfg.weights, len(models))
    total = sum(wi * m.float() for wi, m in zip(w, models))
    if cfg.normalize:
        total = total / sum(w)
    return total.to(base.dtype)


@register("task_arithmetic", TaskArithmeticConfig, _validate_ta)
def task_arithmetic(base: torch.Tensor, experts: list[torch.Tensor], cfg: TaskArithmeticConfig,
                    gen: torch.Generator) -> torch.Tensor:
    """Task arithmetic (Ilharco et al., 2023).

    merged = b + lambda * sum_i w_i * (e_i - b)
    """
    b = base.float()
    w = _weights(cfg.weights, len(experts))
    delta = sum(wi * (e.float() - b) for wi, e in zip(w, experts))
    return (b + cfg.lambda_ * delta).to(base.dtype)


def kept_count(density: float, n: int) -> int:
    """k = ceil(density * n), at least 1; rounded first so float error (0.07 * 100 = 7.000000000000001) adds no entry."""
    return max(1, math.ceil(round(density * n, 9)))


def trim_to_density(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the k = ceil(density * numel) entries of largest magnitude, zero the rest."""
    if density >= 1.0:
        return delta
    k = kept_count(density, delta.numel())
    flat = delta.flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[flat.abs().topk(k, sorted=False).indices] = True
    return torch.where(keep, flat, torch.zeros_like(flat)).view_as(delta)


@register("ties", TiesConfig, _validate_ties)
def ties(base: torch.Tensor, experts: list[torch.Tensor], cfg: TiesConfig, gen: torch.Generator) -> torch.Tensor:
    """TIES-Merging (Yadav et al., 2023): trim, elect sign, disjoint mean.

    t_i     = trim(d_i, density)                   keep the top-density fraction by |d_i|
    gamma   = sign(sum_i t_i)                      sign_rule="sum" (the paper: total mass decides)
            = sign(sum_i sign(t_i))                sign_rule="count" (majority of experts)
    A_i     = [sign(t_i) == gamma] and t_i != 0    the experts that agree, entry-wise
    tau     = sum_i w_i A_i t_i / sum_i w_i A_i    the disjoint (weighted) mean; 0 where no one agrees
    merged  = b + lambda * tau

    weights_before_election=false (default, faithful to the paper, which has no
    weights): the election sees the unweighted trimmed deltas. true reproduces
    mergekit, which multiplies t_i by w_i before electing the sign.
    """
    b = base.float()
    w = _weights(cfg.weights, len(experts))
    trimmed = torch.stack([trim_to_density(e.float() - b, cfg.density) for e in experts])
    wt = torch.tensor(w, dtype=torch.float32).view(-1, *([1] * b.dim()))
    voters = trimmed * wt if cfg.weights_before_election else trimmed
    gamma = torch.sign(voters.sum(0)) if cfg.sign_rule == "sum" else torch.sign(torch.sign(voters).sum(0))
    agree = (torch.sign(trimmed) == gamma) & (trimmed != 0)
    weight_mass = (wt * agree).sum(0)
    tau = (wt * trimmed * agree).sum(0) / weight_mass.where(weight_mass != 0, torch.ones_like(weight_mass))
    return (b + cfg.lambda_ * tau).to(base.dtype)
