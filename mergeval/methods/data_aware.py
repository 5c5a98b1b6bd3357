"""Data-aware merges: Fisher merging and RegMean, from each expert's calibration statistics.

Both need statistics computed from each expert's own calibration data
(``modelset.experts.<name>.calibration``; ``mergeval/merge/expert_statistics.py``). Before
merging, ``ranking.prepare_method`` fills ``statistics`` with one cached
directory per expert (modelset order); the merge reads one tensor's
statistics at a time from there. A run whose experts lack calibration data is
refused with one line before any model is built.

Notation, per tensor: expert ``e_i`` (i = 1..N), its statistics ``F_i`` or
``G_i``. Arithmetic in float64, the result cast back to the base's dtype. The
base's parameters take no part (as in both papers, the merge is of the
experts' parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergeval.core.errors import UserError
from mergeval.methods.draws import Draws
from mergeval.methods.registry import Needs, register_layer


@dataclass
class FisherConfig:
    """Fisher merging (Matena & Raffel 2022, "Merging Models with Fisher-Weighted Averaging")."""

    name: str = "fisher"
    # added to every expert's Fisher before weighting: entries where every F_i is 0 become the plain average.
    # 1e-10 is uiuctml/MergeBench merging/merging_methods/fisher.py's ("torch.stack(fisher_list) + 1.0e-10").
    epsilon: float = 1.0e-10
    statistics: list[str] | None = None  # filled from the modelset's calibration data (one directory per expert)


@dataclass
class RegMeanConfig:
    """RegMean (Jin et al., ICLR 2023, "Dataless Knowledge Fusion by Merging Weights of Language Models")."""

    name: str = "regmean"
    # off-diagonal shrinkage G <- alpha G + (1 - alpha) diag(G); 1 = no shrinkage, 0 = diagonal only.
    # 0.5 is uiuctml/MergeBench scripts/merge.sh's RegMean (--reduction 0.5; regmean_utils.reduce_non_diag).
    alpha: float = 0.5
    statistics: list[str] | None = None  # filled from the modelset's calibration data (one directory per expert)


def _check_statistics(cfg, n_experts: int) -> None:
    if cfg.statistics is not None and len(cfg.statistics) != n_experts:
        raise UserError(
            "method.statistics",
            f"{len(cfg.statistics)} statistics directories for {n_experts} experts",
            "leave method.statistics null: it is filled from modelset.experts.<name>.calibration",
        )


def _validate_fisher(cfg: FisherConfig, n_experts: int) -> None:
    if not (math.isfinite(cfg.epsilon) and cfg.epsilon > 0):
        raise UserError(
            "method.epsilon", f"must be a positive number, got {cfg.epsilon}", "set e.g. method.epsilon=1e-10"
        )
    _check_statistics(cfg, n_experts)


def _validate_regmean(cfg: RegMeanConfig, n_experts: int) -> None:
    if not (math.isfinite(cfg.alpha) and 0 <= cfg.alpha <= 1):
        raise UserError("method.alpha", f"must be in [0, 1], got {cfg.alpha}", "set e.g. method.alpha=0.5")
    _check_statistics(cfg, n_experts)


def _stats(cfg, name: str, method: str) -> list[tuple[str, torch.Tensor | None]]:
    """Each expert's statistics directory and its statistic for tensor ``name`` (None where it has none)."""
    from mergeval.methods.statistics import read_stat

    if cfg.statistics is None:
        raise UserError(
            "method.statistics",
            f"{method} needs each expert's calibration statistics",
            "set modelset.experts.<name>.calibration for every expert (filled in before merging)",
        )
    return [(d, read_stat(d, name)) for d in cfg.statistics]


def fisher_merge(experts: list[torch.Tensor], fishers: list[torch.Tensor], epsilon: float) -> torch.Tensor:
    """theta = sum_i (F_i + eps) theta_i / sum_i (F_i + eps), entry by entry (float64)."""
    num = torch.zeros(experts[0].shape, dtype=torch.float64)
    den = torch.zeros_like(num)
    for e, f in zip(experts, fishers):
        w = f.double() + epsilon
        num += w * e.double()
        den += w
    return num / den


@register_layer("fisher", FisherConfig, _validate_fisher, needs=Needs(statistics="fisher"))
def merge_fisher(
    base: dict[str, torch.Tensor], experts: list[dict[str, torch.Tensor]], cfg: FisherConfig, gen: Draws
) -> dict[str, torch.Tensor]:
    """Fisher merging: ``theta = sum_i (F_i + eps) theta_i / sum_i (F_i + eps)`` per parameter entry.

    ``F_i`` is expert i's diagonal empirical Fisher on its own calibration data,
    ``F_i = (1/n) sum_x (grad log p(y_x | x; theta_i))^2`` (one backward pass per
    example), and ``eps`` (``epsilon``, default 1e-10 as MergeBench) a floor so
    entries where every expert's Fisher is 0 get the plain average. Equal
    Fisher gives the plain average; one expert gives that expert. Every
    parameter is Fisher-weighted (MergeBench keeps the base's embeddings
    instead; mergeval follows the paper).
    """
    out = {}
    for name in base:
        fishers = []
        for i, (directory, f) in enumerate(_stats(cfg, name, "fisher")):
            if f is None or f.shape != experts[i][name].shape:
                raise UserError(
                    "method.statistics",
                    f"expert {i}'s Fisher statistics lack tensor {name} ({directory})",
                    "recompute them: remove that directory",
                )
            fishers.append(f)
        out[name] = fisher_merge([e[name] for e in experts], fishers, cfg.epsilon)
    return out


def shrink(g: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha G + (1 - alpha) diag(G)."""
    return alpha * g + (1 - alpha) * torch.diag(torch.diagonal(g))


def regmean_linear(weights: list[torch.Tensor], grams: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """W = (sum_i G~_i)^-1 sum_i G~_i W_i^T, transposed back (W_i: out x in, G_i: in x in), in float64.

    Input dimensions no expert ever saw (zero rows of every G_i) are undetermined by the least-squares
    problem: they get the plain average of the W_i's columns. A singular system falls back to the
    pseudo-inverse.
    """
    total = torch.zeros(grams[0].shape, dtype=torch.float64)
    rhs = torch.zeros((weights[0].shape[1], weights[0].shape[0]), dtype=torch.float64)
    for w, g in zip(weights, grams):
        gs = shrink(g.double(), alpha)
        total += gs
        rhs += gs @ w.double().T
    unseen = torch.diagonal(total) == 0
    if unseen.any():
        idx = unseen.nonzero().flatten()
        total[idx, idx] = 1.0
        rhs[idx] = torch.stack([w.double().T[idx] for w in weights]).mean(0)
    solved, info = torch.linalg.solve_ex(total, rhs)
    if info.item() != 0 or not torch.isfinite(solved).all():
        solved = torch.linalg.pinv(total, hermitian=True) @ rhs
    return solved.T


@register_layer("regmean", RegMeanConfig, _validate_regmean, needs=Needs(statistics="gram"))
def merge_regmean(
    base: dict[str, torch.Tensor], experts: list[dict[str, torch.Tensor]], cfg: RegMeanConfig, gen: Draws
) -> dict[str, torch.Tensor]:
    """RegMean: per linear layer ``W = (sum_i G~_i)^-1 sum_i G~_i W_i`` (in ``x W^T`` form), else the average.

    ``G_i = X_i^T X_i / T_i`` is the Gram matrix of the layer's inputs on expert i's
    calibration data (one forward pass per example), ``G~_i = alpha G_i + (1 -
    alpha) diag(G_i)`` shrinks its off-diagonal entries (``alpha``, default 0.5
    as MergeBench's merge.sh; the paper tunes it). This W minimises
    ``sum_i ||X_i W^T - X_i W_i^T||^2`` (with the shrunk Grams). Biases, norms,
    embeddings and lm_head (no Gram matrix) are averaged, as in the paper and
    MergeBench. One expert gives that expert; identical Gram matrices give
    the average.
    """
    out = {}
    for name in base:
        ws = [e[name] for e in experts]
        stats = _stats(cfg, name, "regmean") if ws[0].dim() == 2 else []
        if all(g is None for _, g in stats):
            out[name] = torch.stack([w.double() for w in ws]).mean(0)
            continue
        grams = []
        for i, (directory, g) in enumerate(stats):
            if g is None or g.shape != (ws[0].shape[1],) * 2:
                raise UserError(
                    "method.statistics",
                    f"expert {i}'s Gram matrix for {name} is "
                    f"{'missing' if g is None else list(g.shape)}, expected {[ws[0].shape[1]] * 2} ({directory})",
                    "recompute it: remove that directory",
                )
            grams.append(g)
        out[name] = regmean_linear(ws, grams, cfg.alpha)
    return out
