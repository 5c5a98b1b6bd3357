"""Parameter-space similarity of two task vectors, per tensor, per layer and overall.

Pure functions on torch tensors, no I/O. A task vector is a fine-tuned (or
merged) model's parameters minus the base model's: Delta_a = a - base,
Delta_b = b - base. All arithmetic is done in float64.

- ``task_vector_stats``: L2 distance, cosine similarity, sign-conflict rate and
  Subspace Alignment Ratio of Delta_a and Delta_b, for each tensor, for each
  transformer layer (``layers.<i>.`` in the name) and for the whole model.
- ``subspace_alignment_ratio`` / ``sar_rank``: the SAR used in the CMM paper's
  rebuttal (He et al., NeurIPS 2025), after Marczak et al., "No Task Left
  Behind: Isotropic Model Merging with Common and Task-Specific Subspaces".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
from torch import Tensor

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The i of the first ``layers.<i>.`` in a parameter name, or None.

    "model.layers.12.mlp.up_proj.weight" -> 12,   "lm_head.weight" -> None
    """
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def sar_rank(singular_values: Tensor, eps: float = 0.05) -> int:
    """Number k_M of top singular directions SAR projects onto.

        k_M = min { k : sum_{i=k+1}^{r} sigma_i^2 / sum_{i=1}^{r} sigma_i^2 <= eps^2 }

    i.e. the fewest directions that keep all but eps^2 of the energy (squared
    Frobenius norm). ``singular_values`` must be sorted in descending order,
    as ``torch.linalg.svd`` returns them. All-zero singular values give 0.
    Raises ValueError when eps < 0 or the input is not 1-D.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    s = singular_values.detach().to(torch.float64)
    if s.ndim != 1:
        raise ValueError(f"singular_values must be 1-D, got shape {tuple(s.shape)}")
    s2 = s * s
    # tails[k] = sum_{i > k} sigma_i^2 (1-based i), for k = 0..r-1; tails[0] is the total
    tails = torch.flip(torch.cumsum(torch.flip(s2, [0]), 0), [0])
    if s.numel() == 0 or tails[0] <= 0:
        return 0
    # tails is non-increasing, so the k failing the bound are exactly 0..k_M-1
    return int((tails > eps * eps * tails[0]).sum())


def _as_matrix(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1)


def subspace_alignment_ratio(delta_t: Tensor, delta_m: Tensor, eps: float = 0.05) -> float | None:
    """Subspace Alignment Ratio of a task matrix with another's dominant subspace.

    As defined in the CMM paper's rebuttal:

        SAR(Delta_t, Delta_M; k_M) = || Pi_{k_M,M} Delta_t ||_F / || Delta_t ||_F

    where Delta_t is a task vector (expert minus base), Delta_M is the merged
    model minus the base, Pi_{k_M,M} = U_k U_k^T projects onto the span of the
    top k_M left-singular vectors U_k of Delta_M, and k_M = ``sar_rank(sigma(Delta_M),
    eps)`` with eps = 0.05. SAR is in [0, 1] (clamped against rounding); 1 means
    Delta_t lies wholly in Delta_M's dominant column space, 0 that it is
    orthogonal to it. SAR(D, D) = sqrt(1 - tail energy) >= sqrt(1 - eps^2),
    and is 1 when D has rank <= k_M.

    Choices where the text is silent: a tensor with more than 2 dimensions is
    read as the matrix (shape[0], prod(shape[1:])); a zero Delta_M gives k_M = 0
    and SAR 0; a zero Delta_t gives None (0/0). Raises ValueError on tensors
    with fewer than 2 dimensions (SAR is defined for matrices) or of
    different shapes.
    """
    if delta_t.shape != delta_m.shape:
        raise ValueError(f"shapes differ: {tuple(delta_t.shape)} vs {tuple(delta_m.shape)}")
    if delta_t.ndim < 2:
        raise ValueError(f"SAR is defined for matrices, got a {delta_t.ndim}-D tensor")
    return _sar(_as_matrix(delta_t.detach().to(torch.float64)), dominant_basis(delta_m, eps))


def _sar(t: Tensor, uk: Tensor) -> float | None:
    t_norm = torch.linalg.matrix_norm(t)
    if t_norm == 0:
        return None
    if uk.shape[1] == 0:
        return 0.0
    return min(float(torch.linalg.matrix_norm(uk @ (uk.T @ t)) / t_norm), 1.0)


def dominant_basis(delta_m: Tensor, eps: float = 0.05) -> Tensor:
    """U_k: the top k_M = ``sar_rank(sigma(M), eps)`` left-singular vectors of the matrix M of ``delta_m``
    (float64, shape (rows, k_M); k_M = 0 for a zero M).

    From the eigendecomposition of the smaller Gram matrix rather than an SVD: M M^T = U S^2 U^T when M has
    no more rows than columns, else M^T M = V S^2 V^T and U_k = M V_k S_k^-1. The same subspace (the
    singular values are the square roots of the eigenvalues, clamped at 0), much faster than an SVD on a
    transformer's matrices. Accurate where SAR looks: every kept sigma_k is at least eps ||M||_F / sqrt(rank)
    (else the tail after k-1 would already be within eps^2 of the energy), so its eigenvalue is far above
    float64's rounding of the largest one. With eps = 0 every singular value above rounding counts, and
    rounding (~1e-8 sigma_1 here, ~1e-16 sigma_1 in an SVD) decides k: use eps > 0."""
    m = _as_matrix(delta_m.detach().to(torch.float64))
    wide = m.shape[0] <= m.shape[1]
    values, vectors = torch.linalg.eigh(m @ m.T if wide else m.T @ m)
    sigma = values.clamp(min=0).flip(0).sqrt()  # descending
    vectors = vectors.flip(1)
    k = sar_rank(sigma, eps)
    if k == 0:
        return m.new_zeros((m.shape[0], 0))
    return vectors[:, :k] if wide else (m @ vectors[:, :k]) / sigma[:k]


_SUMS = ("numel", "dot", "sq_a", "sq_b", "sq_diff", "conflicts", "both_nonzero")


def _finish(sums: Mapping[str, float], sar_ab: list[float], sar_ba: list[float]) -> dict:
    """Turn accumulated sums (and SAR lists) into the reported statistics."""
    norm_a, norm_b = math.sqrt(sums["sq_a"]), math.sqrt(sums["sq_b"])
    cosine = None
    if norm_a > 0 and norm_b > 0:
        cosine = max(-1.0, min(1.0, sums["dot"] / norm_a / norm_b))
    both = sums["both_nonzero"]
    return {
        "numel": int(sums["numel"]),
        "l2": math.sqrt(sums["sq_diff"]),
        "norm_a": norm_a,
        "norm_b": norm_b,
        "cosine": cosine,
        "sign_conflict": sums["conflicts"] / sums["numel"] if sums["numel"] else None,
        "sign_conflict_nonzero": sums["conflicts"] / both if both else None,
        "sar_a_in_b": sum(sar_ab) / len(sar_ab) if sar_ab else None,
        "sar_b_in_a": sum(sar_ba) / len(sar_ba) if sar_ba else None,
    }


def task_vector_stats(
    base: Mapping[str, Tensor],
    a: Mapping[str, Tensor],
    b: Mapping[str, Tensor],
    eps: float = 0.05,
) -> dict:
    """Compare the task vectors Delta_a = a - base and Delta_b = b - base.

    For each tensor, and pooled over each layer and over the whole model:

        l2                    = || Delta_a - Delta_b ||_2 (= || a - b ||_2)
        norm_a, norm_b        = || Delta_a ||_2, || Delta_b ||_2
        cosine                = <Delta_a, Delta_b> / (||Delta_a|| ||Delta_b||)   (None if a norm is 0)
        sign_conflict         = #{j : Delta_a[j] != 0, Delta_b[j] != 0, sign differs} / #entries
        sign_conflict_nonzero = the same count / #{j : Delta_a[j] != 0 and Delta_b[j] != 0}
                                (None when no entry is non-zero in both)
        sar_a_in_b            = SAR(Delta_a, Delta_b; k_b), see ``subspace_alignment_ratio``
        sar_b_in_a            = SAR(Delta_b, Delta_a; k_a)

    SAR is asymmetric: with b the merged model and a an expert, ``sar_a_in_b``
    is exactly the paper's SAR of that expert. Pooled l2, norms, cosine and
    sign-conflict rates are those of the concatenated entries (sums of squares,
    dot products and counts are added up); pooled SAR is the unweighted mean
    of the per-tensor SARs that are defined -- matrices only: 1-D tensors
    (norms, biases) get SAR None, and so does a tensor whose task vector is 0.

    Returns ``{"per_tensor": {name: stats + {"layer": i or None}},
    "by_layer": {i: stats}, "overall": stats}``; tensors without
    ``layers.<i>.`` in the name (embeddings, final norm, lm_head) count only
    in "overall". Raises ValueError when the three mappings do not have the
    same names and shapes, or are empty.
    """
    if not (set(base) == set(a) == set(b)):
        names = set(base) | set(a) | set(b)
        odd = sorted(n for n in names if not (n in base and n in a and n in b))
        raise ValueError(f"base, a and b must hold the same tensors; not in all three: {odd[:10]}")
    return pairwise_stats(base, {"a": a, "b": b}, [("a", "b")], eps)["a~b"]


def pairwise_stats(
    base: Mapping[str, Tensor],
    models: Mapping[str, Mapping[str, Tensor]],
    pairs: list[tuple[str, str]],
    eps: float = 0.05,
) -> dict[str, dict]:
    """``task_vector_stats`` of each pair (a, b) of ``models``, keyed "a~b", in one pass over the tensors:
    each model's task vector and dominant basis (``dominant_basis``) are computed once per tensor, whatever
    the number of pairs it is in."""
    if not base:
        raise ValueError("no tensors to compare")

    def new_pool() -> dict:
        return {"sums": dict.fromkeys(_SUMS, 0.0), "ab": [], "ba": []}

    per_tensor: dict[str, dict[str, dict]] = {f"{a}~{b}": {} for a, b in pairs}
    layers: dict[str, dict[int, dict]] = {key: {} for key in per_tensor}
    overall = {key: new_pool() for key in per_tensor}
    used = sorted({m for pair in pairs for m in pair})
    for name in sorted(base):
        t0 = base[name]
        for m in used:
            if models[m][name].shape != t0.shape:
                raise ValueError(f"{name}: shapes differ: base {tuple(t0.shape)}, {m} {tuple(models[m][name].shape)}")
        t0 = t0.detach().to(torch.float64)
        deltas = {m: models[m][name].detach().to(torch.float64) - t0 for m in used}
        bases: dict[str, Tensor] = {}  # this tensor's, per model: computed at its first pair
        layer = layer_index(name)
        for a, b in pairs:
            key, da, db = f"{a}~{b}", deltas[a], deltas[b]
            sa, sb = torch.sign(da), torch.sign(db)
            sums = {
                "numel": float(da.numel()),
                "dot": float((da * db).sum()),
                "sq_a": float((da * da).sum()),
                "sq_b": float((db * db).sum()),
                "sq_diff": float(((da - db) ** 2).sum()),
                "conflicts": float((sa * sb < 0).sum()),
                "both_nonzero": float((sa * sb != 0).sum()),
            }
            ab: list[float] = []
            ba: list[float] = []
            if da.ndim >= 2:
                for m in (a, b):
                    if m not in bases:
                        bases[m] = dominant_basis(deltas[m], eps)
                ab = [x for x in [_sar(_as_matrix(da), bases[b])] if x is not None]
                ba = [x for x in [_sar(_as_matrix(db), bases[a])] if x is not None]
            per_tensor[key][name] = {**_finish(sums, ab, ba), "layer": layer}
            pools = [overall[key]] if layer is None else [overall[key], layers[key].setdefault(layer, new_pool())]
            for pool in pools:
                for k in _SUMS:
                    pool["sums"][k] += sums[k]
                pool["ab"] += ab
                pool["ba"] += ba
    return {
        key: {
            "per_tensor": per_tensor[key],
            "by_layer": {i: _finish(p["sums"], p["ab"], p["ba"]) for i, p in sorted(layers[key].items())},
            "overall": _finish(overall[key]["sums"], overall[key]["ab"], overall[key]["ba"]),
        }
        for key in per_tensor
    }
