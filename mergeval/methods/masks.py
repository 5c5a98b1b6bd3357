"""Mask-based merges: Consensus task arithmetic (TALL masks) and Localize-and-Stitch (data-free).

Notation, per tensor: base ``b``, expert ``e_t`` (t = 1..N), task vector
``tau_t = e_t - b``. Arithmetic in float32, the result cast back to the
base's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergeval.errors import UserError
from mergeval.methods.registry import register


@dataclass
class ConsensusConfig:
    """Consensus task arithmetic (Wang et al., ICML 2024, "Localizing Task Information for Improved Model
    Merging and Compression"; the consensus merging of its Sec. 'Consensus Merging')."""

    name: str = "consensus_ta"
    lambda_: float = 1.0  # scale of the masked multi-task vector (as task_arithmetic's; MergeBench: 0.4)
    k: int = 2  # keep entries where at least k tasks' TALL masks agree (the paper's consensus, k = 2)
    # lambda_t of every task's TALL mask; the paper picks it per task on validation data, MergeBench
    # (merging_methods/consensus.py) fixes it at 0.2 for every task.
    tall_lambda: float = 0.2
    strict: bool = False  # false: |tau_t| >= lambda_t |...| (the paper); true: > (MergeBench's consensus.py)


@dataclass
class LocalizeStitchConfig:
    """Localize-and-Stitch, data-free variant (He, Hu, Lin, Zhang, Zhao 2024, "Localize-and-Stitch: Efficient
    Model Merging via Sparse Task Arithmetic"; MergeBench's "Dataless Localize-and-Stitch")."""

    name: str = "localize_stitch"
    # share of each task vector's entries kept (largest |tau_t|). 0.1 is uiuctml/MergeBench scripts/merge.sh's
    # "Dataless Localize-and-Stitch --sparsity 0.1" (and prepare_args.py's default).
    sparsity: float = 0.1
    # model: the top share of the expert's whole task vector (the paper, MergeBench); tensor: of each tensor
    scope: str = "model"
    # scope=model: each expert's cut on |tau_t| (the k-th largest over the model), filled in before merging
    thresholds: list[float] | None = None


def _validate_consensus(cfg: ConsensusConfig, n_experts: int) -> None:
    if not math.isfinite(cfg.lambda_):
        raise UserError("method.lambda_", f"must be a finite number, got {cfg.lambda_}", "set e.g. method.lambda_=1.0")
    if not (math.isfinite(cfg.tall_lambda) and cfg.tall_lambda >= 0):
        raise UserError("method.tall_lambda", f"must be a non-negative number, got {cfg.tall_lambda}",
                        "set e.g. method.tall_lambda=0.2")
    if not (isinstance(cfg.k, int) and 1 <= cfg.k <= n_experts):
        raise UserError("method.k", f"must be between 1 and the number of experts ({n_experts}), got {cfg.k}",
                        f"set e.g. method.k={min(2, n_experts)}")


def _validate_stitch(cfg: LocalizeStitchConfig, n_experts: int) -> None:
    if not (math.isfinite(cfg.sparsity) and 0 < cfg.sparsity <= 1):
        raise UserError("method.sparsity", f"must be in (0, 1], got {cfg.sparsity}", "set e.g. method.sparsity=0.1")
    if cfg.scope not in ("model", "tensor"):
        raise UserError("method.scope", f"unknown scope {cfg.scope!r}", "set method.scope=model or tensor")
    if cfg.thresholds is not None and len(cfg.thresholds) != n_experts:
        raise UserError("method.thresholds", f"{len(cfg.thresholds)} thresholds for {n_experts} experts",
                        "leave method.thresholds null: they are measured from the experts before merging")


def tall_masks(deltas: list[torch.Tensor], tall_lambda: float, strict: bool = False) -> list[torch.Tensor]:
    """m_t = |tau_t| >= lambda |tau_MTL - tau_t| (``>`` when strict), tau_MTL = sum_t tau_t."""
    mtl = torch.stack(deltas).sum(0)
    cmp = torch.gt if strict else torch.ge
    return [cmp(d.abs(), tall_lambda * (mtl - d).abs()) for d in deltas]


@register("consensus_ta", ConsensusConfig, _validate_consensus)
def merge_consensus(base: torch.Tensor, experts: list[torch.Tensor], cfg: ConsensusConfig,
                    gen: torch.Generator) -> torch.Tensor:
    """Consensus TA: ``b + lambda * (sum_t m_t >= k) * tau_MTL``.

    TALL mask of task t (the paper's definition): ``m_t = 1{|tau_t| >= lambda_t
    |tau_MTL - tau_t|}`` with ``tau_MTL = sum_t tau_t`` (task arithmetic's
    multi-task vector) and ``lambda_t = tall_lambda``; the consensus mask keeps
    the entries at least ``k`` tasks' masks claim (k = 2 drops 'selfish'
    weights only one task uses and 'catastrophic' ones no task uses). With
    ``k = 1`` and one expert it is task arithmetic.
    """
    b = base.float()
    deltas = [e.float() - b for e in experts]
    votes = torch.stack([m.to(torch.int32) for m in tall_masks(deltas, cfg.tall_lambda, cfg.strict)]).sum(0)
    mtl = torch.stack(deltas).sum(0)
    return b + cfg.lambda_ * torch.where(votes >= cfg.k, mtl, torch.zeros_like(mtl))


def top_mask(delta: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The ceil(sparsity * n) entries of largest |delta| (ties by position), as a bool mask."""
    n = delta.numel()
    k = min(n, max(1, math.ceil(sparsity * n)))
    order = torch.sort(delta.abs().flatten(), descending=True, stable=True).indices[:k]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[order] = True
    return mask.view(delta.shape)


@register("localize_stitch", LocalizeStitchConfig, _validate_stitch)
def merge_localize_stitch(base: torch.Tensor, experts: list[torch.Tensor], cfg: LocalizeStitchConfig,
                          gen: torch.Generator) -> torch.Tensor:
    """Localize-and-Stitch, data-free: ``b + sum_t (m_t / max(1, sum_j m_j)) * tau_t``.

    Localize: ``m_t`` keeps the top ``sparsity`` share of ``|tau_t|`` (the paper's
    dataless variant). ``scope=model`` (default, as the paper and MergeBench):
    ``m_t = |tau_t| >= c_t`` with ``c_t`` the ceil(sparsity * n)-th largest
    ``|tau_t|`` entry over all n entries of the model's tensors (``thresholds``,
    measured before merging; ties at the cut are kept, as MergeBench's
    ``>= threshold``); ``scope=tensor``: the ceil(sparsity * n) largest entries
    of each tensor (ties by position). Stitch: where several masks overlap, their task vectors are
    averaged; elsewhere each region takes its own expert's delta. The
    data-driven localization (a mask trained on calibration data) is not
    implemented. ``sparsity = 1``: the mean task vector, ``b + mean_t tau_t``.
    """
    b = base.float()
    deltas = [e.float() - b for e in experts]
    if cfg.scope == "tensor":
        masks = [top_mask(d, cfg.sparsity) for d in deltas]
    elif cfg.thresholds is None:
        raise UserError("method.thresholds", "scope=model needs each expert's magnitude cut, measured before merging",
                        "run through python -m mergeval or mergeval.merge, or set method.scope=tensor")
    else:
        masks = [d.abs() >= c for d, c in zip(deltas, cfg.thresholds)]
    count = torch.stack([m.to(torch.float32) for m in masks]).sum(0).clamp(min=1)
    return b + sum(m * d for m, d in zip(masks, deltas)) / count
