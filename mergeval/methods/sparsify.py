"""Sparsified task-vector methods: DARE, Model Breadcrumbs, DELLA and SCE.

Notation as in ``task_vector.py``, per tensor: ``b`` the base, ``e_i`` expert i
(i = 1..N), ``d_i = e_i - b`` its task vector, ``w_i`` its weight (default 1),
``lambda`` the scale of the merged task vector. Arithmetic runs in float32 and
the result is cast back to the base's dtype.

DARE, Breadcrumbs and DELLA first sparsify every ``d_i`` on its own into
``s_i``, then combine the ``s_i`` in one of two ways:

    linear variants (dare_linear, breadcrumbs, della_linear):
        merged = b + lambda * sum_i w_i * s_i
    TIES variants (dare_ties, breadcrumbs_ties, della):
        merged = b + lambda * disjoint_mean(s_1..s_N)
    where disjoint_mean is the sign election and disjoint (weighted) mean of
    ``ties`` with the same options (sign_rule, weights_before_election).

The TIES variants always take the disjoint *mean* (as ``ties`` does); mergekit
defaults dare_ties and breadcrumbs_ties to normalize=false, i.e. the disjoint
*sum*. Random methods draw all their randomness from the generator they are
given, one uniform draw per entry per expert in expert order, so a seed fixes
the output bit for bit; the expert order therefore changes which draws each
expert gets (the output distribution does not depend on the order).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mergeval.errors import UserError
from mergeval.methods.registry import register
from mergeval.methods.task_vector import _check_lambda, _check_weights, _weights, kept_count, trim_to_density

RESCALES_DARE = ("inverse_density", "l1")
RESCALES_DELLA = ("inverse_prob", "l1")
RANK_SCOPES = ("tensor", "row")
SIGN_RULES = ("sum", "count")


# ---------------------------------------------------------------- configs


@dataclass
class DareLinearConfig:
    name: str = "dare_linear"
    lambda_: float = 1.0
    density: float = 0.5  # keep probability of each delta entry (1 - the paper's drop rate p)
    weights: list[float] | None = None
    rescale: str = "inverse_density"  # "inverse_density": kept / density (paper); "l1": match the L1 norm (mergekit)


@dataclass
class DareTiesConfig:
    name: str = "dare_ties"
    lambda_: float = 1.0
    density: float = 0.5
    weights: list[float] | None = None
    rescale: str = "inverse_density"
    sign_rule: str = "sum"  # as in ties: "sum" (paper) or "count" (majority of experts)
    weights_before_election: bool = False  # as in ties: true reproduces mergekit's order


@dataclass
class BreadcrumbsConfig:
    name: str = "breadcrumbs"
    lambda_: float = 1.0
    density: float = 0.9  # fraction of entries kept (after the outliers), by magnitude
    gamma: float = 0.01  # fraction of largest-magnitude entries dropped as outliers
    weights: list[float] | None = None


@dataclass
class BreadcrumbsTiesConfig:
    name: str = "breadcrumbs_ties"
    lambda_: float = 1.0
    density: float = 0.9
    gamma: float = 0.01
    weights: list[float] | None = None
    sign_rule: str = "sum"
    weights_before_election: bool = False


@dataclass
class DellaLinearConfig:
    name: str = "della_linear"
    lambda_: float = 1.0
    density: float = 0.5  # mean keep probability
    epsilon: float = 0.1  # keep probabilities span [density - epsilon, density + epsilon] by magnitude rank
    weights: list[float] | None = None
    rescale: str = "inverse_prob"  # "inverse_prob": kept / p_keep (paper); "l1": match the L1 norm (mergekit)
    rank_scope: str = "tensor"  # magnitude ranks within the "tensor", or within each "row" (mergekit)


@dataclass
class DellaConfig:
    name: str = "della"
    lambda_: float = 1.0
    density: float = 0.5
    epsilon: float = 0.1
    weights: list[float] | None = None
    rescale: str = "inverse_prob"
    rank_scope: str = "tensor"
    sign_rule: str = "sum"
    weights_before_election: bool = False


@dataclass
class SceConfig:
    name: str = "sce"
    lambda_: float = 1.0
    select_topk: float = 1.0  # fraction of entries kept, ranked by variance across experts (1 = all)
    normalize: bool = False  # true: divide by the surviving weights, as mergekit does
    uniform_below: float = 0.0  # equal expert weights below this summed mean-square delta (mergekit: 1e-6)


# ---------------------------------------------------------------- validation


def _check_density(density: float, field: str = "method.density") -> None:
    if not (0.0 < density <= 1.0):
        raise UserError(field, f"must be in (0, 1], got {density}", f"set e.g. {field}=0.5")


def _check_choice(value: str, allowed: tuple[str, ...], field: str) -> None:
    if value not in allowed:
        raise UserError(field, f"unknown value '{value}'", f"use one of: {', '.join(allowed)}")


def _check_common(cfg, n_experts: int) -> None:
    _check_lambda(cfg.lambda_)
    _check_weights(cfg.weights, n_experts)
    _check_density(cfg.density)
    if hasattr(cfg, "sign_rule"):
        _check_choice(cfg.sign_rule, SIGN_RULES, "method.sign_rule")


def _validate_dare(cfg: DareLinearConfig | DareTiesConfig, n_experts: int) -> None:
    _check_common(cfg, n_experts)
    _check_choice(cfg.rescale, RESCALES_DARE, "method.rescale")


def _validate_breadcrumbs(cfg: BreadcrumbsConfig | BreadcrumbsTiesConfig, n_experts: int) -> None:
    _check_common(cfg, n_experts)
    if not (0.0 <= cfg.gamma < 1.0):
        raise UserError("method.gamma", f"must be in [0, 1), got {cfg.gamma}", "set e.g. method.gamma=0.01")
    if cfg.density + cfg.gamma > 1.0 + 1e-9:
        raise UserError("method.gamma", f"density + gamma = {cfg.density + cfg.gamma:g} exceeds 1",
                        "lower method.gamma or method.density so that they sum to at most 1")


def _validate_della(cfg: DellaLinearConfig | DellaConfig, n_experts: int) -> None:
    _check_common(cfg, n_experts)
    _check_choice(cfg.rescale, RESCALES_DELLA, "method.rescale")
    _check_choice(cfg.rank_scope, RANK_SCOPES, "method.rank_scope")
    if not (math.isfinite(cfg.epsilon) and cfg.epsilon >= 0.0):
        raise UserError("method.epsilon", f"must be a finite number >= 0, got {cfg.epsilon}",
                        "set e.g. method.epsilon=0.1")
    lo, hi = cfg.density - cfg.epsilon, cfg.density + cfg.epsilon
    if not (lo > 0.0 and hi <= 1.0 + 1e-9):
        raise UserError("method.epsilon", f"keep probabilities density -/+ epsilon = [{lo:g}, {hi:g}] "
                        "leave (0, 1]", "choose epsilon < density and density + epsilon <= 1")


def _validate_sce(cfg: SceConfig, n_experts: int) -> None:
    _check_lambda(cfg.lambda_)
    if not (math.isfinite(cfg.uniform_below) and cfg.uniform_below >= 0.0):
        raise UserError("method.uniform_below", f"must be a finite number >= 0, got {cfg.uniform_below}",
                        "set method.uniform_below=0 (never) or 1e-6 (mergekit)")
    _check_density(cfg.select_topk, "method.select_topk")
    if cfg.select_topk < 1.0 and n_experts < 2:
        raise UserError("modelset.experts", f"sce with select_topk < 1 ranks entries by their variance across "
                        f"experts, which needs at least 2 experts (got {n_experts})",
                        "add an expert or set method.select_topk=1.0")


# ---------------------------------------------------------------- sparsifiers (one task vector each)


def _uniform(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """U[0, 1) per entry of ``like``, drawn from ``gen`` (on the generator's device, then moved)."""
    return torch.rand(like.shape, generator=gen, device=gen.device).to(like.device)


def _match_l1(delta: torch.Tensor, kept: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """kept * ||delta||_1 / ||kept||_1, or kept unchanged if either norm is below eps (as mergekit)."""
    before, after = delta.abs().sum(), kept.abs().sum()
    if before < eps or after < eps:
        return kept
    return kept * (before / after)


def dare_drop(delta: torch.Tensor, density: float, rescale: str, gen: torch.Generator) -> torch.Tensor:
    """DARE (Yu et al., 2024): keep each entry independently with probability density, then rescale.

    m ~ Bernoulli(density) per entry (m = [u < density], u ~ U[0,1) from gen)
    s = m * delta / density                     rescale="inverse_density" (the paper; E[s] = delta)
    s = m * delta * |delta|_1 / |m * delta|_1   rescale="l1" (mergekit)
    density = 1 returns delta unchanged and draws nothing.
    """
    if density >= 1.0:
        return delta
    kept = torch.where(_uniform(delta, gen) < density, delta, torch.zeros_like(delta))
    return kept / density if rescale == "inverse_density" else _match_l1(delta, kept)


def breadcrumbs_mask(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs (Davari & Belilovsky, 2023): drop the outliers and the small entries.

    Sort the entries by |delta|; zero the n_top = floor(gamma * n) largest (the outliers), keep the
    next k = max(1, ceil(density * n)) (trim_to_density's count, as in ties), zero the rest.
    """
    n_top = int(gamma * delta.numel() + 1e-9)
    if n_top > 0:
        flat = delta.flatten().clone()
        flat[flat.abs().topk(n_top, sorted=False).indices] = 0
        delta = flat.view_as(delta)
    # The zeroed outliers now rank last, so trimming keeps the k largest of the rest.
    return trim_to_density(delta, density)


def della_keep_prob(delta: torch.Tensor, density: float, epsilon: float, rank_scope: str = "tensor") -> torch.Tensor:
    """MAGPRUNE keep probabilities: linear in the magnitude rank within a group of n entries.

    r = rank of |delta| among the n entries, 0 (smallest) .. n-1 (largest; ties by position)
    p = density - epsilon + 2 * epsilon * r / (n - 1)          (p = density when n = 1)
    The group is the whole tensor (rank_scope="tensor"), or each row delta[i, ...] -- one output
    unit's entries -- of a tensor with 2 or more dims (rank_scope="row"; 0/1-dim tensors form one
    row). "row" is mergekit's ranking for the 1- and 2-dim tensors of a transformer.
    """
    rows = delta.reshape(delta.shape[0], -1) if rank_scope == "row" and delta.dim() >= 2 else delta.reshape(1, -1)
    n = rows.shape[1]
    if n == 1:
        return torch.full_like(delta, density)
    order = torch.sort(rows.abs(), dim=1, stable=True).indices
    rank = torch.empty(rows.shape, dtype=torch.float32, device=delta.device)
    positions = torch.arange(n, dtype=torch.float32, device=delta.device) / (n - 1)
    rank.scatter_(1, order, positions.expand(rows.shape[0], n).contiguous())
    return ((density - epsilon) + 2.0 * epsilon * rank).view_as(delta)


def della_magprune(delta: torch.Tensor, density: float, epsilon: float, rescale: str,
                   gen: torch.Generator, rank_scope: str = "tensor") -> torch.Tensor:
    """DELLA's MAGPRUNE (Deep et al., 2024): magnitude-ranked random drop, then rescale.

    p = della_keep_prob(delta, rank_scope)      larger |delta| -> higher keep probability
    m ~ Bernoulli(p) per entry (m = [u < p], u ~ U[0,1) from gen)
    s = m * delta / p                           rescale="inverse_prob" (the paper; E[s] = delta)
    s = m * delta * |delta|_1 / |m * delta|_1   rescale="l1" (mergekit)
    """
    p = della_keep_prob(delta, density, epsilon, rank_scope)
    kept = torch.where(_uniform(delta, gen) < p, delta, torch.zeros_like(delta))
    return kept / p if rescale == "inverse_prob" else _match_l1(delta, kept)


# ---------------------------------------------------------------- combining


def disjoint_mean(sparse: torch.Tensor, w: list[float], sign_rule: str,
                  weights_before_election: bool) -> torch.Tensor:
    """TIES' election and disjoint mean over the stacked (N, ...) sparsified deltas -- ``ties``' rule.

    gamma = sign(sum_i s_i) ("sum") or sign(sum_i sign(s_i)) ("count"); s_i times w_i when
    weights_before_election; A_i = [sign(s_i) == gamma] and s_i != 0;
    tau = sum_i w_i A_i s_i / sum_i w_i A_i (0 where no one agrees).
    The "sum" vote adds the experts' values in sorted order, so which expert comes first cannot
    change a rounding-level sign.
    """
    wt = torch.tensor(w, dtype=torch.float32, device=sparse.device).view(-1, *([1] * (sparse.dim() - 1)))
    voters = sparse * wt if weights_before_election else sparse
    if sign_rule == "sum":
        gamma = torch.sign(voters.sort(0).values.sum(0))
    else:
        gamma = torch.sign(torch.sign(voters).sum(0))
    agree = (torch.sign(sparse) == gamma) & (sparse != 0)
    mass = (wt * agree).sum(0)
    return (wt * sparse * agree).sum(0) / mass.where(mass != 0, torch.ones_like(mass))


def _combine(base: torch.Tensor, experts: list[torch.Tensor], cfg,
             sparsify: Callable[[torch.Tensor], torch.Tensor], elect: bool) -> torch.Tensor:
    b = base.float()
    w = _weights(cfg.weights, len(experts))
    sparse = [sparsify(e.float() - b) for e in experts]
    if elect:
        tau = disjoint_mean(torch.stack(sparse), w, cfg.sign_rule, cfg.weights_before_election)
    else:
        tau = sum(wi * s for wi, s in zip(w, sparse))
    return (b + cfg.lambda_ * tau).to(base.dtype)


# ---------------------------------------------------------------- methods


@register("dare_linear", DareLinearConfig, _validate_dare)
def dare_linear(base: torch.Tensor, experts: list[torch.Tensor], cfg: DareLinearConfig,
                gen: torch.Generator) -> torch.Tensor:
    """DARE + task arithmetic (Yu et al., 2024).

    s_i    = dare_drop(d_i, density, rescale)   keep w.p. density; kept / density (or L1-matched)
    merged = b + lambda * sum_i w_i * s_i
    density = 1 is task_arithmetic.
    """
    return _combine(base, experts, cfg, lambda d: dare_drop(d, cfg.density, cfg.rescale, gen), elect=False)


@register("dare_ties", DareTiesConfig, _validate_dare)
def dare_ties(base: torch.Tensor, experts: list[torch.Tensor], cfg: DareTiesConfig,
              gen: torch.Generator) -> torch.Tensor:
    """DARE + TIES election (Yu et al., 2024): random drop instead of TIES' magnitude trim.

    s_i    = dare_drop(d_i, density, rescale)
    merged = b + lambda * disjoint_mean(s_1..s_N)   TIES' election + disjoint mean (sign_rule, weights)
    density = 1 is ties with density 1.
    """
    return _combine(base, experts, cfg, lambda d: dare_drop(d, cfg.density, cfg.rescale, gen), elect=True)


@register("breadcrumbs", BreadcrumbsConfig, _validate_breadcrumbs)
def breadcrumbs(base: torch.Tensor, experts: list[torch.Tensor], cfg: BreadcrumbsConfig,
                gen: torch.Generator) -> torch.Tensor:
    """Model Breadcrumbs (Davari & Belilovsky, 2023).

    s_i    = breadcrumbs_mask(d_i)   drop the floor(gamma*n) largest |d_i|, keep the next ceil(density*n)
    merged = b + lambda * sum_i w_i * s_i
    """
    return _combine(base, experts, cfg, lambda d: breadcrumbs_mask(d, cfg.density, cfg.gamma), elect=False)


@register("breadcrumbs_ties", BreadcrumbsTiesConfig, _validate_breadcrumbs)
def breadcrumbs_ties(base: torch.Tensor, experts: list[torch.Tensor], cfg: BreadcrumbsTiesConfig,
                     gen: torch.Generator) -> torch.Tensor:
    """Model Breadcrumbs with TIES' election (mergekit's breadcrumbs_ties).

    s_i    = breadcrumbs_mask(d_i)
    merged = b + lambda * disjoint_mean(s_1..s_N)
    gamma = 0 is ties with the same density.
    """
    return _combine(base, experts, cfg, lambda d: breadcrumbs_mask(d, cfg.density, cfg.gamma), elect=True)


@register("della_linear", DellaLinearConfig, _validate_della)
def della_linear(base: torch.Tensor, experts: list[torch.Tensor], cfg: DellaLinearConfig,
                 gen: torch.Generator) -> torch.Tensor:
    """DELLA's MAGPRUNE + task arithmetic (Deep et al., 2024; mergekit's della_linear).

    p      = density - epsilon + 2 * epsilon * rank(|d_i|) / (n - 1)   per entry, within the tensor or row
    s_i    = Bernoulli(p) * d_i / p   (or L1-matched)
    merged = b + lambda * sum_i w_i * s_i
    """
    return _combine(base, experts, cfg,
                    lambda d: della_magprune(d, cfg.density, cfg.epsilon, cfg.rescale, gen, cfg.rank_scope),
                    elect=False)


@register("della", DellaConfig, _validate_della)
def della(base: torch.Tensor, experts: list[torch.Tensor], cfg: DellaConfig, gen: torch.Generator) -> torch.Tensor:
    """DELLA-Merging (Deep et al., 2024): MAGPRUNE, TIES' election, disjoint mean, scale.

    p      = density - epsilon + 2 * epsilon * rank(|d_i|) / (n - 1)   per entry, within the tensor or row
    s_i    = Bernoulli(p) * d_i / p   (or L1-matched)
    merged = b + lambda * disjoint_mean(s_1..s_N)
    epsilon = 0 is dare_ties.
    """
    return _combine(base, experts, cfg,
                    lambda d: della_magprune(d, cfg.density, cfg.epsilon, cfg.rescale, gen, cfg.rank_scope),
                    elect=True)


@register("sce", SceConfig, _validate_sce)
def sce(base: torch.Tensor, experts: list[torch.Tensor], cfg: SceConfig, gen: torch.Generator) -> torch.Tensor:
    """SCE (FuseChat, Wan et al., 2024; mergekit's sce): Select, Calculate, Erase.

    Select:    M = the k = max(1, ceil(select_topk * n)) entries with the largest variance of
               (d_1..d_N) across experts (population variance; ties by position); s_i = M * d_i
    Calculate: w_i = mean(s_i^2) / sum_j mean(s_j^2)     (mean over the tensor's entries)
               w_i = 1/N when sum_j mean(s_j^2) is 0 or below uniform_below (default 0; mergekit
               uses 1e-6, which covers every tensor of a lightly fine-tuned model: deltas of rms
               ~5e-4, as the quickstart experts', have mean squares ~2e-7)
    Erase:     gamma = sign(sum_i s_i); A_i = [sign(s_i) == gamma] and s_i != 0
    merged = b + lambda * sum_i w_i A_i s_i                           normalize=false (the formula above)
    merged = b + lambda * sum_i w_i A_i s_i / sum_i w_i A_i           normalize=true (mergekit)
    """
    b = base.float()
    deltas = torch.stack([e.float() - b for e in experts])
    ordered = deltas.sort(0).values  # per-entry sorted: variance and sign votes independent of expert order
    if cfg.select_topk < 1.0:
        n = b.numel()
        k = kept_count(cfg.select_topk, n)
        variance = ordered.var(0, unbiased=False).flatten()
        top = torch.sort(variance, descending=True, stable=True).indices[:k]
        keep = torch.zeros(n, dtype=torch.bool, device=b.device)
        keep[top] = True
        keep = keep.view_as(b)
        deltas = deltas * keep
        ordered = ordered * keep
    energy = [float(d.double().square().mean()) for d in deltas]
    total = sum(sorted(energy))
    uniform = total == 0 or total < cfg.uniform_below
    w = [1.0 / len(energy)] * len(energy) if uniform else [x / total for x in energy]
    wt = torch.tensor(w, dtype=torch.float32, device=b.device).view(-1, *([1] * b.dim()))
    gamma = torch.sign(ordered.sum(0))
    agree = (torch.sign(deltas) == gamma) & (deltas != 0)
    tau = (wt * deltas * agree).sum(0)
    if cfg.normalize:
        mass = (wt * agree).sum(0)
        tau = tau / mass.where(mass != 0, torch.ones_like(mass))
    return (b + cfg.lambda_ * tau).to(base.dtype)
