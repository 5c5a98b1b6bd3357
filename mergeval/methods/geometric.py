"""Geometric methods: SLERP and NearSwap between the base and one expert, Model Stock, and mergekit's
spherical ones: NuSLERP (two models), Multi-SLERP (any number) and the Karcher mean.

Notation as in ``task_vector.py``, per tensor: ``b`` the base, ``e_i`` expert i
(i = 1..N), ``d_i = e_i - b``, ``w_i`` its weight. Each tensor is treated as one flattened vector
(Model Stock and NuSLERP optionally per row). SLERP and Model Stock run in float32 with dot products
and norms accumulated in float64; NearSwap, NuSLERP, Multi-SLERP and the Karcher mean are mergekit's
own methods and run in float32 in mergekit's order of operations. The result is cast back to the
base's dtype.

``include_base`` (NuSLERP, Multi-SLERP, Karcher): the base is one more point on the sphere rather than
the origin of the task vectors, as a mergekit configuration without ``base_model`` (Karcher: with it)
has it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergeval.core.errors import UserError
from mergeval.methods import compat
from mergeval.methods.compat import expert_weights
from mergeval.methods.draws import Draws
from mergeval.methods.registry import Mergekit, register
from mergeval.methods.task_vector import _check_weights

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
class NuSlerpConfig:
    name: str = "nuslerp"
    weights: list[float] | None = None  # the two models' weights (null: 1 each); t = w_2 / (w_1 + w_2)
    nuslerp_flatten: bool = True  # true: one angle per tensor; false: one per row (or column, nuslerp_row_wise)
    nuslerp_row_wise: bool = False  # with nuslerp_flatten=false: one angle per slice along dim 0 (a matrix's columns)
    include_base: bool = False  # false: slerp the two experts' task vectors, add to b; true: slerp b and one expert
    compat: str = "paper"  # both modes are the same: the method is mergekit's own


@dataclass
class MultiSlerpConfig:
    name: str = "multislerp"
    weights: list[float] | None = None  # one per model (null: 1 each)
    normalize_weights: bool = True  # divide the weights by their sum
    eps: float = 1e-8  # added to each norm before dividing by it
    include_base: bool = False  # false: task vectors around b; true: the base is one more point, no origin
    compat: str = "paper"  # both modes are the same: the method is mergekit's own


@dataclass
class KarcherConfig:
    name: str = "karcher"
    max_iter: int = 10  # fixed-point iterations at most
    tol: float = 1e-5  # stop when the tangent step is shorter; norms at or below it leave the mean
    include_base: bool = False  # true: the base is averaged too (as the last model: mergekit adds base_model last)
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
        raise UserError(
            "modelset.experts",
            f"slerp interpolates the base and exactly one expert, got {n_experts}",
            "list exactly one expert in the modelset",
        )


def _validate_nearswap(cfg: NearSwapConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    if not (math.isfinite(cfg.t) and cfg.t >= 0):
        raise UserError("method.t", f"must be a distance of 0 or more, got {cfg.t}", "set e.g. method.t=0.0001")
    if n_experts != 1:
        raise UserError(
            "modelset.experts",
            f"nearswap moves the base toward exactly one expert, got {n_experts}",
            "list exactly one expert in the modelset",
        )


def _count_models(cfg, n_experts: int, name: str, at_least: int, at_most: int | None = None) -> None:
    """The merged models (the experts, and the base with include_base=true) number at_least..at_most, and the
    weights, where the config has them, are one per model."""
    compat.check_compat(cfg)
    n = n_experts + (1 if cfg.include_base else 0)
    if n < at_least or (at_most is not None and n > at_most):
        wanted = f"exactly {at_least}" if at_most == at_least else f"at least {at_least}"
        counted = "the experts and the base (include_base=true)" if cfg.include_base else "the experts"
        raise UserError(
            "modelset.experts",
            f"{name} merges {wanted} models, got {n}: {counted}",
            "change the experts, or method.include_base (true: the base is one of the models)",
        )
    if hasattr(cfg, "weights"):
        _check_weights(cfg.weights, n)


def _validate_nuslerp(cfg: NuSlerpConfig, n_experts: int) -> None:
    _count_models(cfg, n_experts, "nuslerp", 2, 2)


def _validate_multislerp(cfg: MultiSlerpConfig, n_experts: int) -> None:
    _count_models(cfg, n_experts, "multislerp", 1)
    if not (math.isfinite(cfg.eps) and cfg.eps >= 0):
        raise UserError(
            "method.eps", f"must be a finite number of 0 or more, got {cfg.eps}", "set e.g. method.eps=1e-8"
        )
    if cfg.normalize_weights and cfg.weights is not None and sum(cfg.weights) == 0:
        raise UserError(
            "method.weights",
            "weights sum to 0 and method.normalize_weights=true",
            "use weights with a non-zero sum or set method.normalize_weights=false",
        )


def _validate_karcher(cfg: KarcherConfig, n_experts: int) -> None:
    _count_models(cfg, n_experts, "karcher", 1)
    if isinstance(cfg.max_iter, bool) or not isinstance(cfg.max_iter, int) or cfg.max_iter < 0:
        raise UserError(
            "method.max_iter", f"must be a whole number of 0 or more, got {cfg.max_iter}", "set e.g. method.max_iter=10"
        )
    if not (math.isfinite(cfg.tol) and cfg.tol >= 0):
        raise UserError(
            "method.tol", f"must be a finite number of 0 or more, got {cfg.tol}", "set e.g. method.tol=1e-5"
        )


def _validate_model_stock(cfg: ModelStockConfig, n_experts: int) -> None:
    compat.check_compat(cfg)
    if n_experts < 2:
        raise UserError(
            "modelset.experts",
            f"model_stock needs at least 2 fine-tuned experts besides the base, got {n_experts}",
            "add another expert fine-tuned from the same base",
        )


@register("slerp", SlerpConfig, _validate_slerp, mergekit=Mergekit("slerp", base="listed"))
def slerp(base: torch.Tensor, experts: list[torch.Tensor], cfg: SlerpConfig, gen: Draws) -> torch.Tensor:
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


@register("model_stock", ModelStockConfig, _validate_model_stock, mergekit=Mergekit("model_stock"))
def model_stock(base: torch.Tensor, experts: list[torch.Tensor], cfg: ModelStockConfig, gen: Draws) -> torch.Tensor:
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
            cosines.append(
                torch.where(prod > 0, dot / prod.where(prod > 0, torch.ones_like(prod)), torch.zeros_like(prod))
            )
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


@register("nearswap", NearSwapConfig, _validate_nearswap, mergekit=Mergekit("nearswap", own=True, base="listed"))
def nearswap(base: torch.Tensor, experts: list[torch.Tensor], cfg: NearSwapConfig, gen: Draws) -> torch.Tensor:
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


# ---------------------------------------------------------------- mergekit's spherical methods

NUSLERP_COLINEAR = 1e-8  # colinear where 1 - cos^2 <= this squared: in float32, where cos^2 rounds to 1
NUSLERP_MIN_NORM = 1e-7  # a row's norm is clamped to at least this before normalising


def _points(base: torch.Tensor, experts: list[torch.Tensor], cfg, base_last: bool = False) -> list[torch.Tensor]:
    """The merged models in float32: the experts, with include_base=true the base too (first, or last)."""
    models = [e.float() for e in experts]
    if cfg.include_base:
        models = models + [base.float()] if base_last else [base.float()] + models
    return models


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=NUSLERP_MIN_NORM)


def nuslerp_pair(
    v0: torch.Tensor, v1: torch.Tensor, t: float, flatten: bool = True, row_wise: bool = False
) -> torch.Tensor:
    """Spherical interpolation of two tensors of one shape at ``t`` (0: v0, 1: v1), one angle per vector:
    the whole tensor (flatten), else each slice along the last dim, or along dim 0 (row_wise).

        u_k    = v_k / max(|v_k|, 1e-7),  cos = clamp(<u_0, u_1>, -1, 1),  theta = arccos(cos)
        result = (sin((1 - t) theta) v_0 + sin(t theta) v_1) / sin(theta)
        result = (1 - t) v_0 + t v_1                       where 1 - cos^2 <= 1e-16 (colinear)
    In float32, in mergekit's order of operations."""
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        v0, v1 = v0.transpose(0, -1), v1.transpose(0, -1)
    cos = (_unit_rows(v0) * _unit_rows(v1)).sum(dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos.square()) <= NUSLERP_COLINEAR**2
    theta = torch.acos(torch.where(colinear, 0, cos))  # the unused branch stays finite
    arc = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / torch.sin(theta)
    out = torch.where(colinear, (1 - t) * v0 + t * v1, arc)
    if row_wise and not flatten:
        out = out.transpose(0, -1)
    return out.reshape(shape)


@register("nuslerp", NuSlerpConfig, _validate_nuslerp, mergekit=Mergekit("nuslerp", own=True, base="optional"))
def nuslerp(base: torch.Tensor, experts: list[torch.Tensor], cfg: NuSlerpConfig, gen: Draws) -> torch.Tensor:
    """NuSLERP (mergekit's ``nuslerp``): spherical interpolation of two models with weights w_1, w_2.

        t      = w_2 / (w_1 + w_2)         (0.5 when |w_1 + w_2| < 1e-6)
        merged = b + slerp_t(d_1, d_2)     the two experts' task vectors (include_base=false)
        merged = slerp_t(b, e)             the base and the one expert (include_base=true; w_1 the base's)
    slerp_t(v_0, v_1) = (sin((1-t) theta) v_0 + sin(t theta) v_1) / sin(theta), theta the angle between
    v_0 and v_1, and (1-t) v_0 + t v_1 where they are colinear (1 - cos^2 <= 1e-16, see nuslerp_pair), over
    the whole tensor (nuslerp_flatten=true), else one angle per row (the last dim), or with
    nuslerp_row_wise=true per slice along dim 0 (a matrix's columns). Norms are interpolated with the
    angle. t outside [0, 1] extrapolates. The same tensors as mergekit 0.1.5."""
    v0, v1 = _points(base, experts, cfg)
    w = expert_weights(cfg, 2)
    total = sum(w)
    t = 0.5 if abs(total) < 1e-6 else w[1] / total
    b = base.float()
    if not cfg.include_base:
        v0, v1 = v0 - b, v1 - b
    out = nuslerp_pair(v0, v1, t, cfg.nuslerp_flatten, cfg.nuslerp_row_wise)
    return (out if cfg.include_base else b + out).to(base.dtype)


def multislerp_rows(points: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Multi-SLERP of the rows x_i of ``points`` (N, D) with weights ``w`` (N): barycentric interpolation on
    the sphere through the tangent space at the weighted mean direction.

        u_i = x_i / (|x_i| + eps),  m = sum_i w_i u_i,  mu = m / |m|
        v   = sum_i w_i (u_i - <u_i, mu> mu),  r = |v| + eps
        out = (cos(r) mu + sin(r) / r v) * sum_i w_i |x_i|
    None where |m| < eps (the weighted unit vectors cancel) and N > 2; with N = 2 then w_1 x_1 + w_2 x_2."""
    norms = torch.norm(points, dim=-1, keepdim=True)
    units = points / (norms + eps)
    column = w.view(-1, 1)
    mean = (units * column).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps:
        return points[0] * w[0] + points[1] * w[1] if len(points) == 2 else None
    mu = mean / mean_norm
    tangent = ((units - (units * mu).sum(-1, keepdim=True) * mu) * column).sum(0)
    r = torch.norm(tangent) + eps
    return (mu * torch.cos(r) + tangent * (torch.sin(r) / r)) * (norms.squeeze(-1) * w).sum()


@register(
    "multislerp", MultiSlerpConfig, _validate_multislerp, mergekit=Mergekit("multislerp", own=True, base="optional")
)
def multislerp(base: torch.Tensor, experts: list[torch.Tensor], cfg: MultiSlerpConfig, gen: Draws) -> torch.Tensor:
    """Multi-SLERP (mergekit's ``multislerp``): spherical interpolation of any number of models.

        x_i    = d_i (include_base=false) or the models b, e_1, ..., e_N (include_base=true)
        w_i   <- w_i / sum_j w_j                         (normalize_weights=true)
        u_i    = x_i / (|x_i| + eps),  mu = sum_i w_i u_i / |sum_i w_i u_i|
        v      = sum_i w_i (u_i - <u_i, mu> mu),  r = |v| + eps        (the tangent space at mu)
        merged = (cos(r) mu + sin(r) / r v) * sum_i w_i |x_i|   (+ b with include_base=false)
    The direction is exp_mu of the weighted mean tangent vector; the norm the weighted mean norm.
    One model: that model. Where sum_i w_i u_i vanishes (|.| < eps): w_1 x_1 + w_2 x_2 for two models,
    an error for more. Each tensor is one flattened vector. The same tensors as mergekit 0.1.5."""
    points = _points(base, experts, cfg)
    if len(points) == 1:
        return points[0].to(base.dtype)
    x = torch.stack(points)
    if not cfg.include_base:
        x -= base.float()
    w = torch.tensor(expert_weights(cfg, len(points)), dtype=x.dtype, device=x.device)
    if cfg.normalize_weights:
        w = w / w.sum()
    out = multislerp_rows(x.view(len(points), -1), w, float(cfg.eps))
    if out is None:
        raise UserError(
            "method.weights",
            "the weighted unit vectors of a tensor sum to 0 (antipodal models with weights that balance)",
            "use other weights, or other experts",
        )
    out = out.view(base.shape)
    return (out if cfg.include_base else out + base.float()).to(base.dtype)


def karcher_mean(points: list[torch.Tensor], max_iter: int, tol: float) -> torch.Tensor:
    """The Karcher (Riemannian) mean of the directions of ``points``, scaled by their mean norm.

        n_i = |x_i|,  u_i = x_i / n_i;  only points with n_i > tol count, each with weight a_i = 1 / K (K of them)
        mu_0 = sum_i a_i u_i / |sum_i a_i u_i|           (u_1 if that norm < tol)
        repeat at most max_iter times, stopping when |v| < tol:
            theta_i = arccos(clamp(<mu, u_i>, -1, 1))
            v       = sum_{i: theta_i >= tol} a_i theta_i / sin(theta_i) (u_i - cos(theta_i) mu)
                      (= sum_i a_i log_mu(u_i), the points at mu contributing nothing)
            mu     <- cos(|v|) mu + sin(|v|) v / |v|   (exp_mu v),  then mu / |mu| where |mu| > tol
        result = (sum_i n_i / N) mu                     (all N points; 0 when no point counts)
    A fixed point has sum_i a_i log_mu(u_i) = 0: a stationary point of sum_i a_i dist(mu, u_i)^2 on the sphere
    (its minimiser when the directions lie in an open hemisphere)."""
    n = len(points)
    if n == 1:
        return points[0]
    norms = [torch.linalg.vector_norm(x) for x in points]
    units = [torch.zeros_like(x) if float(r) == 0.0 else x / r for x, r in zip(points, norms)]
    counted = [i for i in range(n) if float(norms[i]) > tol]
    if not counted:
        return torch.zeros_like(points[0])
    share = sum(1.0 / n for _ in counted)
    alphas = [(1.0 / n) / share for _ in counted]
    us = [units[i] for i in counted]
    mean = torch.zeros_like(us[0])
    for a, u in zip(alphas, us):
        mean += a * u
    size = torch.linalg.vector_norm(mean)
    mu = us[0].clone() if float(size) < tol else mean / size
    for _ in range(max_iter):
        step = torch.zeros_like(mu)
        for a, u in zip(alphas, us):
            cos = torch.clamp(torch.dot(mu.flatten(), u.flatten()), -1.0, 1.0)
            theta = torch.arccos(cos)
            if float(theta) < tol:
                continue
            step += a * (theta / torch.sin(theta)) * (u - cos * mu)
        length = torch.linalg.vector_norm(step)
        if float(length) < tol:
            break
        mu = torch.cos(length) * mu + torch.sin(length) * (step / length)
        size = torch.linalg.vector_norm(mu)
        if float(size) > tol:
            mu = mu / size
    return sum((1.0 / n) * r for r in norms) * mu


@register("karcher", KarcherConfig, _validate_karcher, mergekit=Mergekit("karcher", own=True, base="averaged"))
def karcher(base: torch.Tensor, experts: list[torch.Tensor], cfg: KarcherConfig, gen: Draws) -> torch.Tensor:
    """Karcher mean (mergekit's ``karcher``): the Riemannian mean of the models' directions on the unit sphere,
    scaled by their mean norm, all models weighted equally.

        x_1..x_N = e_1, ..., e_N (and b last, include_base=true),  u_i = x_i / |x_i|
        mu       = argmin_{|mu| = 1} sum_i dist(mu, u_i)^2, by at most max_iter fixed-point steps
                   mu <- exp_mu(mean_i log_mu(u_i)) from the normalised mean, until |step| < tol
        merged   = (mean_i |x_i|) mu
    Models with a norm at or below tol leave the directions' mean (their norm still counts); one model is
    returned as it is. Each tensor is one flattened vector. The same tensors as mergekit 0.1.5
    (karcher_mean states the iteration)."""
    return karcher_mean(_points(base, experts, cfg, base_last=True), int(cfg.max_iter), float(cfg.tol)).to(base.dtype)
