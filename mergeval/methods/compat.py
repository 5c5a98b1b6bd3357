"""Two semantics for the methods mergekit 0.1.5 also has: the papers' and mergekit's.

Every such method's config has ``compat``: ``paper`` (the default: the
papers' definitions) or ``mergekit`` (mergekit 0.1.5's tensors within float32
rounding, on any input). Options whose meaning exists in both modes but whose
default differs (``normalize``, ``rescale``, ``weights_before_election``,
``rank_scope``, ``uniform_below``) default to ``null``, "the mode's default";
under ``compat=mergekit`` a value mergekit cannot give (``rescale=inverse_density``,
``rank_scope=tensor``, ...) is refused rather than silently mixed in.

mergekit's generalized task arithmetic (task_arithmetic, ties, dare_linear,
dare_ties, breadcrumbs, breadcrumbs_ties, della_linear, della), per tensor,
``gta`` below:

    d_i   = e_i - b
    s_i   = sparsify(d_i)                    one of the sparsifiers below (none for task_arithmetic)
            rescale=l1: s_i * |d_i|_1 / |s_i|_1 (unchanged when either norm < 1e-7); none: as is
    v_i   = w_i s_i                          weights applied before any election
    TIES variants (ties, dare_ties, breadcrumbs_ties, della; sign_rule=sum):
      g   = +1 where sum_i v_i >= 0 (summed in expert order; an exact zero sum elects +), else -1
            (sign_rule=count: the same on sum_i sign(v_i))
      A_i = [sign(v_i) == g]                 (a zero v_i never agrees)
      tau = sum_i A_i v_i                    normalize=false: the disjoint sum
      tau = sum_i A_i v_i / D,  D = sum_i w_i A_i (D = 0 -> 1)          normalize=true
    linear variants:
      tau = sum_i v_i  (normalize=false),  sum_i v_i / D, D = sum_i w_i (|D| < 1e-8 -> 1) (true)
    merged = b + lambda tau

mergekit's normalize defaults: true for ties and della, false for the others;
rescale: l1 for dare_* and della*, none for the others.

Sparsifiers, per expert, n entries, density p (each expert may have its own p,
gamma, epsilon); p >= 1 returns d unchanged (breadcrumbs then drops no outlier):

    magnitude (ties)        keep k = max(1, floor(p n)) entries: the first k of
                            torch.argsort(|d|, descending=True) (equal magnitudes at the
                            cut are kept in the order torch's sort gives them, as mergekit)
    outliers (breadcrumbs)  k = floor(p n), n_top = floor(gamma n), n_bot = max(0, n - k - n_top):
                            keep positions n_bot .. n_bot + k - 1 of torch.sort(|d|) ascending
                            (the outlier cut shrinks when k + n_top > n; k may be 0)
    bernoulli (dare)        keep each entry with probability p
    magprune (della)        rows along dim 1 (a 1-dim tensor is one row of m entries);
                            r = rank of |d| within the row, 0..m-1; keep w.p. p - eps + 2 eps r / (m - 1);
                            needs 0 < p - eps and p + eps < 1

mergeval always computes in float32; mergekit computes in the config's
``dtype`` (so with ``dtype: bfloat16`` the two differ by bfloat16 rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mergeval.core.errors import UserError
from mergeval.methods.draws import Draws
from mergeval.methods.select import top_k_mask

MODES = ("paper", "mergekit")


def is_mergekit(cfg: Any) -> bool:
    return getattr(cfg, "compat", "paper") == "mergekit"


def check_compat(cfg: Any) -> None:
    if getattr(cfg, "compat", "paper") not in MODES:
        raise UserError(
            "method.compat",
            f"unknown value '{cfg.compat}'",
            "use paper (the papers' definitions) or mergekit (mergekit 0.1.5's tensors)",
        )


def option(cfg: Any, field: str, paper: Any, mergekit: Any, allowed_mergekit: tuple = ()) -> Any:
    """cfg.<field>, or the mode's default when it is None; under compat=mergekit a value outside
    ``allowed_mergekit`` (default: only mergekit's own) is a UserError."""
    value = getattr(cfg, field)
    if not is_mergekit(cfg):
        return paper if value is None else value
    if value is None:
        return mergekit
    if value not in (allowed_mergekit or (mergekit,)):
        allowed = ", ".join(str(v).lower() for v in (allowed_mergekit or (mergekit,)))
        raise UserError(
            f"method.{field}",
            f"{value!r} is not mergekit's semantics (compat=mergekit)",
            f"leave method.{field} unset or use {allowed}, or set method.compat=paper",
        )
    return value


# ---------------------------------------------------------------- per-expert values


def expert_value(cfg: Any, name: str, i: int) -> float:
    """Expert i's value of ``name``: its own (``per_expert[i]``, set directly or by a rule with
    ``expert: i``) if given, else the shared one (``weights[i]`` or 1 for ``weight``; ``cfg.<name>``)."""
    own = getattr(cfg, "per_expert", None) or []
    if i < len(own) and own[i] and own[i].get(name) is not None:
        return float(own[i][name])
    if name == "weight":
        return float(cfg.weights[i]) if getattr(cfg, "weights", None) is not None else 1.0
    return getattr(cfg, name)


def expert_weights(cfg: Any, n: int) -> list[float]:
    return [expert_value(cfg, "weight", i) for i in range(n)]


# ---------------------------------------------------------------- mergekit's sparsifiers


def l1_factor(delta: torch.Tensor, kept: torch.Tensor, eps: float = 1e-7) -> torch.Tensor | None:
    """||delta||_1 / ||kept||_1 as a 0-dim tensor, or None if either norm is below eps (as mergekit)."""
    before, after = delta.abs().sum(), kept.abs().sum()
    if before < eps or after < eps:
        return None
    return before / after


def match_l1(delta: torch.Tensor, kept: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """kept * ||delta||_1 / ||kept||_1, or kept unchanged if either norm is below eps (as mergekit)."""
    factor = l1_factor(delta, kept, eps)
    return kept if factor is None else kept * factor


# Each sparsifier is a keep rule over the whole d_i (a flat boolean mask, or None: keep everything) and the way
# mergekit applies it; rows.GtaRows applies the same masks a row block at a time.


def magnitude_keep(delta: torch.Tensor, density: float) -> torch.Tensor | None:
    """The first k = max(1, floor(density n)) of argsort(|d|, descending); the same set by threshold
    (select.py) unless ties at a non-zero cut must be split in argsort's order."""
    if density >= 1:
        return None
    k = max(1, int(density * delta.numel()))
    magnitude = delta.abs().reshape(-1)
    keep = top_k_mask(magnitude, k)
    if keep is None:
        keep = torch.zeros(delta.numel(), dtype=torch.bool, device=delta.device)
        keep[torch.argsort(magnitude, descending=True)[:k]] = True
    return keep


def times_mask(delta: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """mergekit's magnitude and outlier sparsifiers apply their mask as d * mask (so a dropped -x is -0)."""
    return delta * keep.to(delta.dtype).view_as(delta)


def magnitude(delta: torch.Tensor, density: float) -> torch.Tensor:
    keep = magnitude_keep(delta, density)
    return delta if keep is None else times_mask(delta, keep)


def _keep(delta: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(delta.numel(), dtype=delta.dtype, device=delta.device)
    mask[positions] = 1
    return delta * mask.view_as(delta)


def outliers(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    if density >= 1:
        return delta
    n = delta.numel()
    k, n_top = int(density * n), int(gamma * n)
    n_bot = max(0, n - k - n_top)
    return _keep(delta, torch.sort(delta.abs().reshape(-1)).indices[n_bot : n_bot + k])


def bernoulli_keep(delta: torch.Tensor, density: float, gen: Draws, expert: int, start: int = 0) -> torch.Tensor | None:
    """Each entry kept with probability density: [u < density], u the expert's uniform of the entry from gen
    (mergekit's own draws are torch.bernoulli's, unseeded: the same distribution); ``start``: the flat index of
    delta's first entry in its tensor (a row block's)."""
    if density >= 1:
        return None
    return gen.keep(expert, delta.shape, density, start, delta.device)


def where_mask(delta: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """mergekit's bernoulli applies its mask as where(mask, d, 0) (a dropped entry is +0)."""
    return torch.where(keep.view_as(delta), delta, torch.zeros_like(delta))


def bernoulli(delta: torch.Tensor, density: float, gen: Draws, expert: int) -> torch.Tensor:
    keep = bernoulli_keep(delta, density, gen, expert)
    return delta if keep is None else where_mask(delta, keep)


def magprune(delta: torch.Tensor, density: float, epsilon: float, gen: Draws, expert: int) -> torch.Tensor:
    if density >= 1:
        return delta
    rows = delta if delta.dim() >= 2 else delta.unsqueeze(0)
    m = rows.shape[1]
    rank = torch.argsort(torch.argsort(rows.abs(), dim=1), dim=1).float()
    p = (density - epsilon) + 2 * epsilon * (rank / max(m - 1, 1))
    u = gen.uniform(expert, rows.shape, device=delta.device)
    return torch.where(u < p, rows, torch.zeros_like(rows)).reshape(delta.shape)


def check_magprune(density: float, epsilon: float, field: str = "method.epsilon") -> None:
    """mergekit's bounds: p - eps > 0 and p + eps < 1 (strict), unless p >= 1 (no pruning)."""
    if density < 1 and not (density - epsilon > 0 and density + epsilon < 1):
        raise UserError(
            field,
            f"density -/+ epsilon = [{density - epsilon:g}, {density + epsilon:g}] must lie "
            "strictly inside (0, 1) under compat=mergekit",
            "choose epsilon < min(density, 1 - density)",
        )


# ---------------------------------------------------------------- mergekit's combination


def gta(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    cfg: Any,
    sparsify: Callable[[torch.Tensor, int], torch.Tensor] | None,
    rescale: bool,
    elect: str | None,
    normalize: bool,
) -> torch.Tensor:
    """mergekit's generalized task arithmetic (module docstring); ``sparsify(d_i, i)`` is expert i's
    sparsifier, ``elect`` is the sign rule (None: linear), ``rescale`` the L1 rescale."""
    b = base.float()
    n = len(experts)
    deltas = []
    for i, e in enumerate(experts):
        d = e.float() - b
        if sparsify is not None:
            s = sparsify(d, i)
            d = match_l1(d, s) if rescale and s is not d else s
        deltas.append(d)
    v = torch.stack(deltas)
    w = torch.tensor(expert_weights(cfg, n), dtype=torch.float32, device=b.device).view(-1, *([1] * b.dim()))
    v = v * w
    if elect is not None:
        votes = v.sum(0) if elect == "sum" else torch.sign(v).sum(0)
        agree = (torch.sign(v) == torch.where(votes >= 0, 1.0, -1.0)).to(v.dtype)
        tau = (v * agree).sum(0)
        divisor = (w * agree).sum(0)
        divisor[divisor == 0] = 1
    else:
        tau = v.sum(0)
        divisor = w.sum(0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        tau = tau / divisor
    if cfg.lambda_ != 1:
        tau = tau * cfg.lambda_
    return (b + tau).to(base.dtype)
