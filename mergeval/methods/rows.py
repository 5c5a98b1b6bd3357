"""Row-chunked TIES, DARE and the elementwise methods: one large tensor merged a block of rows at a time, bit
for bit.

The engine hands a merger the tensor's row blocks (``prepare``), then asks it
for each block's merged rows (``merge``, on any thread, in any order); every
block's output equals the same rows of the method's whole-tensor result.

* TIES' trim keeps the k largest |d_i| of the *whole* tensor, which is not a
  rowwise rule, so ``TiesRows.prepare`` makes two passes over the blocks
  (select.Threshold: a sample of |d_i|, then the count above the sampled bounds
  and the few entries between them) to find each expert's exact threshold
  tau_i and how many entries equal to tau_i each block holds; the entries tied at
  the cut are kept by position (trim_to_density), so each block then knows how
  many of its own tied entries to keep, and every later step (trim, election,
  disjoint mean, cast) is elementwise.
* DARE draws one uniform per entry per expert, a function of the entry's index
  in the whole tensor (``draws.py``): each block draws its own keep masks at its
  offset when it is merged, so ``DareRows`` prepares nothing and its blocks are
  merged independently, in any order, on any thread.

* compat=mergekit (``GtaRows``: ties, dare_ties, dare_linear, task_arithmetic; up to 4 experts).
  mergekit's TIES keeps the entries tied at the cut in the order of torch's
  unstable sort of the whole tensor, and its DARE rescales by whole-tensor L1
  norms, so ``prepare`` takes each expert's whole d_i in turn to make its keep
  mask (one byte per entry) and L1 factor as the whole-tensor code does (DARE
  without the L1 rescale needs neither: each block draws its own masks);
  every later step (compat.gta: the weights, the election, the sums over experts
  per entry) is elementwise. Peak memory is then one expert's whole-tensor rule
  (its d_i, |d_i| and argsort) instead of every input's float32 copies at once.

The ``rows`` hooks return None where the chunked form could differ from the
whole-tensor result (paper mode with rescale=l1: whole-tensor norms).

Where numba runs, DARE's draws and each DARE block's merge go through the compiled
kernels of ``fused.py`` (one pass per block instead of a dozen torch passes;
the same bits, held to this torch code by tests/methods/test_fused.py, test_rows.py and
test_draws.py); ``fused_options`` says when they apply. TIES runs this torch code.
"""

from __future__ import annotations

import dataclasses

import torch

from mergeval.methods import compat, draws, fused
from mergeval.methods.compat import expert_value, expert_weights
from mergeval.methods.draws import Draws
from mergeval.methods.registry import METHODS
from mergeval.methods.select import Threshold, exact, keep_only_, tie_quotas, zero_dropped_
from mergeval.methods.sparsify import _combine, _rescale, mergekit_gta_options
from mergeval.methods.task_vector import kept_count, mergekit_ties_options


class TiesRows:
    """TIES (paper mode, rescale none): ``prepare`` finds each tau_i and each block's share of the tied entries."""

    def __init__(self, cfg, n_experts: int, numel: int):
        self.cfg, self.n = cfg, numel
        self.k = [
            kept_count(d, numel) if d < 1.0 else None
            for d in (expert_value(cfg, "density", i) for i in range(n_experts))
        ]
        self.cut: list[tuple[float, dict[int, int]] | None] = [None] * n_experts  # (tau_i, offset -> tie quota)
        # the cut depends on the inputs and the kept counts only, not on lambda or weights: run_plan's
        # ``prepared`` reuses it for every candidate of a sweep with the same densities
        self.prepared_key = ("ties", numel, tuple(self.k))

    def prepared(self) -> list:
        return self.cut

    def restore(self, cut: list) -> None:
        self.cut = cut

    def prepare(self, blocks) -> None:
        """Pass 0 samples |d_i| block by block (computed at the sampled positions only), pass 1 counts each block
        against the sampled bounds."""
        select = {i: Threshold(self.n, k) for i, k in enumerate(self.k) if k is not None}
        if not select:
            return
        offsets = []
        for _offset, base, experts in blocks.read_all():  # pass 0: |d_i| only where it is sampled
            b = base.reshape(-1)
            for i, sel in select.items():
                at = sel.positions(b.numel())
                sel.add_sample((experts[i].reshape(-1)[at].float() - b[at].float()).abs())
        for offset, base, experts in blocks.read_all():
            b = base.float()
            work = torch.empty(b.shape, dtype=b.dtype)  # |d_i| of this block, one expert after another; contiguous
            # whatever b's layout, so the count takes NumPy's path (select.Threshold._count_numpy)
            for i, sel in select.items():
                sel.count(torch.sub(experts[i].float(), b, out=work).abs_())
            offsets.append(offset)
        for i, sel in select.items():
            found = sel.result()
            if found is None:  # the sampled bounds missed (no known input does this): one more pass, exactly
                found, chunk_ties = self._exact(blocks, i, sel.k)
            else:
                chunk_ties = sel.chunk_ties
            tau, c_gt, _ = found
            quotas = tie_quotas(chunk_ties, sel.k - c_gt) if tau != 0 else [0] * len(offsets)
            self.cut[i] = (tau, dict(zip(offsets, quotas)))

    def _exact(self, blocks, i: int, k: int):
        whole = torch.cat(
            [(experts[i].float() - base.float()).abs().reshape(-1) for _, base, experts in blocks.read_all()]
        )
        tau, c_gt, c_eq = exact(whole, k)
        ties = [int((chunk == tau).sum()) for chunk in whole.split([n for n in blocks.numels()])]
        return (tau, c_gt, c_eq), ties

    def trim_(self, d: torch.Tensor, i: int, offset: int) -> torch.Tensor:
        """d_i trimmed in place: t_i = d_i where kept (trim_to_density's values), else 0."""
        cut = self.cut[i]
        if cut is not None:
            tau, quotas = cut
            zero_dropped_(d, tau, quotas[offset])
        return d

    def merge(self, offset: int, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
        """b + lambda * disjoint_merge(t_1..t_N), cast to the base's dtype (as ties()): ``_combine`` with this
        block's trim, done in place in each t_i's row of its stack."""
        return _combine(base, experts, self.cfg, None, True, lambda d, i: self.trim_(d, i, offset))


class DareRows:
    """DARE (dare_ties, dare_linear; paper mode, rescale inverse_density or none): ``merge`` is ``_combine`` on a
    block with dare_drop's keep masks of that block's entries (``gen.keep`` at the block's offset)."""

    def __init__(self, cfg, n_experts: int, numel: int, gen: Draws, elect: bool):
        self.cfg, self.gen, self.elect = cfg, gen, elect
        self.density = [expert_value(cfg, "density", i) for i in range(n_experts)]
        self.rescale = _rescale(cfg)
        self.checks_inputs = kernel_applies(cfg, numel, n_experts, elect)  # see fused_options

    def prepare(self, blocks) -> None:
        """Nothing: a block's draws depend on its entries' indices only, not on the blocks drawn before it."""

    def _sparsify(self, offset: int):
        def sparsify(d: torch.Tensor, i: int) -> torch.Tensor:
            """dare_drop's s_i, in d_i's own storage (zeroing the dropped entries is where(keep, d, 0))."""
            density = self.density[i]
            if density >= 1.0:  # dare_drop keeps d_i whole
                return d
            keep_only_(d, self.gen.keep(i, d.shape, density, start=offset, device=d.device))
            return d if self.rescale == "none" else d.div_(density)  # kept / density

        return sparsify

    def merge(self, offset: int, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
        if (options := fused_options(self.cfg, base, self.checks_inputs, len(experts), self.elect)) is not None:
            n = base.numel()
            masks = [
                None if d >= 1.0 else fused.keep(self.gen.key(i), offset, n, draws.keep_threshold(d))
                for i, d in enumerate(self.density)
            ]
            divisors = [0.0 if d >= 1.0 or self.rescale == "none" else d for d in self.density]
            return fused.merge_rows(base, experts, masks=masks, divisors=divisors, refuse_nonfinite=True, **options)
        return _combine(base, experts, self.cfg, None, self.elect, self._sparsify(offset))


def kernel_applies(cfg, numel: int, n_experts: int, elect: bool) -> bool:
    """Whether the compiled kernel merges this tensor's blocks wherever they are on the CPU: numba runs, the
    tensor has fused.MIN_ENTRIES entries or more, fused.MAX_EXPERTS experts or fewer, and TIES' election counts
    by sum. Such a row merger ``checks_inputs``: it refuses a block with NaN or Inf (``fused.NonFinite``), so the
    engine leaves out the readers' own pass over the blocks it gives it on the CPU (execute.Blocks)."""
    return fused.usable(numel) and n_experts <= fused.MAX_EXPERTS and (not elect or cfg.sign_rule == "sum")


def fused_options(cfg, base: torch.Tensor, kernel: bool, n_experts: int, elect: bool) -> dict | None:
    """``fused.merge_rows``'s combine options for ``_combine``'s paper-mode arithmetic on this config, or None
    where the compiled kernel does not apply (``kernel``: the row merger's ``kernel_applies``, decided once for
    the tensor, so every block agrees with its ``checks_inputs``; or the block is not on the CPU): the torch
    code then runs, the same bits."""
    if not kernel or base.device.type != "cpu":
        return None
    w = expert_weights(cfg, n_experts)
    if elect:
        return {
            "weights": w,
            "elect": True,
            "lambda_": cfg.lambda_,
            "vote_weighted": compat.option(cfg, "weights_before_election", False, True),
            "normalize": compat.option(cfg, "normalize", True, True, (True, False)),
        }
    return {
        "weights": w,
        "elect": False,
        "lambda_": cfg.lambda_,
        "divide_by": sum(w) if cfg.normalize and abs(sum(w)) >= 1e-8 else 0.0,
    }


class GtaRows:
    """compat.gta (compat=mergekit) in row blocks: ``prepare`` makes each expert's keep mask and L1 factor from
    its whole d_i, expert after expert (the module docstring); ``merge`` is gta on a block with them. A mask that
    depends on the entries' indices only (DARE's draws) without the L1 rescale is drawn by each block instead."""

    def __init__(self, cfg, n_experts: int, keep, apply, options: tuple, by_index: bool = False):
        """``keep(d, i, start)``: expert i's mask over d (bool of d's shape, or None: d kept whole), d its whole
        d_i (start 0) as the whole-tensor code makes it; ``apply(d, mask)``: how mergekit applies it; ``options``:
        gta's (rescale, sign rule, normalize). ``by_index``: ``keep`` reads only d's shape and ``start``, the flat
        index of its first entry (DARE's draws), so without the L1 rescale each block's d_i gets its own mask in
        ``merge`` and no expert is read whole."""
        self.cfg, self.keep, self.apply = cfg, keep, apply
        self.rescale, self.elect, self.normalize = options
        self.per_block = by_index and not self.rescale
        self.masks: list[torch.Tensor | None] = [None] * n_experts
        self.factors: list[torch.Tensor | None] = [None] * n_experts

    def prepare(self, blocks) -> None:
        if self.keep is None or self.per_block:
            return
        # the tensors as the whole-tensor merge gets them (``get``: an in-memory input keeps its layout, and a sum
        # over a transposed d_i adds in another order than over a contiguous copy)
        b = blocks.base.get(blocks.name).float()
        for i, expert in enumerate(blocks.experts):
            d = expert.get(blocks.name).float() - b  # gta's d_i, whole
            keep = self.keep(d, i, 0)
            if keep is None:
                continue
            self.masks[i] = keep.reshape(-1)
            if self.rescale:
                self.factors[i] = compat.l1_factor(d, self.apply(d, keep))  # match_l1's, on the whole tensor

    def merge(self, offset: int, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
        def sparsify(d: torch.Tensor, i: int) -> torch.Tensor:
            if self.per_block:
                keep = self.keep(d, i, offset)
                return d if keep is None else self.apply(d, keep)
            keep, factor = self.masks[i], self.factors[i]
            if keep is None:
                return d
            s = self.apply(d, keep[offset : offset + d.numel()].to(d.device))  # a no-op on the CPU
            return s if factor is None else s * factor

        return compat.gta(base, experts, self.cfg, sparsify if self.keep else None, False, self.elect, self.normalize)


def _chunkable(cfg) -> bool:
    """Paper mode without the L1 rescale: every step after the masks is elementwise."""
    return not compat.is_mergekit(cfg) and _rescale(cfg) != "l1"


# compat.gta sums over the experts with torch's sum(0), whose vectorized body adds 5 or more rows in another grouping
# than its scalar tail: an entry's sum then depends on where the tensor's size puts it, and a block is not the whole
# (paper mode sums in order instead: task_vector.sum_in_order). Up to 4 rows both add in expert order.
GTA_ROWS_MAX_EXPERTS = 4


def _gta_rows(cfg, n_experts: int) -> bool:
    return compat.is_mergekit(cfg) and n_experts <= GTA_ROWS_MAX_EXPERTS


def ties_rows(cfg, n_experts: int, numel: int, gen: Draws) -> TiesRows | GtaRows | None:
    """TIES in row blocks: paper mode without the L1 rescale, or compat=mergekit with up to 4 experts (else None)."""
    if _gta_rows(cfg, n_experts):
        return GtaRows(
            cfg,
            n_experts,
            lambda d, i, start: compat.magnitude_keep(d, expert_value(cfg, "density", i)),
            compat.times_mask,
            mergekit_ties_options(cfg),
        )
    return TiesRows(cfg, n_experts, numel) if _chunkable(cfg) else None


def dare_rows(elect: bool):
    def rows(cfg, n_experts: int, numel: int, gen: Draws) -> DareRows | GtaRows | None:
        """DARE in row blocks: paper mode without the L1 rescale, or compat=mergekit with up to 4 experts (else None)."""
        if _gta_rows(cfg, n_experts):
            return GtaRows(
                cfg,
                n_experts,
                lambda d, i, start: compat.bernoulli_keep(d, expert_value(cfg, "density", i), gen, i, start),
                compat.where_mask,
                mergekit_gta_options(cfg, elect),
                by_index=True,
            )
        return DareRows(cfg, n_experts, numel, gen, elect) if _chunkable(cfg) else None

    return rows


class ElementwiseRows:
    """A method every step of which is elementwise (task arithmetic, linear): a block's merge is the method's
    function on that block, nothing to prepare. The whole tensor is never held (its float32 working copies
    were fresh allocations the size of the embeddings, which the kernel zeroes page by page)."""

    def __init__(self, fn, cfg, gen: Draws):
        self.fn, self.cfg, self.gen = fn, cfg, gen

    def prepare(self, blocks) -> None:
        pass

    def merge(self, offset: int, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
        return self.fn(base, experts, self.cfg, self.gen)


def elementwise_rows(name: str):
    fn = METHODS[name].merge

    def rows(cfg, n_experts: int, numel: int, gen: Draws) -> ElementwiseRows | GtaRows | None:
        """The method in row blocks (compat=mergekit: task_arithmetic as gta with up to 4 experts; linear keeps the
        whole-tensor code)."""
        if not compat.is_mergekit(cfg):
            return ElementwiseRows(fn, cfg, gen)
        if name == "task_arithmetic" and _gta_rows(cfg, n_experts):
            return GtaRows(cfg, n_experts, None, None, (False, None, cfg.normalize))
        return None

    return rows


METHODS["task_arithmetic"] = dataclasses.replace(METHODS["task_arithmetic"], rows=elementwise_rows("task_arithmetic"))
METHODS["linear"] = dataclasses.replace(METHODS["linear"], rows=elementwise_rows("linear"))
METHODS["ties"] = dataclasses.replace(METHODS["ties"], rows=ties_rows)
METHODS["dare_ties"] = dataclasses.replace(METHODS["dare_ties"], rows=dare_rows(elect=True))
METHODS["dare_linear"] = dataclasses.replace(METHODS["dare_linear"], rows=dare_rows(elect=False))
