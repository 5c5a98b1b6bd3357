"""Geometric methods: SLERP and NearSwap between the base and one expert, and Model Stock.

Notation as in ``task_vector.py``, per tensor: ``b`` the base, ``e_i`` expert i
(i = 1..N), ``d_i = e_i - b``. Each tensor is treated as one flattened vector
(Model Stock optionally per row). Arithmetic runs in float32, with dot products
and norms accumulated in float64; the result is cast back to the base's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergeval.core.errors import UserError
from mergeval.methods import compat
from mergeval.methods.registry import register

# |cos(b, e)| above this counts as colinear and slerp falls back to lerp (mergekit's DOT_THRESHOLD):
# an angle under ~1.8 degrees (or over ~178.2), where sin(theta) ~ 0.03 would amplify rounding.
COLINEAR_COS = 0.9995


@dataclass
class SlerpConfig:
    name: str = "slerp"
    t: float = 0.5  # 0 = the base, 1 = the expert
    compat: str = "paper"  # mergekit: float32 cosines, a zero tensor counts as unit-norm (see slerp)


@dataclass
class NearSwapConfig:
    name: str = "nearswap"
    t: float = 0.0001  # the distance below which an entry takes the expert's value (mergekit's example config)
    compat: str = "paper"  # both modes are the same: the method is mergekit's own


@dataclass
class ModelStockConfig:
    name: str = "model_stock"
    filter_wise: bool = False  # true: one cos/t per row (last dim) of each matrix, as mergekit's option
    compat: str = "paper"  # mergekit: no clamp of the cosine at 0 (see model_stock)


def _validate_slerp(cfg: SlerpConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    if not (0.0 <= cfg.t <= 1.0):
        raise UserError("method.t", f"must be in [0, 1], got {cfg.t}", "set e.g. method.t=0.5")
    if n_experts != 1:
        raise UserError("modelset.experts", f"slerp interpolates the base and exactly one expert, got {n_experts}",
                        "list exactly one expert in the modelset")


def _validate_nearswap(cfg: NearSwapConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    if not (math.isfinite(cfg.t) and cfg.t >= 0):
        raise UserError("method.t", f"must be a distance of 0 or more, got {cfg.t}", "set e.g. method.t=0.0001")
    if n_experts != 1:
        raise UserError("modelset.experts", f"nearswap moves the base toward exactly one expert, got {n_experts}",
                        "list exactly one expert in the modelset")


def _validate_model_stock(cfg: ModelStockConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    if n_experts < 2:
        raise UserError("modelset.experts", f"model_stock needs at least 2 fine-tuned experts besides the base, "
                        f"got {n_experts}", "add another expert fine-tuned from the same base")


@register("slerp", SlerpConfig, _validate_slerp)
def slerp(base: torch.Tensor, experts: list[torch.Tensor], cfg: SlerpConfig, gen: torch.Generator) -> torch.Tensor:
    """Spherical linear interpolation from the base (t=0) to the one expert (t=1), as mergekit.

    cos    = <b, e> / (|b| |e|),  theta = arccos(cos)      over the flattened tensors
    merged = sin((1-t) theta) / sin(theta) * b + sin(t theta) / sin(theta) * e
    merged = (1-t) * b + t * e     when |cos| > 0.9995 (nearly colinear) or b or e is 0
    The weights apply to the unnormalised tensors, so norms are interpolated along with the angle.

    compat=mergekit: cos = <b/|b|, e/|e|> in float32 with a norm at or below 1e-8 taken as 1, so a
    zero tensor gives cos = 0 and is slerped (sin(t pi/2) e), where mergeval's default lerps.
    """
    (expert,) = experts
    if compat.is_mergekit(cfg):
        return _slerp_mergekit(base, expert, float(cfg.t))
    v0, v1 = base.float(), expert.float()
    t = float(cfg.t)
    n0 = float(torch.linalg.vector_norm(v0, dtype=torch.float64))
    n1 = float(torch.linalg.vector_norm(v1, dtype=torch.float64))
    cos = float(torch.sum(v0 * v1, dtype=torch.float64)) / (n0 * n1) if n0 > 0 and n1 > 0 else 1.0
    if abs(cos) > COLINEAR_COS:
        return ((1.0 - t) * v0 + t * v1).to(base.dtype)
    theta = math.acos(max(-1.0, min(1.0, cos)))
    s0 = math.sin((1.0 - t) * theta) / math.sin(theta)
    s1 = math.sin(t * theta) / math.sin(theta)
    return (s0 * v0 + s1 * v1).to(base.dtype)


def _slerp_mergekit(base: torch.Tensor, expert: torch.Tensor, t: float) -> torch.Tensor:
    v0, v1 = base.float().reshape(1, -1), expert.float().reshape(1, -1)
    n0, n1 = (torch.linalg.vector_norm(v, dim=1, keepdim=True) for v in (v0, v1))
    n0, n1 = torch.where(n0 > 1e-8, n0, 1), torch.where(n1 > 1e-8, n1, 1)
    cos = float(((v0 / n0) * (v1 / n1)).sum().clamp(-1, 1))
    if abs(cos) > COLINEAR_COS:
        s0, s1 = 1 - t, t
    else:
        theta = math.acos(cos)
        s0, s1 = math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)
    return (s0 * v0 + s1 * v1).reshape(base.shape).to(base.dtype)


def _rows(x: torch.Tensor, filter_wise: bool) -> torch.Tensor:
    if filter_wise and x.dim() >= 2:
        return x.reshape(-1, x.shape[-1])
    return x.reshape(1, -1)


@register("model_stock", ModelStockConfig, _validate_model_stock)
def model_stock(base: torch.Tensor, experts: list[torch.Tensor], cfg: ModelStockConfig,
                gen: torch.Generator) -> torch.Tensor:
    """Model Stock (Jang et al., 2024), N >= 2 experts fine-tuned from the base.

    cos    = mean over pairs i < j of <d_i, d_j> / (|d_i| |d_j|), clamped to [0, 1]
             (a pair with a zero task vector counts as cos 0)
    t      = N cos / (1 + (N - 1) cos)          in [0, 1]: 0 at cos 0, 1 at cos 1
    merged = t * mean_i e_i + (1 - t) * b
    Per tensor (flattened); filter_wise=true: one cos and t per row (last dim) of each matrix.
    The clamp is ours: the paper assumes cos > 0, and for cos < 0 the formula leaves [0, 1] and
    diverges at cos = -1/(N-1) (mergekit clamps only to [-1, 1]).

    compat=mergekit: each pair's cosine is <d_i, d_j> / max(|d_i| |d_j|, 1e-6) in float32, clamped to
    [-1, 1] only; t = 0 where |1 + (N - 1) cos| < 1e-6, else the formula above (t may leave [0, 1]).
    """
    if compat.is_mergekit(cfg):
        return _model_stock_mergekit(base, experts, cfg.filter_wise)
    b = _rows(base.float(), cfg.filter_wise)
    es = [_rows(e.float(), cfg.filter_wise) for e in experts]
    ds = [e - b for e in es]
    norms = [torch.linalg.vector_norm(d, dim=-1, dtype=torch.float64) for d in ds]
    cosines = []
    for i in range(len(ds)):
        for j in range(i + 1, len(ds)):
            prod = norms[i] * norms[j]
            dot = torch.sum(ds[i] * ds[j], dim=-1, dtype=torch.float64)
            cosines.append(torch.where(prod > 0, dot / prod.where(prod > 0, torch.ones_like(prod)),
                                       torch.zeros_like(prod)))
    cos = torch.stack(cosines).mean(0).clamp(0.0, 1.0)
    n = len(experts)
    t = (n * cos / (1.0 + (n - 1) * cos)).to(torch.float32).unsqueeze(-1)
    mean = sum(es) / n
    return (t * mean + (1.0 - t) * b).reshape(base.shape).to(base.dtype)


def _model_stock_mergekit(base: torch.Tensor, experts: list[torch.Tensor], filter_wise: bool) -> torch.Tensor:
    b = _rows(base.float(), filter_wise)
    es = [_rows(e.float(), filter_wise) for e in experts]
    ds = [e - b for e in es]
    cosines = []
    for i in range(len(ds)):
        for j in range(i + 1, len(ds)):
            prod = torch.norm(ds[i], dim=-1) * torch.norm(ds[j], dim=-1)
            cosines.append(((ds[i] * ds[j]).sum(dim=-1) / prod.clamp(min=1e-6)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    n = len(experts)
    denominator = 1 + (n - 1) * cos
    singular = denominator.abs() < 1e-6
    t = torch.where(singular, torch.zeros_like(cos), n * cos / torch.where(singular, 1, denominator))
    mean = sum(es) / n
    return (t * mean + (1 - t) * b).reshape(base.shape).to(base.dtype)



@register("nearswap", NearSwapConfig, _validate_nearswap)
def nearswap(base: torch.Tensor, experts: list[torch.Tensor], cfg: NearSwapConfig, gen: torch.Generator) -> torch.Tensor:
    """NearSwap (mergekit's ``nearswap``): entry by entry, the base moves toward the one expert by at most ``t``.

        w      = clamp(t / max(|e - b|, 1e-6), 0, 1)
        merged = w * e + (1 - w) * b

    Where the two are within ``t`` of each other (w = 1) the entry is the expert's; farther apart it moves
    ``t`` toward it, so entries where the fine-tune changed much keep the base's value nearly. t = 0 gives the
    base. In float32, in mergekit's order of operations (the same tensors as mergekit 0.1.5)."""
    (expert,) = experts
    b, e = base.float(), expert.float()
    w = (float(cfg.t) / (b - e).abs().clamp(min=1e-6)).clamp(min=0, max=1)
    return (w * e + (1 - w) * b).to(base.dtype)
