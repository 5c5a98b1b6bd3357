"""Row-chunked TIES: one large tensor merged a block of rows at a time, bit for bit.

TIES' trim keeps the k largest |d_i| of the *whole* tensor, which is not a
rowwise rule, so its chunked form makes two passes over the row blocks first
(select.Threshold: a sample of |d_i|, then the count above the sampled bounds
and the few entries between them) to find each expert's exact threshold tau_i;
after that every step (trim, election, disjoint mean, cast) is elementwise and
each block is merged on its own. (DARE-TIES has no row form yet: drawing
expert i's uniforms block by block from a generator moved past the earlier
experts' draws gave other bits than the whole-tensor draw on the quickstart's
embedding, so DARE merges whole tensors.)

``plan(cfg, n_experts, numel, gen)`` returns None where the chunked form could
differ from the method's whole-tensor result (compat=mergekit, rescale=l1:
whole-tensor norms), and where the ties at a non-zero tau
need torch.topk's order: a third pass then gathers that expert's whole |d_i| (one tensor, not one per
input) for torch.topk, exactly as the whole-tensor trim.
"""

from __future__ import annotations

import dataclasses

import torch

from mergeval.methods import compat
from mergeval.methods.compat import expert_value
from mergeval.methods.registry import METHODS
from mergeval.methods.select import Threshold, keep_mask, keep_rule
from mergeval.methods.task_vector import disjoint_merge, kept_count


class TiesRows:
    """TIES (paper mode, rescale none): passes 0/1 find tau_i, then ``merge`` trims with {|d_i| > or >= tau_i}."""

    def __init__(self, cfg, n_experts: int, numel: int):
        self.cfg, self.n = cfg, numel
        self.k = [kept_count(d, numel) if d < 1.0 else None
                  for d in (expert_value(cfg, "density", i) for i in range(n_experts))]
        self.select = [Threshold(numel, k) if k is not None else None for k in self.k]
        self.passes = 2 if any(self.select) else 0
        self.rules: list[tuple[float, str] | None] = [None] * n_experts
        self.masks: list[torch.Tensor | None] = [None] * n_experts  # topk's kept set where ties need its order

    def observe(self, p: int, offset: int, base: torch.Tensor, experts: list[torch.Tensor]) -> None:
        """Pass 0 samples |d_i| of this block, pass 1 counts it against the sampled bounds, pass 2 copies
        it into the whole |d_i| of the experts whose ties need torch.topk (at flat ``offset``)."""
        b = base.float()
        for i, (sel, e) in enumerate(zip(self.select, experts)):
            if sel is None or (p == 2 and self.masks[i] is None):
                continue
            a = (e.float() - b).abs()
            if p == 2:
                self.masks[i][offset:offset + a.numel()] = a.reshape(-1)
            else:
                sel.sample(a) if p == 0 else sel.count(a)

    def end_pass(self, p: int) -> None:
        """After pass 1: each expert's (tau_i, rule), or a third pass for its whole |d_i| (ties at a non-zero
        tau need topk's order); after pass 2: those experts' kept sets by torch.topk, as trim_to_density."""
        for i, (sel, k) in enumerate(zip(self.select, self.k)):
            if sel is None:
                continue
            if p == 1:
                found = sel.result()
                rule = keep_rule(*found, k) if found else None
                self.rules[i] = (found[0], rule) if rule else None
                if rule is None:
                    self.masks[i], self.passes = torch.empty(self.n), 3
            elif p == 2 and self.masks[i] is not None:
                keep = torch.zeros(self.n, dtype=torch.bool)
                keep[self.masks[i].topk(k, sorted=False).indices] = True
                self.masks[i] = keep

    def sparse(self, d: torch.Tensor, i: int, offset: int) -> torch.Tensor:
        """t_i = d_i where kept (trim_to_density's values), else 0."""
        if self.masks[i] is not None:
            keep = self.masks[i][offset:offset + d.numel()].view_as(d)
        elif self.rules[i] is not None:
            keep = keep_mask(d.abs(), *self.rules[i])
        else:
            return d
        return torch.where(keep, d, torch.zeros_like(d))

    def merge(self, offset: int, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
        """b + lambda * disjoint_merge(t_1..t_N), cast to the base's dtype (as ties())."""
        b = base.float()
        sparse = [self.sparse(e.float() - b, i, offset) for i, e in enumerate(experts)]
        return (b + self.cfg.lambda_ * disjoint_merge(torch.stack(sparse), self.cfg)).to(base.dtype)


def ties_rows(cfg, n_experts: int, numel: int, gen: torch.Generator) -> TiesRows | None:
    """TIES in row blocks, for paper mode without the L1 rescale (else None)."""
    if compat.is_mergekit(cfg) or cfg.rescale == "l1":
        return None
    return TiesRows(cfg, n_experts, numel)


METHODS["ties"] = dataclasses.replace(METHODS["ties"], rows=ties_rows)
