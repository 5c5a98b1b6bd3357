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
        merged = b + lambda * disjoint_merge(s_1..s_N)
    where disjoint_merge is the sign election and disjoint (weighted) mean of
    ``ties`` with the same options (sign_rule, weights_before_election).

The TIES variants take the disjoint *mean* unless normalize=false (the disjoint
*sum*, mergekit's default for dare_ties and breadcrumbs_ties); the linear
variants divide by sum_i w_i only with normalize=true. Each expert may have its
own density, gamma and epsilon (``per_expert`` or rules with ``expert: i``).
``compat=mergekit`` gives mergekit 0.1.5's semantics (``compat.py``: kept
counts floor(density n), its tie order and sign at zero, rescale l1 or none,
rows along dim 1 for DELLA). Random methods draw all their randomness from the ``Draws`` they are
given (``draws.py``): one uniform per entry per expert, u = U(seed, tensor, i, entry index), so a seed
fixes the output bit for bit whatever the device or the row blocks; expert i draws from stream i, so the
expert order changes which draws each expert gets (the output distribution does not depend on the order).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mergeval.core.errors import UserError
from mergeval.methods import compat, fused
from mergeval.methods.compat import expert_value, expert_weights, match_l1
from mergeval.methods.draws import Draws
from mergeval.methods.registry import Mergekit, register
from mergeval.methods.select import first_k_mask, first_ties_mask, kth_largest
from mergeval.methods.task_vector import (
    _check_lambda,
    _check_weights,
    check_ties_options,
    disjoint_merge,
    kept_count,
    trim_to_density,
    weighted_sum,
)

RESCALES_DARE = ("inverse_density", "l1", "none")
RESCALES_DELLA = ("inverse_prob", "l1", "none")
RANK_SCOPES = ("tensor", "row")
SIGN_RULES = ("sum", "count")


# ---------------------------------------------------------------- configs


@dataclass
class DareLinearConfig:
    name: str = "dare_linear"
    lambda_: float = 1.0
    density: float = 0.5  # keep probability of each delta entry (1 - the paper's drop rate p)
    weights: list[float] | None = None
    # null: the mode's; "inverse_density": kept / density (paper); "l1": match the L1 norm (mergekit); "none"
    rescale: str | None = None
    normalize: bool = False  # true: divide by sum_i w_i (mergekit's normalize)
    compat: str = "paper"


@dataclass
class DareTiesConfig:
    name: str = "dare_ties"
    lambda_: float = 1.0
    density: float = 0.5
    weights: list[float] | None = None
    rescale: str | None = None
    sign_rule: str = "sum"  # as in ties: "sum" (paper) or "count" (majority of experts)
    weights_before_election: bool | None = None  # as in ties: null is the mode's (mergekit: true)
    normalize: bool | None = None  # null: paper true (disjoint mean), mergekit false (disjoint sum)
    compat: str = "paper"


@dataclass
class BreadcrumbsConfig:
    name: str = "breadcrumbs"
    lambda_: float = 1.0
    density: float = 0.9  # fraction of entries kept (after the outliers), by magnitude
    gamma: float = 0.01  # fraction of largest-magnitude entries dropped as outliers
    weights: list[float] | None = None
    normalize: bool = False  # true: divide by sum_i w_i (mergekit's normalize)
    rescale: str | None = None  # null/none: as trimmed; l1: L1-matched (mergekit's rescale)
    compat: str = "paper"


@dataclass
class BreadcrumbsTiesConfig:
    name: str = "breadcrumbs_ties"
    lambda_: float = 1.0
    density: float = 0.9
    gamma: float = 0.01
    weights: list[float] | None = None
    sign_rule: str = "sum"
    weights_before_election: bool | None = None
    normalize: bool | None = None  # null: paper true (disjoint mean), mergekit false (disjoint sum)
    rescale: str | None = None
    compat: str = "paper"


@dataclass
class DellaLinearConfig:
    name: str = "della_linear"
    lambda_: float = 1.0
    density: float = 0.5  # mean keep probability
    epsilon: float = 0.1  # keep probabilities span [density - epsilon, density + epsilon] by magnitude rank
    weights: list[float] | None = None
    # null: the mode's; "inverse_prob": kept / p_keep (paper); "l1": match the L1 norm (mergekit); "none"
    rescale: str | None = None
    rank_scope: str | None = None  # null: the mode's; ranks within the "tensor" (paper) or each "row" (mergekit)
    normalize: bool = False  # true: divide by sum_i w_i (mergekit's normalize)
    compat: str = "paper"


@dataclass
class DellaConfig:
    name: str = "della"
    lambda_: float = 1.0
    density: float = 0.5
    epsilon: float = 0.1
    weights: list[float] | None = None
    rescale: str | None = None
    rank_scope: str | None = None
    sign_rule: str = "sum"
    weights_before_election: bool | None = None
    normalize: bool | None = None  # null: true (disjoint mean) in both modes
    compat: str = "paper"


@dataclass
class SceConfig:
    name: str = "sce"
    lambda_: float = 1.0
    select_topk: float = 1.0  # fraction of entries kept, ranked by variance across experts (1 = all)
    normalize: bool | None = None  # null: the mode's (paper false; mergekit true: divide by the surviving weights)
    uniform_below: float | None = (
        None  # equal expert weights below this summed mean-square delta (null: 0; mergekit 1e-6)
    )
    compat: str = "paper"


# ---------------------------------------------------------------- validation


def _check_density(density: float, field: str = "method.density") -> None:
    if not (0.0 < density <= 1.0):
        raise UserError(field, f"must be in (0, 1], got {density}", f"set e.g. {field}=0.5")


def _check_choice(value: str, allowed: tuple[str, ...], field: str) -> None:
    if value not in allowed:
        raise UserError(field, f"unknown value '{value}'", f"use one of: {', '.join(allowed)}")


def _check_common(cfg, n_experts: int) -> None:
    compat.check_compat(cfg)
    _check_lambda(cfg.lambda_)
    _check_weights(cfg.weights, n_experts)
    _check_density(cfg.density)
    if hasattr(cfg, "sign_rule"):
        _check_choice(cfg.sign_rule, SIGN_RULES, "method.sign_rule")
        check_ties_options(cfg)


def _rescale(cfg) -> str:
    """The resolved rescale: the paper's own (inverse_density, inverse_prob, none) or mergekit's (l1 or none)."""
    paper, mergekit = {"dare": ("inverse_density", "l1"), "della": ("inverse_prob", "l1")}.get(
        _family(cfg), ("none", "none")
    )
    return compat.option(cfg, "rescale", paper, mergekit, ("l1", "none"))


def _family(cfg) -> str:
    return cfg.name.split("_")[0]


def _validate_dare(cfg: DareLinearConfig | DareTiesConfig, n_experts: int) -> None:
    _check_common(cfg, n_experts)
    _check_choice(_rescale(cfg), RESCALES_DARE, "method.rescale")


def _validate_breadcrumbs(cfg: BreadcrumbsConfig | BreadcrumbsTiesConfig, n_experts: int) -> None:
    _check_common(cfg, n_experts)
    _check_choice(_rescale(cfg), ("none", "l1"), "method.rescale")
    if not (0.0 <= cfg.gamma < 1.0):
        raise UserError("method.gamma", f"must be in [0, 1), got {cfg.gamma}", "set e.g. method.gamma=0.01")
    if cfg.density + cfg.gamma > 1.0 + 1e-9 and not compat.is_mergekit(cfg):  # mergekit shrinks the outlier cut
        raise UserError(
            "method.gamma",
            f"density + gamma = {cfg.density + cfg.gamma:g} exceeds 1",
            "lower method.gamma or method.density so that they sum to at most 1",
        )


def _validate_della(cfg: DellaLinearConfig | DellaConfig, n_experts: int) -> None:
    _check_common(cfg, n_experts)
    _check_choice(_rescale(cfg), RESCALES_DELLA, "method.rescale")
    _check_choice(compat.option(cfg, "rank_scope", "tensor", "row"), RANK_SCOPES, "method.rank_scope")
    if not (math.isfinite(cfg.epsilon) and cfg.epsilon >= 0.0):
        raise UserError(
            "method.epsilon", f"must be a finite number >= 0, got {cfg.epsilon}", "set e.g. method.epsilon=0.1"
        )
    if compat.is_mergekit(cfg):
        compat.check_magprune(cfg.density, cfg.epsilon)
        return
    lo, hi = cfg.density - cfg.epsilon, cfg.density + cfg.epsilon
    if not (lo > 0.0 and hi <= 1.0 + 1e-9):
        raise UserError(
            "method.epsilon",
            f"keep probabilities density -/+ epsilon = [{lo:g}, {hi:g}] leave (0, 1]",
            "choose epsilon < density and density + epsilon <= 1",
        )


def _validate_sce(cfg: SceConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    _check_lambda(cfg.lambda_)
    compat.option(cfg, "normalize", False, True)
    uniform_below = compat.option(cfg, "uniform_below", 0.0, 1e-6)
    if not (math.isfinite(uniform_below) and uniform_below >= 0.0):
        raise UserError(
            "method.uniform_below",
            f"must be a finite number >= 0, got {uniform_below}",
            "set method.uniform_below=0 (never) or 1e-6 (mergekit)",
        )
    _check_density(cfg.select_topk, "method.select_topk")
    if cfg.select_topk < 1.0 and n_experts < 2:
        raise UserError(
            "modelset.experts",
            f"sce with select_topk < 1 ranks entries by their variance across "
            f"experts, which needs at least 2 experts (got {n_experts})",
            "add an expert or set method.select_topk=1.0",
        )


# ---------------------------------------------------------------- sparsifiers (one task vector each)


def _rescaled(delta: torch.Tensor, kept: torch.Tensor, rescale: str, keep_prob) -> torch.Tensor:
    if rescale == "l1":
        return match_l1(delta, kept)
    return kept if rescale == "none" else kept / keep_prob


def dare_drop(delta: torch.Tensor, density: float, rescale: str, gen: Draws, expert: int) -> torch.Tensor:
    """DARE (Yu et al., 2024): keep each entry independently with probability density, then rescale.

    m ~ Bernoulli(density) per entry (m = [u < density], u = expert's uniform of the entry from gen)
    s = m * delta / density                     rescale="inverse_density" (the paper; E[s] = delta)
    s = m * delta * |delta|_1 / |m * delta|_1   rescale="l1" (mergekit)
    s = m * delta                               rescale="none" (mergekit's rescale=false)
    density = 1 returns delta unchanged.
    """
    if density >= 1.0:
        return delta
    kept = torch.where(gen.keep(expert, delta.shape, density, device=delta.device), delta, torch.zeros_like(delta))
    return _rescaled(delta, kept, rescale, density)


def breadcrumbs_mask(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs (Davari & Belilovsky, 2023): drop the outliers and the small entries.

    Sort the entries by |delta|; zero the n_top = floor(gamma * n) largest (the outliers), keep the
    next k = max(1, ceil(density * n)) (trim_to_density's count, as in ties), zero the rest. Ties at
    either cut go by position (the first of a stable descending sort; found without sorting).
    Before implementation version 3 the outliers' ties were split in torch.topk's order.
    """
    n_top = int(gamma * delta.numel() + 1e-9)
    if n_top > 0:
        delta = delta.masked_fill(first_k_mask(delta.abs().reshape(-1), n_top).view_as(delta), 0)
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
    # p of the entry of each rank (an elementwise formula, so computing it before placing the values by rank
    # gives the same bits as after; in place: each n-entry temporary of a large tensor costs fresh pages)
    by_rank = torch.arange(n, dtype=torch.float32, device=delta.device).div_(n - 1)
    by_rank.mul_(2.0 * epsilon).add_(density - epsilon)
    p = _placed_by_rank(rows, by_rank)
    if p is None:
        order = torch.sort(rows.abs(), dim=1, stable=True).indices
        p = torch.empty(rows.shape, dtype=torch.float32, device=delta.device)
        p.scatter_(1, order, by_rank.expand(rows.shape[0], n).contiguous())
    return p.view_as(delta)


KEY_CHUNK = 1 << 20  # columns numbered per step in a one-row key array (no n-entry index array)


def _placed_by_rank(rows: torch.Tensor, by_rank: torch.Tensor) -> torch.Tensor | None:
    """out[i, j] = by_rank[rank of |rows[i, j]| in row i] (rank: stable ascending sort, ties by position), or
    None where this way does not apply (not a finite float32 CPU tensor, or the keys need more than 63 bits).

    A tensor the compiled kernels take (``fused.usable``) is ranked by ``fused.placed_by_rank``'s radix sort
    (faster still, the same ranks); the rest, and every tensor without numba, as follows.
    The same ranks as ``torch.sort(stable=True)``, faster than that sort with its temporaries: each entry
    becomes one int64 key
    ``row | float bits | column`` (the bits of a float32 with its sign cleared order as its magnitude), and
    the keys are all distinct, so one plain NumPy sort (vectorised) puts every row's entries in stable order.
    The keys are the only n-entry temporary: no |rows|, no finiteness mask, no column index array."""
    if rows.device.type != "cpu" or rows.dtype != torch.float32:
        return None
    if fused.usable(rows.numel()):  # the same ranks by a radix sort (fused.placed_by_rank), faster
        return fused.placed_by_rank(rows, by_rank)
    r, n = rows.shape
    col_bits, row_bits = (n - 1).bit_length(), (r - 1).bit_length()
    if col_bits + 31 + row_bits > 63:
        return None
    keys = rows.contiguous().view(torch.int32).numpy().astype(np.int64)
    keys &= 0x7FFFFFFF  # |x|'s bits
    if keys.max() >= 0x7F800000:  # an infinity or a NaN: torch's sort decides their order
        return None
    keys <<= col_bits
    if r > 1:
        keys |= np.arange(n, dtype=np.int64)
        keys |= (np.arange(r, dtype=np.int64) << (31 + col_bits))[:, None]
    else:
        for lo in range(0, n, KEY_CHUNK):
            keys[0, lo : lo + KEY_CHUNK] |= np.arange(lo, min(lo + KEY_CHUNK, n), dtype=np.int64)
    flat = keys.reshape(-1)
    flat.sort()
    flat &= (1 << col_bits) - 1  # each sorted key's column; row j of the sorted keys is row j of the tensor
    if r > 1:
        keys += (np.arange(r, dtype=np.int64) * n)[:, None]  # flat index of that column in its row
    out = np.empty(r * n, dtype=np.float32)
    out[keys] = by_rank.numpy()  # the entry at rank j of its row gets by_rank[j]
    return torch.from_numpy(out).view(r, n)


def della_magprune(
    delta: torch.Tensor,
    density: float,
    epsilon: float,
    rescale: str,
    gen: Draws,
    expert: int,
    rank_scope: str = "tensor",
) -> torch.Tensor:
    """DELLA's MAGPRUNE (Deep et al., 2024): magnitude-ranked random drop, then rescale.

    p = della_keep_prob(delta, rank_scope)      larger |delta| -> higher keep probability
    m ~ Bernoulli(p) per entry (m = [u < p], u = expert's uniform of the entry from gen)
    s = m * delta / p                           rescale="inverse_prob" (the paper; E[s] = delta)
    s = m * delta * |delta|_1 / |m * delta|_1   rescale="l1" (mergekit)
    s = m * delta                               rescale="none"
    """
    p = della_keep_prob(delta, density, epsilon, rank_scope)
    dropped = gen.uniform(expert, delta.shape, device=delta.device) >= p  # not [u < p]: u and p are finite
    if rescale == "inverse_prob":  # delta / p where kept, +0.0 where dropped (as 0.0 / p): one temporary less
        return torch.div(delta, p).masked_fill_(dropped, 0.0)
    return _rescaled(delta, delta.masked_fill(dropped, 0.0), rescale, p)


# ---------------------------------------------------------------- combining


def _sparsifier(cfg, gen: Draws) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Expert i's sparsifier ``(d_i, i) -> s_i`` in the config's mode (mergekit's leaves the rescale to gta)."""
    family, mk, rescale = _family(cfg), compat.is_mergekit(cfg), _rescale(cfg)

    def value(name: str, i: int) -> float:
        return expert_value(cfg, name, i)

    if family == "dare":
        if mk:
            return lambda d, i: compat.bernoulli(d, value("density", i), gen, i)
        return lambda d, i: dare_drop(d, value("density", i), rescale, gen, i)
    if family == "breadcrumbs":
        if mk:
            return lambda d, i: compat.outliers(d, value("density", i), value("gamma", i))
        return lambda d, i: _rescaled(d, breadcrumbs_mask(d, value("density", i), value("gamma", i)), rescale, 1.0)
    if mk:
        return lambda d, i: compat.magprune(d, value("density", i), value("epsilon", i), gen, i)
    scope = compat.option(cfg, "rank_scope", "tensor", "row")
    return lambda d, i: della_magprune(d, value("density", i), value("epsilon", i), rescale, gen, i, scope)


MERGEKIT_NORMALIZE = {"ties": True, "della": True}  # mergekit's normalize default of each TIES variant (else false)


def mergekit_gta_options(cfg, elect: bool) -> tuple[bool, str | None, bool]:
    """compat.gta's rescale, sign rule and normalize for a DARE, breadcrumbs or DELLA config under compat=mergekit."""
    normalize = (
        compat.option(cfg, "normalize", True, MERGEKIT_NORMALIZE.get(cfg.name, False), (True, False))
        if elect
        else cfg.normalize
    )
    return _rescale(cfg) == "l1", cfg.sign_rule if elect else None, normalize


def _combine(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    cfg,
    gen: Draws | None,
    elect: bool,
    sparsify: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sparsify each task vector, then the TIES election (elect) or the weighted sum, scaled by lambda.
    ``sparsify``: the config's own sparsifier unless given (rows.DareRows: masks drawn beforehand)."""
    if sparsify is None:
        assert gen is not None, "the config's own sparsifier draws from gen"
        sparsify = _sparsifier(cfg, gen)
    if compat.is_mergekit(cfg):
        return compat.gta(base, experts, cfg, sparsify, *mergekit_gta_options(cfg, elect))
    b = base.float()
    # each s_i in its row of one stack (a sparsifier may work in place on d_i, else its result is copied in)
    sparse = torch.empty((len(experts), *b.shape), dtype=torch.float32, device=b.device)
    for i, e in enumerate(experts):
        d = torch.sub(e.float(), b, out=sparse[i])
        s = sparsify(d, i)
        if s is not d:
            d.copy_(s)
    if elect:
        tau = disjoint_merge(sparse, cfg)
    else:
        w = expert_weights(cfg, len(experts))
        tau = weighted_sum(sparse, w, b)
        if cfg.normalize and abs(sum(w)) >= 1e-8:
            tau = tau.div_(sum(w))
    return tau.mul_(cfg.lambda_).add_(b).to(base.dtype)  # b + lambda * tau (x + y == y + x exactly)


# ---------------------------------------------------------------- methods


# version 2: counter-based draws (draws.py) instead of torch's CPU generator
@register("dare_linear", DareLinearConfig, _validate_dare, version=2, mergekit=Mergekit("dare_linear"))
def dare_linear(base: torch.Tensor, experts: list[torch.Tensor], cfg: DareLinearConfig, gen: Draws) -> torch.Tensor:
    """DARE + task arithmetic (Yu et al., 2024).

    s_i    = dare_drop(d_i, density_i, rescale)   keep w.p. density_i; kept / density_i (or L1-matched, or as is)
    merged = b + lambda * sum_i w_i * s_i          (normalize=true: divided by sum_i w_i)
    density = 1 is task_arithmetic. compat=mergekit: rescale defaults to l1 (compat.py).
    """
    return _combine(base, experts, cfg, gen, elect=False)


# version 3: counter-based draws (draws.py) instead of torch's CPU generator; 2: sums over 5+ experts in order
# (task_vector.sum_in_order)
@register("dare_ties", DareTiesConfig, _validate_dare, version=3, mergekit=Mergekit("dare_ties"))
def dare_ties(base: torch.Tensor, experts: list[torch.Tensor], cfg: DareTiesConfig, gen: Draws) -> torch.Tensor:
    """DARE + TIES election (Yu et al., 2024): random drop instead of TIES' magnitude trim.

    s_i    = dare_drop(d_i, density_i, rescale)
    merged = b + lambda * disjoint_merge(s_1..s_N)   TIES' election + disjoint mean (normalize=false: sum)
    density = 1 is ties with density 1. compat=mergekit: rescale l1 and normalize false by default,
    weights before the election, + at a zero sum (compat.py).
    """
    return _combine(base, experts, cfg, gen, elect=True)


# version 3: the outliers' ties by position too (2: the trim cut's; 1: both in torch.topk's order)
@register("breadcrumbs", BreadcrumbsConfig, _validate_breadcrumbs, version=3, mergekit=Mergekit("breadcrumbs"))
def breadcrumbs(base: torch.Tensor, experts: list[torch.Tensor], cfg: BreadcrumbsConfig, gen: Draws) -> torch.Tensor:
    """Model Breadcrumbs (Davari & Belilovsky, 2023).

    s_i    = breadcrumbs_mask(d_i)   drop the floor(gamma*n) largest |d_i|, keep the next ceil(density*n)
    merged = b + lambda * sum_i w_i * s_i          (normalize=true: divided by sum_i w_i)
    compat=mergekit: keep floor(density n) (possibly 0), shrink the outlier cut when density + gamma > 1,
    density = 1 keeps everything (compat.py).
    """
    return _combine(base, experts, cfg, gen, elect=False)


# version 4: sums over 5+ experts in order (task_vector.sum_in_order); 3: the outliers' ties by position too
# (2: the trim cut's; 1: both in torch.topk's order)
@register(
    "breadcrumbs_ties", BreadcrumbsTiesConfig, _validate_breadcrumbs, version=4, mergekit=Mergekit("breadcrumbs_ties")
)
def breadcrumbs_ties(
    base: torch.Tensor, experts: list[torch.Tensor], cfg: BreadcrumbsTiesConfig, gen: Draws
) -> torch.Tensor:
    """Model Breadcrumbs with TIES' election (mergekit's breadcrumbs_ties).

    s_i    = breadcrumbs_mask(d_i)
    merged = b + lambda * disjoint_merge(s_1..s_N)
    gamma = 0 is ties with the same density. compat=mergekit: as breadcrumbs, and normalize false by default.
    """
    return _combine(base, experts, cfg, gen, elect=True)


# version 2: counter-based draws (draws.py) instead of torch's CPU generator
@register("della_linear", DellaLinearConfig, _validate_della, version=2, mergekit=Mergekit("della_linear"))
def della_linear(base: torch.Tensor, experts: list[torch.Tensor], cfg: DellaLinearConfig, gen: Draws) -> torch.Tensor:
    """DELLA's MAGPRUNE + task arithmetic (Deep et al., 2024; mergekit's della_linear).

    p      = density - epsilon + 2 * epsilon * rank(|d_i|) / (n - 1)   per entry, within the tensor or row
    s_i    = Bernoulli(p) * d_i / p   (or L1-matched, or as is)
    merged = b + lambda * sum_i w_i * s_i          (normalize=true: divided by sum_i w_i)
    compat=mergekit: ranks within rows along dim 1, rescale l1 by default, density +/- epsilon strictly in (0, 1).
    """
    return _combine(base, experts, cfg, gen, elect=False)


# version 3: counter-based draws (draws.py) instead of torch's CPU generator; 2: sums over 5+ experts in order
# (task_vector.sum_in_order)
@register("della", DellaConfig, _validate_della, version=3, mergekit=Mergekit("della"))
def della(base: torch.Tensor, experts: list[torch.Tensor], cfg: DellaConfig, gen: Draws) -> torch.Tensor:
    """DELLA-Merging (Deep et al., 2024): MAGPRUNE, TIES' election, disjoint mean, scale.

    p      = density - epsilon + 2 * epsilon * rank(|d_i|) / (n - 1)   per entry, within the tensor or row
    s_i    = Bernoulli(p) * d_i / p   (or L1-matched, or as is)
    merged = b + lambda * disjoint_merge(s_1..s_N)
    epsilon = 0 is dare_ties. compat=mergekit: as della_linear, with mergekit's election (compat.py).
    """
    return _combine(base, experts, cfg, gen, elect=True)


@register("sce", SceConfig, _validate_sce, mergekit=Mergekit("sce"))
def sce(base: torch.Tensor, experts: list[torch.Tensor], cfg: SceConfig, gen: Draws) -> torch.Tensor:
    """SCE (FuseChat, Wan et al., 2024; mergekit's sce): Select, Calculate, Erase.

    Select:    M = the k = max(1, ceil(select_topk * n)) entries with the largest variance of
               (d_1..d_N) across experts (population variance; ties by position); s_i = M * d_i
    Calculate: w_i = mean(s_i^2) / sum_j mean(s_j^2)     (mean over the tensor's entries)
               w_i = 1/N when sum_j mean(s_j^2) is 0 or below uniform_below (default 0; mergekit
               uses 1e-6, which covers every tensor of a lightly fine-tuned model: deltas of rms
               ~5e-4, as the quickstart experts', have mean squares ~2e-7)
    Erase:     gamma = sign(sum_i s_i); A_i = [sign(s_i) == gamma] and s_i != 0
    merged = b + lambda * sum_i w_i A_i s_i                           normalize=false (the formula above)
    merged = b + lambda * sum_i w_i A_i s_i / sum_i w_i A_i           normalize=true

    compat=mergekit (normalize true, uniform_below 1e-6 by default): k = floor(select_topk * m) of the m
    entries with non-zero variance, in torch.topk's order (k = 0 keeps nothing); the sign is elected
    by the sum in expert order with + at an exact zero sum; the divisor is max(sum_i w_i A_i, 1e-6).
    """
    if compat.is_mergekit(cfg):
        return _sce_mergekit(base, experts, cfg)
    b = base.float()
    deltas = torch.stack([e.float() - b for e in experts])
    ordered = deltas.sort(0).values  # per-entry sorted: variance and sign votes independent of expert order
    if cfg.select_topk < 1.0:
        n = b.numel()
        k = kept_count(cfg.select_topk, n)
        variance = ordered.var(0, unbiased=False).flatten()
        # the first k of a stable descending sort, without the sort; tied zero variances by position too
        # (an entry every expert moved alike has variance 0 and a non-zero delta: keeping it matters)
        cut, c_gt, _ = kth_largest(variance, k)
        keep = first_ties_mask(variance, cut, k - c_gt).view_as(b)
        deltas = deltas * keep
        ordered = ordered * keep
    energy = [float(d.double().square().mean()) for d in deltas]
    total = sum(sorted(energy))
    uniform = total == 0 or total < compat.option(cfg, "uniform_below", 0.0, 1e-6)
    w = [1.0 / len(energy)] * len(energy) if uniform else [x / total for x in energy]
    wt = torch.tensor(w, dtype=torch.float32, device=b.device).view(-1, *([1] * b.dim()))
    gamma = torch.sign(ordered.sum(0))
    agree = (torch.sign(deltas) == gamma) & (deltas != 0)
    tau = (wt * deltas * agree).sum(0)
    if compat.option(cfg, "normalize", False, True):
        mass = (wt * agree).sum(0)
        tau = tau / mass.where(mass != 0, torch.ones_like(mass))
    return (b + cfg.lambda_ * tau).to(base.dtype)


def _sce_mergekit(base: torch.Tensor, experts: list[torch.Tensor], cfg: SceConfig) -> torch.Tensor:
    """mergekit's sce, as the docstring of ``sce`` states (float32 throughout)."""
    b = base.float()
    tv = torch.stack([e.float() - b for e in experts])
    if cfg.select_topk < 1:
        var = torch.var(tv, dim=0, unbiased=False)
        k = int(torch.count_nonzero(var) * cfg.select_topk)
        mask = torch.zeros_like(var)
        if k > 0:
            mask.view(-1)[torch.topk(var.abs().view(-1), k=k, largest=True).indices] = 1
        tv = tv * mask.unsqueeze(0)
    agree = (torch.sign(tv) == torch.where(tv.sum(0) >= 0, 1.0, -1.0)).to(tv.dtype)
    energy = tv.square().reshape(tv.shape[0], -1).mean(dim=1)
    total = torch.sum(energy).item()
    w = (
        torch.ones_like(energy) / len(experts)
        if abs(total) < compat.option(cfg, "uniform_below", 0.0, 1e-6)
        else energy / total
    )
    w = w.view(-1, *([1] * b.dim())) * agree
    tau = (tv * w).sum(0)
    if compat.option(cfg, "normalize", False, True):
        tau = tau / w.sum(0).clamp(min=1e-6)
    return (b + cfg.lambda_ * tau).to(base.dtype)
