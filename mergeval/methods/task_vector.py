"""Linear averaging and the task-vector family (task arithmetic, TIES).

Notation, per tensor: ``b`` the base, ``e_i`` expert i (i = 1..N),
``d_i = e_i - b`` its task vector, ``w_i`` its weight (default 1; ``weights``,
or expert i's own ``per_expert[i].weight``), ``lambda`` the scale of the merged
task vector. Arithmetic runs in float32 and the result is cast back to the
base's dtype. ``compat=mergekit`` switches a method to mergekit 0.1.5's
semantics (``mergeval/methods/compat.py``; the README's table lists every
difference).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch

from mergeval.core.errors import UserError
from mergeval.methods import compat
from mergeval.methods.compat import expert_value, expert_weights, match_l1
from mergeval.methods.draws import Draws
from mergeval.methods.registry import Mergekit, register
from mergeval.methods.select import first_k_mask


@dataclass
class LinearConfig:
    name: str = "linear"
    weights: list[float] | None = None
    normalize: bool = True
    include_base: bool = False
    compat: str = "paper"  # no difference: mergekit's linear is the same formula


@dataclass
class TaskArithmeticConfig:
    name: str = "task_arithmetic"
    lambda_: float = 1.0
    weights: list[float] | None = None
    normalize: bool = False  # true: divide the weighted sum by sum_i w_i (mergekit's normalize)
    compat: str = "paper"


@dataclass
class TiesConfig:
    name: str = "ties"
    lambda_: float = 1.0
    density: float = 0.5
    weights: list[float] | None = None
    sign_rule: str = "sum"  # "sum": sign of the summed trimmed deltas (paper); "count": majority vote
    weights_before_election: bool | None = None  # null: the mode's (paper false; mergekit true)
    normalize: bool | None = None  # null/true: disjoint mean; false: disjoint sum (mergekit's normalize)
    rescale: str | None = None  # null/none: trimmed deltas as they are; l1: L1-matched (mergekit's rescale)
    compat: str = "paper"  # mergekit: floor(density n) kept, its tie order, + at a zero sum (compat.py)


def _check_weights(weights: list[float] | None, n: int) -> None:
    if weights is None:
        return
    if len(weights) != n:
        raise UserError(
            "method.weights",
            f"{len(weights)} weights for {n} merged models",
            f"give exactly {n} weights or leave method.weights null",
        )
    if not all(math.isfinite(w) for w in weights):
        raise UserError("method.weights", f"non-finite weight in {weights}", "use finite numbers")


def _check_lambda(lam: float) -> None:
    if not math.isfinite(lam):
        raise UserError("method.lambda_", f"must be a finite number, got {lam}", "set e.g. method.lambda_=1.0")


def _validate_linear(cfg: LinearConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    n = n_experts + (1 if cfg.include_base else 0)
    _check_weights(cfg.weights, n)
    if cfg.normalize and cfg.weights is not None and abs(sum(cfg.weights)) < 1e-12:
        raise UserError(
            "method.weights",
            "weights sum to 0 and method.normalize=true",
            "use weights with a non-zero sum or set method.normalize=false",
        )


def _validate_ta(cfg: TaskArithmeticConfig | TiesConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    _check_lambda(cfg.lambda_)
    _check_weights(cfg.weights, n_experts)


def _validate_ties(cfg: TiesConfig, n_experts: int) -> None:
    _validate_ta(cfg, n_experts)  # same lambda_ and weights rules
    if not (0.0 < cfg.density <= 1.0):
        raise UserError("method.density", f"must be in (0, 1], got {cfg.density}", "set e.g. method.density=0.5")
    if cfg.sign_rule not in ("sum", "count"):
        raise UserError("method.sign_rule", f"unknown rule '{cfg.sign_rule}'", "use 'sum' or 'count'")
    check_ties_options(cfg)
    if cfg.rescale not in (None, "none", "l1"):
        raise UserError("method.rescale", f"unknown value '{cfg.rescale}'", "use none or l1")


def check_ties_options(cfg) -> None:
    """The election options of every TIES variant, in either mode (compat.option refuses non-mergekit ones)."""
    compat.option(cfg, "weights_before_election", False, True)
    compat.option(cfg, "normalize", True, True, (True, False))


@register("linear", LinearConfig, _validate_linear, mergekit=Mergekit("linear", same_in_both_modes=True, base="model"))
def linear(base: torch.Tensor, experts: list[torch.Tensor], cfg: LinearConfig, gen: Draws) -> torch.Tensor:
    """Weighted average of the models (a model soup).

    merged = sum_i w_i * e_i / sum_i w_i          (normalize=true, the default)
    merged = sum_i w_i * e_i                      (normalize=false)
    The base joins the average as one more model only when include_base=true.
    """
    models = ([base] if cfg.include_base else []) + experts
    w = expert_weights(cfg, len(models))
    total = cast(torch.Tensor, sum(wi * m.float() for wi, m in zip(w, models)))  # models: at least one
    if cfg.normalize:
        total = total / sum(w)
    return total.to(base.dtype)


@register(
    "task_arithmetic", TaskArithmeticConfig, _validate_ta, mergekit=Mergekit("task_arithmetic", same_in_both_modes=True)
)
def task_arithmetic(
    base: torch.Tensor, experts: list[torch.Tensor], cfg: TaskArithmeticConfig, gen: Draws
) -> torch.Tensor:
    """Task arithmetic (Ilharco et al., 2023).

    merged = b + lambda * sum_i w_i * (e_i - b)                   normalize=false (default)
    merged = b + lambda * sum_i w_i * (e_i - b) / sum_i w_i       normalize=true (|sum w| < 1e-8: no division)
    compat=mergekit: the same formula, in mergekit's order of operations.
    """
    if compat.is_mergekit(cfg):
        return compat.gta(base, experts, cfg, None, False, None, cfg.normalize)
    b = base.float()
    w = expert_weights(cfg, len(experts))
    term = torch.empty_like(b)  # each d_i in turn, in one buffer
    delta = weighted_sum((torch.sub(e.float(), b, out=term) for e in experts), w, b)
    if cfg.normalize and abs(sum(w)) >= 1e-8:
        delta = delta.div_(sum(w))
    return delta.mul_(cfg.lambda_).add_(b).to(base.dtype)  # b + lambda * delta (x + y == y + x exactly)


def weighted_sum(terms: Iterable[torch.Tensor], w: list[float], like: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * t_i, bit for bit as Python's ``sum(w_i * t_i ...)`` (0 + w_1 t_1 + ... in order), accumulated in
    place: one accumulator whatever N, and each t_i with w_i != 1 is scaled in its own storage (it is consumed)."""
    total = torch.zeros_like(like)
    for wi, t in zip(w, terms):
        total.add_(t if wi == 1.0 else t.mul_(wi))  # x * 1.0 == x exactly
    return total


def kept_count(density: float, n: int) -> int:
    """k = ceil(density * n), at least 1; rounded first so float error (0.07 * 100 = 7.000000000000001) adds no entry."""
    return max(1, math.ceil(round(density * n, 9)))


def trim_to_density(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the k = ceil(density * numel) entries of largest magnitude, zero the rest.

    The kept set is {|d| > tau} plus, of the entries with |d| == tau (tau the k-th largest |d|), the
    first ones in row-major order until k are kept: the first k of a stable descending sort of |d|
    (select.first_k_mask; found without sorting, and the same on every machine and in row blocks).
    Before implementation version 2 the ties at a non-zero tau were split in torch.topk's order.
    """
    if density >= 1.0:
        return delta
    k = kept_count(density, delta.numel())
    flat = delta.flatten()
    keep = first_k_mask(flat.abs(), k)
    return torch.where(keep, flat, torch.zeros_like(flat)).view_as(delta)


def mergekit_ties_options(cfg) -> tuple[bool, str, bool]:
    """compat.gta's rescale, sign rule and normalize for a TIES config under compat=mergekit."""
    return cfg.rescale == "l1", cfg.sign_rule, compat.option(cfg, "normalize", True, True, (True, False))


# version 3: sums over 5+ experts in order (sum_in_order); 2: ties at the trim cut kept by position (1: in
# torch.topk's order)
@register("ties", TiesConfig, _validate_ties, version=3, mergekit=Mergekit("ties"))
def ties(base: torch.Tensor, experts: list[torch.Tensor], cfg: TiesConfig, gen: Draws) -> torch.Tensor:
    """TIES-Merging (Yadav et al., 2023): trim, elect sign, disjoint mean.

    t_i     = trim(d_i, density_i)                 keep the ceil(density_i n) largest |d_i| (ties by position)
                                                   (rescale=l1: then t_i * |d_i|_1 / |t_i|_1)
    gamma   = sign(sum_i t_i)                      sign_rule="sum" (the paper: total mass decides)
            = sign(sum_i sign(t_i))                sign_rule="count" (majority of experts)
    A_i     = [sign(t_i) == gamma] and t_i != 0    the experts that agree, entry-wise (none where gamma = 0)
    tau     = sum_i w_i A_i t_i / sum_i w_i A_i    the disjoint (weighted) mean; 0 where no one agrees
            = sum_i w_i A_i t_i                    normalize=false: the disjoint sum
    merged  = b + lambda * tau

    weights_before_election=false (default, faithful to the paper, which has no
    weights): the election sees the unweighted trimmed deltas. true: it sees w_i t_i.
    compat=mergekit: mergekit's ties (compat.py): floor(density n) entries kept (at least 1) in
    torch.argsort's order at equal magnitudes, weights before the election (A_i compares sign(w_i t_i)),
    an exact zero sum elects +, normalize and rescale as mergekit's parameters.
    """
    if compat.is_mergekit(cfg):
        return compat.gta(
            base,
            experts,
            cfg,
            lambda d, i: compat.magnitude(d, expert_value(cfg, "density", i)),
            *mergekit_ties_options(cfg),
        )
    b = base.float()
    trimmed = []
    for i, e in enumerate(experts):
        d = e.float() - b
        t = trim_to_density(d, expert_value(cfg, "density", i))
        trimmed.append(match_l1(d, t) if cfg.rescale == "l1" and t is not d else t)
    return (b + cfg.lambda_ * disjoint_merge(torch.stack(trimmed), cfg)).to(base.dtype)


def disjoint_merge(sparse: torch.Tensor, cfg) -> torch.Tensor:
    """TIES' election and disjoint mean (or sum) over the stacked (N, ...) sparse deltas, paper mode.

    gamma = sign(sum_i s_i) ("sum") or sign(sum_i sign(s_i)) ("count"); s_i times w_i when
    weights_before_election; A_i = [sign(s_i) == gamma] and s_i != 0;
    tau = sum_i w_i A_i s_i / sum_i w_i A_i (0 where no one agrees), or sum_i w_i A_i s_i (normalize=false).
    The "sum" vote adds the experts' values in sorted order, so which expert comes first cannot
    change a rounding-level sign. Every sum over the experts adds them in order from +0.0 (``sum_in_order``).
    """
    w = expert_weights(cfg, sparse.shape[0])
    wt = torch.tensor(w, dtype=torch.float32, device=sparse.device).view(-1, *([1] * (sparse.dim() - 1)))
    unit = all(x == 1.0 for x in w)  # x * 1.0 == x exactly: the products by w are skipped, the bits are the same
    weighted = sparse if unit else wt * sparse
    voters = weighted if compat.option(cfg, "weights_before_election", False, True) else sparse
    if cfg.sign_rule == "sum":
        gamma = sign_of_sum(voters)
    else:
        gamma = torch.sign(torch.sign(voters).sum(0))
    # A_i as 1.0 / 0.0 once (what a product with the bool mask promotes it to), for both sums below.
    # s_i * gamma > 0 is [sign(s_i) == gamma and s_i != 0] in two passes instead of four: gamma is -1, 0 or +1,
    # so the product is exact, and it is positive exactly when both are non-zero with the same sign.
    agree = torch.mul(sparse, gamma).gt_(0).to(sparse.dtype)
    normalize = compat.option(cfg, "normalize", True, True, (True, False))
    mass = sum_in_order(agree if unit else wt * agree) if normalize else None
    # A_i w_i s_i in agree's own storage (x * y == y * x exactly): no N-sized temporary per product
    tau = sum_in_order(agree.mul_(weighted))
    if mass is None:
        return tau
    # divide by 1 where no one agrees, branch-free (masked_fill_'s writes at scattered entries mispredict): with
    # unit weights the mass counts the agreeing experts, so clamping it at 1 is exact; else mass + [mass == 0]
    # (x + 0.0 == x for x != 0)
    return tau.div_(mass.clamp_min_(1.0) if unit else mass.add_(mass == 0))


# torch's sum over dim 0 adds up to this many rows in order from +0.0 (tests/methods/test_fused.py); with more, its order
# depends on the column's position and on the CPU's vector width (AVX2: columns in 32-wide chunks in order, the
# rest with four interleaved accumulators), so a merge of five experts differed between CPUs
TORCH_ROWS_IN_ORDER = 4


def sum_in_order(x: torch.Tensor) -> torch.Tensor:
    """sum over dim 0 as ((0 + x_0) + x_1) + ... + x_(N-1), on every CPU and for any N (the compiled kernels'
    order: fused.py); one torch reduction where that is torch's own order."""
    if x.shape[0] <= TORCH_ROWS_IN_ORDER:
        return x.sum(0)
    return weighted_sum(x, [1.0] * x.shape[0], x[0])


def _sorted_sum(voters: torch.Tensor) -> torch.Tensor:
    """sum over dim 0 in sorted order; two or fewer values need no sort (a + b == b + a exactly)."""
    return voters.sum(0) if voters.shape[0] <= 2 else sum_in_order(voters.sort(0).values)


# Any float32 summation order of n values errs by at most (n - 1) u sum|x| (u = 2^-24); beyond twice that (with
# slack for the rounding of sum|x| itself) every order, the sorted one included, has the exact sum's sign.
SIGN_SAFE = 4 * 2.0**-24


def sign_of_sum(voters: torch.Tensor) -> torch.Tensor:
    """sign(_sorted_sum(voters)), bit for bit, sorting only the entries whose sum is within rounding of zero
    (a full sort over the experts' axis was most of a TIES merge's time)."""
    n = voters.shape[0]
    total = sum_in_order(voters)
    if n <= 2:
        return torch.sign(total)
    magnitude = sum_in_order(voters.abs())
    close = (total.abs() <= magnitude * (SIGN_SAFE * (n - 1))) & (magnitude > 0)  # all-zero entries sum to 0
    gamma = torch.sign(total)
    if bool(close.any()):
        at = close.nonzero(as_tuple=True)
        columns: tuple[slice | torch.Tensor, ...] = (slice(None), *at)
        gamma[at] = torch.sign(_sorted_sum(voters[columns]))
    return gamma
