"""Mask-based merges: Consensus task arithmetic (TALL masks), Localize-and-Stitch, RAM / RAM+ and Arcee Fusion.

Every method here decides, entry by entry, which task-vector entries to keep
(a mask), then adds the kept ones to the base: Consensus TA keeps the entries
of the summed task vector that enough TALL masks claim, Localize-and-Stitch
each expert's largest entries, RAM (mergekit's ``ram``, ``ramplus_tl``) each
expert's non-zero entries (both average where experts' masks overlap), and
Arcee Fusion (mergekit's ``arcee_fusion``, one expert) its entries of outlying
importance. So a method that keeps or drops task-vector entries by a rule
belongs here; one that rescales or interpolates every entry belongs in
``task_vector.py``, ``sparsify.py`` (random or ranked sparsifiers before a
sum or TIES' election) or ``geometric.py``.

Notation, per tensor: base ``b``, expert ``e_t`` (t = 1..N), task vector
``tau_t = e_t - b``. Arithmetic in float32, the result cast back to the
base's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mergeval.core.errors import UserError
from mergeval.methods import compat
from mergeval.methods.draws import Draws
from mergeval.methods.registry import Mergekit, Needs, register, register_layer
from mergeval.methods.select import kth_smallest
from mergeval.methods.task_vector import sum_in_order


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
        raise UserError(
            "method.tall_lambda",
            f"must be a non-negative number, got {cfg.tall_lambda}",
            "set e.g. method.tall_lambda=0.2",
        )
    if not (isinstance(cfg.k, int) and 1 <= cfg.k <= n_experts):
        raise UserError(
            "method.k",
            f"must be between 1 and the number of experts ({n_experts}), got {cfg.k}",
            f"set e.g. method.k={min(2, n_experts)}",
        )


def _validate_stitch(cfg: LocalizeStitchConfig, n_experts: int) -> None:
    if not (math.isfinite(cfg.sparsity) and 0 < cfg.sparsity <= 1):
        raise UserError("method.sparsity", f"must be in (0, 1], got {cfg.sparsity}", "set e.g. method.sparsity=0.1")
    if cfg.scope not in ("model", "tensor"):
        raise UserError("method.scope", f"unknown scope {cfg.scope!r}", "set method.scope=model or tensor")
    if cfg.thresholds is not None and len(cfg.thresholds) != n_experts:
        raise UserError(
            "method.thresholds",
            f"{len(cfg.thresholds)} thresholds for {n_experts} experts",
            "leave method.thresholds null: they are measured from the experts before merging",
        )


def tall_masks(
    deltas: list[torch.Tensor], tall_lambda: float, strict: bool = False, mtl: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """m_t = |tau_t| >= lambda |tau_MTL - tau_t| (``>`` when strict), tau_MTL = sum_t tau_t (``mtl`` if given)."""
    mtl = torch.stack(deltas).sum(0) if mtl is None else mtl
    cmp = torch.gt if strict else torch.ge
    return [cmp(d.abs(), tall_lambda * (mtl - d).abs()) for d in deltas]


@register("consensus_ta", ConsensusConfig, _validate_consensus)
def merge_consensus(base: torch.Tensor, experts: list[torch.Tensor], cfg: ConsensusConfig, gen: Draws) -> torch.Tensor:
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
    mtl = torch.stack(deltas).sum(0)
    votes = torch.stack([m.to(torch.int32) for m in tall_masks(deltas, cfg.tall_lambda, cfg.strict, mtl)]).sum(0)
    return b + cfg.lambda_ * torch.where(votes >= cfg.k, mtl, torch.zeros_like(mtl))


def top_mask(delta: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The ceil(sparsity * n) entries of largest |delta| (ties by position), as a bool mask."""
    n = delta.numel()
    k = min(n, max(1, math.ceil(sparsity * n)))
    order = torch.sort(delta.abs().flatten(), descending=True, stable=True).indices[:k]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[order] = True
    return mask.view(delta.shape)


@register("localize_stitch", LocalizeStitchConfig, _validate_stitch, needs=Needs(magnitude_cuts=True))
def merge_localize_stitch(
    base: torch.Tensor, experts: list[torch.Tensor], cfg: LocalizeStitchConfig, gen: Draws
) -> torch.Tensor:
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
        raise UserError(
            "method.thresholds",
            "scope=model needs each expert's magnitude cut, measured before merging",
            "run through python -m mergeval or mergeval.merge, or set method.scope=tensor",
        )
    else:
        masks = [d.abs() >= c for d, c in zip(deltas, cfg.thresholds)]
    return stitch(b, deltas, masks)


@dataclass
class LocalizeStitchTrainedConfig:
    """Localize-and-Stitch with the mask localized on calibration data (He et al. 2024; MergeBench's
    "Localize-and-Stitch", merging_methods/localize_utils.py: one mask step)."""

    name: str = "localize_stitch_trained"
    sparsity: float = 0.1  # the initial mask: each expert's top share of |tau| over the model (merge.sh: 0.1)
    sigmoid_bias: float = 3.0  # S0 = +bias inside the initial mask, -bias outside (prepare_args.py: 3)
    lr: float = 1.0e8  # step on the mask logits (merge.sh: --lr 1e8, --n_epochs 1)
    thresholds: list[float] | None = None  # each expert's initial cut, measured before merging
    statistics: list[str] | None = None  # each expert's loss gradient at its soft-masked model (calibration data)


def _validate_trained(cfg: LocalizeStitchTrainedConfig, n_experts: int) -> None:
    _validate_stitch(LocalizeStitchConfig(sparsity=cfg.sparsity, thresholds=cfg.thresholds), n_experts)
    for field in ("sigmoid_bias", "lr"):
        value = getattr(cfg, field)
        if not (math.isfinite(value) and value > 0):
            raise UserError(
                f"method.{field}",
                f"must be a positive number, got {value}",
                f"set e.g. method.{field}={LocalizeStitchTrainedConfig.__dataclass_fields__[field].default}",
            )
    if cfg.statistics is not None and len(cfg.statistics) != n_experts:
        raise UserError(
            "method.statistics",
            f"{len(cfg.statistics)} statistics directories for {n_experts} experts",
            "leave method.statistics null: it is filled from modelset.experts.<name>.calibration",
        )


def trained_mask(delta: torch.Tensor, grad: torch.Tensor, cut: float, bias: float, lr: float) -> torch.Tensor:
    """m = S1 > 0, S1 = S0 - lr sigmoid'(S0) (g * tau), S0 = +bias where |tau| >= cut else -bias."""
    s0 = torch.where(delta.abs() >= cut, bias, -bias).to(torch.float64)
    slope = torch.sigmoid(torch.tensor(bias, dtype=torch.float64)) * torch.sigmoid(
        torch.tensor(-bias, dtype=torch.float64)
    )
    return s0 - lr * slope * (grad.double() * delta.double()) > 0


def stitch(base: torch.Tensor, deltas: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """b + sum_t (m_t / max(1, sum_j m_j)) * tau_t."""
    count = torch.stack([m.to(torch.float32) for m in masks]).sum(0).clamp(min=1)
    return base + sum(m * d for m, d in zip(masks, deltas)) / count


@register_layer(
    "localize_stitch_trained",
    LocalizeStitchTrainedConfig,
    _validate_trained,
    needs=Needs(statistics="localize", magnitude_cuts=True),
)
def merge_localize_stitch_trained(
    base: dict[str, torch.Tensor],
    experts: list[dict[str, torch.Tensor]],
    cfg: LocalizeStitchTrainedConfig,
    gen: Draws,
) -> dict[str, torch.Tensor]:
    """Localize-and-Stitch, data-driven: ``b + sum_t (m_t / max(1, sum_j m_j)) * tau_t`` with trained masks.

    Localize: the mask logits start at ``S0 = +bias`` on expert t's top
    ``sparsity`` share of ``|tau_t|`` over the model (as ``localize_stitch``) and
    ``-bias`` elsewhere; one gradient step on the loss of the soft-masked model
    ``b + sigmoid(S) * tau_t`` over t's calibration data gives
    ``S1 = S0 - lr * sigmoid'(S0) * (g_t * tau_t)``, ``g_t = sum_x grad L_x`` at
    ``S0`` (one forward and backward pass per example; ``L_x`` the mean
    answer-token cross-entropy), and ``m_t = 1{S1 > 0}`` (``round(sigmoid(S1))``).
    This is MergeBench's one-epoch procedure (lr 1e8, bias 3) with the gradient
    taken at the fixed starting point (MergeBench's also trains the model
    while accumulating it) and without its L1 term (0 by default there).
    Stitch: overlapping regions averaged.
    """
    from mergeval.methods.statistics import read_stat

    if cfg.statistics is None or cfg.thresholds is None:
        raise UserError(
            "method.statistics",
            "localize_stitch_trained needs each expert's calibration gradient",
            "set modelset.experts.<name>.calibration for every expert (filled in before merging)",
        )
    out = {}
    for name, b in base.items():
        b = b.float()
        deltas = [e[name].float() - b for e in experts]
        masks = []
        for i, d in enumerate(deltas):
            g = read_stat(cfg.statistics[i], name)
            if g is None or g.shape != d.shape:
                raise UserError(
                    "method.statistics",
                    f"expert {i}'s gradient lacks tensor {name} ({cfg.statistics[i]})",
                    "recompute it: remove that directory",
                )
            masks.append(trained_mask(d, g, cfg.thresholds[i], cfg.sigmoid_bias, cfg.lr))
        out[name] = stitch(b, deltas, masks)
    return out


# ---------------------------------------------------------------- RAM, RAM+ and Arcee Fusion (mergekit's own)


@dataclass
class RamConfig:
    """Reinforced Agent Merging (mergekit's ``ram``, arXiv:2601.13572)."""

    name: str = "ram"
    epsilon: float = 1e-5  # |tau_t| above this counts as an entry expert t changed (mergekit's default)
    compat: str = "paper"  # both modes are the same: the method is mergekit's


@dataclass
class RamPlusConfig:
    """RAM+, tensor-local (mergekit's ``ramplus_tl``): RAM with each expert's unique entries scaled up."""

    name: str = "ramplus_tl"
    r: float = 0.1  # lambda_t = 1 + r * clamp(rho_t, 0, alpha) (mergekit's default)
    alpha: float = 0.2  # the cap on rho_t (mergekit's default)
    epsilon: float = 1e-5  # as ram's, and the floor of rho_t's divisor (mergekit's)
    compat: str = "paper"  # both modes are the same: the method is mergekit's


@dataclass
class ArceeFusionConfig:
    """Arcee Fusion (mergekit's ``arcee_fusion``): the base takes the one expert's entries of outlying importance."""

    name: str = "arcee_fusion"
    compat: str = "paper"  # both modes are the same: the method is mergekit's


def _check_number(value: float, field: str, example: float, minimum: float | None = None) -> None:
    if not (math.isfinite(value) and (minimum is None or value >= minimum)):
        need = "a finite number" + ("" if minimum is None else f" of {minimum:g} or more")
        raise UserError(f"method.{field}", f"must be {need}, got {value}", f"set e.g. method.{field}={example:g}")


def _validate_ram(cfg: RamConfig | RamPlusConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    _check_number(cfg.epsilon, "epsilon", 1e-5, minimum=0.0)


def _validate_ramplus(cfg: RamPlusConfig, n_experts: int) -> None:
    _validate_ram(cfg, n_experts)
    _check_number(cfg.r, "r", 0.1)
    _check_number(cfg.alpha, "alpha", 0.2, minimum=0.0)


def _validate_arcee_fusion(cfg: ArceeFusionConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    if n_experts != 1:
        raise UserError(
            "modelset.experts",
            f"arcee_fusion fuses exactly one expert into the base, got {n_experts}",
            "list exactly one expert in the modelset",
        )


def changed_entries(
    base: torch.Tensor, experts: list[torch.Tensor], epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, z, a, c) for RAM: the base in float32; z_t = a_t tau_t, the task vectors as rows of an (N, n) matrix
    with the entries of |tau_t| <= epsilon set to 0; a_t = [|tau_t| > epsilon]; c = sum_t a_t per entry (int64)."""
    b = base.float()
    z = torch.stack([e.float() - b for e in experts]).reshape(len(experts), -1)
    a = z.abs() > epsilon
    z.masked_fill_(~a, 0.0)
    return b, z, a, a.sum(0)


def ram_sum(b: torch.Tensor, z: torch.Tensor, c: torch.Tensor, boost: torch.Tensor | None = None) -> torch.Tensor:
    """b + sum_t z_t s_t, s_t = 1 / max(1, c) (RAM), or boost_t where c == 1 (RAM+); the N terms summed in
    expert order (``sum_in_order``). z is consumed."""
    terms = z.div_(c.clamp(min=1))  # where c == 1: z / 1, exactly z
    if boost is not None:
        terms.mul_(torch.where(c == 1, boost[:, None], 1.0))  # x * 1.0 == x exactly
    return b + sum_in_order(terms).view_as(b)


@register("ram", RamConfig, _validate_ram, mergekit=Mergekit("ram", own=True))
def ram(base: torch.Tensor, experts: list[torch.Tensor], cfg: RamConfig, gen: Draws) -> torch.Tensor:
    """RAM (mergekit's ``ram``): each entry takes the mean change of the experts that changed it.

        a_t    = [|tau_t| > epsilon]                  the entries expert t changed
        c      = sum_t a_t                            how many experts changed each entry
        merged = b + sum_t a_t tau_t / max(1, c)

    An entry only one expert changed gets that expert's whole change (as in task arithmetic), one several
    changed the mean of their changes (the experts that left it alone do not dilute it), one none changed
    (every |tau_t| <= epsilon) stays the base's. In float32, each expert's quotient summed in expert order:
    the same tensors as mergekit 0.1.5 (whose sum over 5 or more experts follows torch's CPU kernels instead).
    """
    b, z, _, c = changed_entries(base, experts, float(cfg.epsilon))
    return ram_sum(b, z, c).to(base.dtype)


@register("ramplus_tl", RamPlusConfig, _validate_ramplus, mergekit=Mergekit("ramplus_tl", own=True))
def ramplus_tl(base: torch.Tensor, experts: list[torch.Tensor], cfg: RamPlusConfig, gen: Draws) -> torch.Tensor:
    """RAM+, tensor-local (mergekit's ``ramplus_tl``): RAM, with the entries only expert t changed scaled by
    lambda_t >= 1, more for an expert that shares more of its changes with others.

        a_t, c                                       as in ram
        u_t      = #{a_t and c == 1}                 expert t's unique entries in this tensor
        s_t      = #{a_t and c > 1}                  its shared entries in this tensor
        rho_t    = s_t / max(u_t, epsilon)           (0 where s_t = 0)
        lambda_t = 1 + r clamp(rho_t, 0, alpha)
        merged   = b + sum_t a_t tau_t (lambda_t where c == 1, else 1 / max(1, c))

    Tensor-local: u_t and s_t count this tensor's entries only. r = 0 gives ram exactly. In float32 as
    ram: the same tensors as mergekit 0.1.5, except where mergekit's are NaN: with epsilon = 0, an expert
    equal to the base on the whole tensor has rho = 0 / 0 there, which makes mergekit's whole tensor NaN;
    here that expert's rho is 0 (it has no unique entry for lambda to scale).
    """
    b, z, a, c = changed_entries(base, experts, float(cfg.epsilon))
    shared, unique = (a & (c > 1)).sum(1), (a & (c == 1)).sum(1)
    rho = torch.where(shared == 0, 0.0, shared / unique.clamp(min=float(cfg.epsilon)))
    boost = 1 + float(cfg.r) * rho.clamp(min=0, max=float(cfg.alpha))
    return ram_sum(b, z, c, boost).to(base.dtype)


FUSION_EPS = 1e-8  # added to both softmaxes before their log ratio (mergekit's)


def fusion_importance(b: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """I = |e - b| * kl, kl = sum_j p_j log(p_j / q_j) along the last dimension (one per row), with
    p = softmax(e) + 1e-8 and q = softmax(b) + 1e-8."""
    p = F.softmax(e, dim=-1).add_(FUSION_EPS)
    q = F.softmax(b, dim=-1).add_(FUSION_EPS)
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    return (e - b).abs_().mul_(kl)


def upper_fence(x: torch.Tensor) -> torch.Tensor:
    """median + 1.5 (Q3 - Q1) of all the entries of x, in float32; Q_j = the (floor(j (n - 1) / 4) + 1)-th
    smallest of the n entries (Q_2 the median)."""
    n = x.numel()
    q1, median, q3 = torch.tensor([kth_smallest(x, j * (n - 1) // 4 + 1) for j in (1, 2, 3)], dtype=torch.float32)
    return median + 1.5 * (q3 - q1)


@register(
    "arcee_fusion",
    ArceeFusionConfig,
    _validate_arcee_fusion,
    mergekit=Mergekit("arcee_fusion", own=True, base="listed"),
)
def arcee_fusion(base: torch.Tensor, experts: list[torch.Tensor], cfg: ArceeFusionConfig, gen: Draws) -> torch.Tensor:
    """Arcee Fusion (mergekit's ``arcee_fusion``): the base takes the one expert's entries whose importance is
    an upper outlier of the tensor's, and keeps its own elsewhere.

        I      = |e - b| * KL(softmax(e) + 1e-8 || softmax(b) + 1e-8)     the KL along the last dimension (per row)
        theta  = median(I) + 1.5 (Q3(I) - Q1(I))                           over the whole tensor
        merged = b + [I >= theta] (e - b)

    An entry matters when it changed much in a row whose output distribution (the softmax of the row) changed
    much. A tensor whose importances are all equal (the expert equal to the base: I = 0) keeps all of the
    expert's entries, so the base's own tensor comes back. Quartiles: Q_j is the (floor(j (n - 1) / 4) + 1)-th
    smallest of the n importances. In float32: the same tensors as mergekit 0.1.5 up to 10^6 entries a
    tensor; above that, mergekit takes the quartiles from 10^6 entries drawn at random (unseeded, so its
    mask varies from run to run), mergeval from every entry, so the two masks differ only near theta.
    """
    (expert,) = experts
    b, e = base.float(), expert.float()
    importance = fusion_importance(b, e)
    return (b + (e - b) * (importance >= upper_fence(importance))).to(base.dtype)
