"""Hierarchical integration (the medical-LLM paper, seeds/medical-llm-merging-eval.txt; arXiv 2511.13373).

Two experts A and B fine-tuned from one base ``b``. For each layer l (all
tensors ``model.layers.<l>.*`` together; every other tensor on its own):

1. Neuron alignment of the attention projections: B's attention heads are
   permuted to best match A's (see ``head_permutation``). A permutation of
   whole heads that keeps each query head with a key/value group is
   function-preserving, so B' computes exactly what B computes.
2. ``w_l = t_max * max(0, cos(d_A,l, d_B,l))`` where ``d_X,l = X_l - b_l`` is
   the layer's task vector (all its tensors flattened into one vector).
3. ``theta_l = (1 - w_l) A_l + w_l B'_l`` (cosine-weighted linear interpolation).

What the paper leaves open, and what we chose:
- The seed card names the method only. Step 2 follows the paper's published
  formula for ``w_l`` (as summarised publicly: the clipped cosine of the two
  deltas); reading it as the weight of B in a LERP from A (step 3) is ours.
  It makes the method asymmetric (A is the anchor: when the task vectors are
  orthogonal the layer stays A's), so the modelset's expert order matters.
  ``t_max`` (default 1, the paper) scales the weight.
- "Optimal transport alignment" with uniform marginals over the same number
  of heads has a permutation as an optimal plan (Birkhoff), so we solve it
  exactly as an assignment problem (Hungarian, scipy) on head similarities:
  first key/value groups (each with the best matching of its query heads),
  then query heads within matched groups. Similarity = sum of inner products
  of the heads' q/k/v rows and o_proj columns. ``align=none`` skips it.
- Fine-tunes of one base almost always align to the identity; alignment
  matters only for models whose heads were trained apart.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from mergeval.core.errors import UserError
from mergeval.methods.draws import Draws
from mergeval.methods.registry import Needs, register_layer

LAYER = re.compile(r"^(.*\.layers\.\d+\.)")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class HierarchicalConfig:
    name: str = "hierarchical"
    t_max: float = 1.0
    align: str = "heads"  # "heads": permute B's attention heads to match A's; "none"
    num_attention_heads: int | None = None  # null: read from the base's config.json
    num_key_value_heads: int | None = None


def _validate(cfg: HierarchicalConfig, n_experts: int) -> None:
    if n_experts != 2:
        raise UserError(
            "modelset.experts",
            f"hierarchical merges exactly 2 experts, got {n_experts}",
            "list two experts (A first: it is the anchor of the interpolation)",
        )
    if not (math.isfinite(cfg.t_max) and 0 <= cfg.t_max <= 1):
        raise UserError("method.t_max", f"must be in [0, 1], got {cfg.t_max}", "set e.g. method.t_max=1.0")
    if cfg.align not in ("heads", "none"):
        raise UserError("method.align", f"unknown alignment '{cfg.align}'", "use heads or none")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads is not None and kv is not None and (kv < 1 or heads % kv):
        raise UserError(
            "method.num_key_value_heads",
            f"{kv} does not divide {heads} attention heads",
            "leave both null to read them from the base's config.json",
        )


def cosine_weight(deltas_a: list[torch.Tensor], deltas_b: list[torch.Tensor], t_max: float) -> float:
    """w = t_max * max(0, <d_A, d_B> / (|d_A| |d_B|)) over the concatenated tensors; 0 if either is zero."""
    dot = sum(float((a.double() * b.double()).sum()) for a, b in zip(deltas_a, deltas_b))
    na = math.sqrt(sum(float(a.double().square().sum()) for a in deltas_a))
    nb = math.sqrt(sum(float(b.double().square().sum()) for b in deltas_b))
    if na == 0 or nb == 0:
        return 0.0
    return t_max * max(0.0, dot / (na * nb))


def _lerp(a: torch.Tensor, b: torch.Tensor, w: float) -> torch.Tensor:
    return ((1 - w) * a.float() + w * b.float()).to(a.dtype)


def hierarchical_tensor(
    base: torch.Tensor, experts: list[torch.Tensor], cfg: HierarchicalConfig, gen: Draws
) -> torch.Tensor:
    """A tensor outside the layers: theta = (1 - w) A + w B with w from this tensor's own task vectors."""
    a, b = experts
    return _lerp(a, b, cosine_weight([a.float() - base.float()], [b.float() - base.float()], cfg.t_max))


def _heads(tensors: dict[str, torch.Tensor], prefix: str, n_heads: int, n_kv: int):
    """Per query head and per kv group, the flattened parameters that move with it."""
    q = tensors[f"{prefix}self_attn.q_proj.weight"].float()
    hd = q.shape[0] // n_heads
    q_heads = [q.reshape(n_heads, hd, -1)[h].flatten() for h in range(n_heads)]
    o = tensors[f"{prefix}self_attn.o_proj.weight"].float()
    o_heads = [o.reshape(o.shape[0], n_heads, hd)[:, h].flatten() for h in range(n_heads)]
    groups = []
    for proj in ("k_proj", "v_proj"):
        w = tensors[f"{prefix}self_attn.{proj}.weight"].float()
        groups.append([w.reshape(n_kv, hd, -1)[g].flatten() for g in range(n_kv)])
    head_vecs = [torch.cat([qh, oh]) for qh, oh in zip(q_heads, o_heads)]
    group_vecs = [torch.cat([k, v]) for k, v in zip(*groups)]
    return head_vecs, group_vecs


def head_permutation(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str, n_heads: int, n_kv: int
) -> list[int]:
    """perm with B'[head h] = B[head perm[h]], maximising sum_h <A_h, B_perm[h]> over group-preserving perms."""
    from scipy.optimize import linear_sum_assignment

    per = n_heads // n_kv
    ha, ga = _heads(a, prefix, n_heads, n_kv)
    hb, gb = _heads(b, prefix, n_heads, n_kv)
    sim_heads = torch.stack([torch.stack([x @ y for y in hb]) for x in ha]).double().numpy()
    within: dict[tuple[int, int], list[int]] = {}
    sim_groups = torch.zeros(n_kv, n_kv, dtype=torch.float64).numpy()
    for g in range(n_kv):
        for g2 in range(n_kv):
            block = sim_heads[g * per : (g + 1) * per, g2 * per : (g2 + 1) * per]
            rows, cols = linear_sum_assignment(block, maximize=True)
            within[g, g2] = [g2 * per + int(c) for c in cols[rows.argsort()]]
            sim_groups[g, g2] = float(ga[g] @ gb[g2]) + float(block[rows, cols].sum())
    rows, cols = linear_sum_assignment(sim_groups, maximize=True)
    perm: list[int] = []
    for g, g2 in sorted(zip(rows.tolist(), cols.tolist())):
        perm.extend(within[g, int(g2)])
    return perm


def permute_heads(
    tensors: dict[str, torch.Tensor], prefix: str, perm: list[int], n_heads: int, n_kv: int
) -> dict[str, torch.Tensor]:
    """Apply a group-preserving head permutation to one layer's attention (function-preserving)."""
    per = n_heads // n_kv
    group_perm = [perm[g * per] // per for g in range(n_kv)]
    out = dict(tensors)
    for proj in PROJ:
        for kind in ("weight", "bias"):
            name = f"{prefix}self_attn.{proj}.{kind}"
            if name not in tensors or (proj == "o_proj" and kind == "bias"):
                continue
            t = tensors[name]
            idx = torch.tensor(perm if proj in ("q_proj", "o_proj") else group_perm)
            if proj == "o_proj":
                hd = t.shape[1] // n_heads
                out[name] = t.reshape(t.shape[0], n_heads, hd)[:, idx].reshape(t.shape)
            else:
                n = n_heads if proj == "q_proj" else n_kv
                out[name] = t.reshape(n, t.shape[0] // n, *t.shape[1:])[idx].reshape(t.shape)
    return out


@register_layer("hierarchical", HierarchicalConfig, _validate, merge=hierarchical_tensor, needs=Needs(head_counts=True))
def hierarchical(
    base: dict[str, torch.Tensor], experts: list[dict[str, torch.Tensor]], cfg: HierarchicalConfig, gen: Draws
) -> dict[str, torch.Tensor]:
    """One layer: align B's heads to A's, w_l from the layer's task vectors, theta_l = (1 - w_l) A_l + w_l B'_l."""
    a, b = experts
    names = sorted(n for n in base if base[n].is_floating_point())
    layer = LAYER.match(names[0]) if names else None
    prefix = layer.group(1) if layer else ""
    if cfg.align == "heads" and f"{prefix}self_attn.q_proj.weight" in base:
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        assert heads is not None and kv is not None, "fill_head_counts reads the head counts from the base"
        perm = head_permutation(a, b, prefix, heads, kv)
        if perm != sorted(perm):
            b = permute_heads(b, prefix, perm, heads, kv)
    w = cosine_weight(
        [a[n].float() - base[n].float() for n in names], [b[n].float() - base[n].float() for n in names], cfg.t_max
    )
    return {n: (_lerp(a[n], b[n], w) if base[n].is_floating_point() else base[n].clone()) for n in base}


def fill_head_counts(cfg: HierarchicalConfig, model_config: dict) -> HierarchicalConfig:
    """Head counts from the base's config.json where the method config leaves them null."""
    import dataclasses

    for key in ("num_attention_heads", "num_key_value_heads"):  # given where the config.json says otherwise
        given, actual = getattr(cfg, key), model_config.get(key)
        if given is not None and actual is not None and given != actual:
            raise UserError(
                f"method.{key}",
                f"is {given} but the base's config.json says {actual}",
                f"leave it null (read from the base) or set it to {actual}",
            )
    heads = cfg.num_attention_heads or model_config.get("num_attention_heads")
    kv = cfg.num_key_value_heads or model_config.get("num_key_value_heads") or heads
    if cfg.align == "heads" and (heads is None or kv is None or heads % kv):
        raise UserError(
            "method.num_attention_heads",
            "cannot tell the attention head counts",
            "set method.num_attention_heads and method.num_key_value_heads, or method.align=none",
        )
    return dataclasses.replace(cfg, num_attention_heads=heads, num_key_value_heads=kv)
