"""Compiled fast paths (numba) for DARE's row-block merges, the random draws and DELLA's ranks, bit for bit.

The methods' definitions are the torch functions in ``task_vector.py``, ``sparsify.py``, ``select.py`` and
``draws.py``; this module computes the same bits in one pass per block instead of a dozen. Every torch operation there
is a full pass over the block through memory, so a block's cost is its dozen passes, not its arithmetic.
The kernel here reads each input entry once and keeps the rest in registers.

* ``keep(key, start, n, threshold)`` and ``uniform(key, start, n)``: the counter-based draws of
  ``draws.py`` (Threefry-2x32-20 of each entry's index under the tensor's and expert's key) in one pass in
  uint32 arithmetic, which the compiler vectorizes across entries; the mask comes from the integers
  (``draws.keep_threshold``) without the float tensor and the comparison pass. Held to the torch definition
  bit for bit by tests/methods/test_draws.py.
* ``merge_rows(...)``: ``b + lambda * combine(s_1..s_N)`` for one block of DARE (dare_ties, dare_linear),
  where ``s_i`` is d_i = e_i - b kept by its keep mask (then divided by its density), and combine is TIES'
  election and disjoint mean or sum (``disjoint_merge``, sign_rule sum) or the weighted sum
  (``weighted_sum``). TIES itself runs its torch definition: a compiled trim and count gained it less than
  the 2x a fast path must pay for (benchmarks/RESULTS.md). The operations and their
  order are the torch code's, in float32 without fused multiply-adds; in particular the sums over the
  experts' axis add the rows in order from +0.0 (``task_vector.sum_in_order``). The kernel takes up to
  ``MAX_EXPERTS`` experts (its working stack holds a block of each); the callers run the torch code beyond.
* ``placed_by_rank(rows, by_rank)``: DELLA's keep probabilities placed by each entry's magnitude rank in its
  row (``sparsify._placed_by_rank``), the order found by a radix sort of the float bits instead of a sort.

Everything here is optional: without numba (``import numba`` fails, or MERGEVAL_NUMBA=0) ``available()``
is false and the callers run their torch code, which gives the same bits. Compiled code is cached next to
this file (numba's ``cache=True``), so a machine compiles each kernel once.
"""

from __future__ import annotations

import functools
import math
import os
import threading

import numpy as np
import torch

from mergeval.methods import draws

MAX_EXPERTS = 16
MIN_ENTRIES = 1 << 18  # the engine's BLOCK_MIN: the tensors merged in row blocks
_thread = threading.local()  # ``off``: this thread takes the torch code whatever the kernels' availability


def off(flag: bool = True) -> None:
    """Leave (``flag``) the compiled path to the torch code on this thread: ``usable`` and ``loaded`` answer
    False here, so every tensor this thread merges runs the methods' torch definitions, as on a GPU. The
    engine's test hook for its device path on the CPU (execute.Device's ``torch_only``); the bits are the same."""
    _thread.off = flag


def usable(numel: int) -> bool:
    """Whether to take the compiled path for a tensor of ``numel`` entries: numba's import and its kernels'
    first load are a fixed cost per process, which only tensors of MIN_ENTRIES or more repay. Once a larger
    tensor has loaded them, tensors down to an eighth of that take them too (``loaded``)."""
    if getattr(_thread, "off", False):
        return False
    return (numel >= MIN_ENTRIES and available()) or loaded(numel)


def loaded(numel: int) -> bool:
    """Whether the kernels are already loaded in this process and a tensor of ``numel`` entries is worth them
    (MIN_ENTRIES / 8 or more). The load was the only reason to leave such a tensor to torch's code, which is
    many times slower per entry than the kernel: left there, small projections (SmolLM2-135M's key and value
    projections are 5% of its entries) would take a share of a merge's CPU time far beyond their size. Which
    path a tensor takes never changes its bits (the kernels compute torch's)."""
    if getattr(_thread, "off", False):
        return False
    return numel >= MIN_ENTRIES // 8 and _kernels.cache_info().currsize > 0


@functools.cache
def available() -> bool:
    """Whether the compiled kernels can run here: numba imports, MERGEVAL_NUMBA is not 0, and numba can keep
    its cache (with ``cache=True`` it refuses to compile where neither this package's __pycache__ nor its
    user cache directory is writable)."""
    if os.environ.get("MERGEVAL_NUMBA", "1") == "0":
        return False
    try:
        _kernels()
    except (ImportError, RuntimeError, OSError):
        return False
    return True


@functools.cache
def _kernels():
    """The compiled kernels (numba compiles them once per machine and caches them); ImportError without numba.

    numba's CPU target loads its registries here, not in the first kernel call; a merge loads them before its
    workers start (``execute._load_kernels_first``)."""
    from mergeval.methods import fused_kernels

    _load_registries()
    return fused_kernels.keep_mask, fused_kernels.merge_rows, fused_kernels.place_by_rank, fused_kernels.uniforms


def _load_registries() -> None:
    """What numba does at the first call of any compiled function, done here (in ``_kernels``) instead of
    inside that call: its CPU target loads its registries of implementations."""
    try:
        from numba.core.compiler_lock import global_compiler_lock
        from numba.core.registry import cpu_target

        with global_compiler_lock:  # as numba's own compiles refresh it: another thread may be loading too
            cpu_target.target_context.refresh()
    except Exception:  # noqa: BLE001, S110  numba's internals moved: the first kernel call loads them as before
        pass


# ---------------------------------------------------------------- the draws


class CompiledDraws(draws.Draws):
    """``draws.Draws`` with its large draws on the CPU (``usable``) through the kernels below: the same bits
    (tests/methods/test_draws.py). What the engine hands the methods; the rest, and every draw on another device or on a
    thread that is ``off``, by the torch definition."""

    def uniform(self, expert, shape, start=0, device="cpu") -> torch.Tensor:
        n = math.prod(shape)
        if torch.device(device).type == "cpu" and usable(n):
            return uniform(self.key(expert), start, n).view(shape)
        return super().uniform(expert, shape, start, device)

    def keep(self, expert, shape, density, start=0, device="cpu") -> torch.Tensor:
        n = math.prod(shape)
        if torch.device(device).type == "cpu" and usable(n):
            return keep(self.key(expert), start, n, draws.keep_threshold(density)).view(shape)
        return super().keep(expert, shape, density, start, device)


def keep(key: tuple[int, int], start: int, n: int, threshold: int) -> torch.Tensor:
    """``draws.keep(key, start, n, density)`` (bool, flat) with ``threshold = draws.keep_threshold(density)``, in one
    compiled pass. Needs ``available()``."""
    out = torch.empty(n, dtype=torch.bool)  # torch's allocator, as merge_rows' working arrays
    _kernels()[0](key[0], key[1], start, threshold, out.numpy())
    return out


def uniform(key: tuple[int, int], start: int, n: int) -> torch.Tensor:
    """``draws.uniform(key, start, n)`` (float32, flat), in one compiled pass. Needs ``available()``."""
    out = torch.empty(n, dtype=torch.float32)
    _kernels()[3](key[0], key[1], start, out.numpy())
    return out


# ---------------------------------------------------------------- one block


class StackedRows(list):
    """The experts' rows of a block (a list, one tensor per expert), each a view of ``stacked``, one contiguous
    float32 tensor of shape (experts, *block): ``merge_rows`` reads them from it instead of copying each into a
    stack of its own (execute.Blocks reads them into it)."""

    stacked: torch.Tensor


class NonFinite(ValueError):
    """``merge_rows(..., refuse_nonfinite=True)`` met NaN or Inf in an input block (which input the caller's
    readers tell: execute.Blocks.merged)."""


def merge_rows(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weights: list[float],
    elect: bool,
    lambda_: float,
    masks: list[torch.Tensor | None] | None = None,
    divisors: list[float] | None = None,
    vote_weighted: bool = False,
    normalize: bool = True,
    divide_by: float = 0.0,
    refuse_nonfinite: bool = False,
) -> torch.Tensor:
    """The block ``b + lambda * combine(s_1..s_N)`` cast to the base's dtype (see the module's docstring).

    masks: per expert DARE's keep mask over the block (a bool tensor of its size) or None; divisors: per
    expert, divide its kept entries by this (0: do not); refuse_nonfinite: raise NonFinite when an input entry is
    NaN or Inf (the kernel counts them as it reads)."""
    kernel = _kernels()[1]
    n_exp, n = len(experts), base.numel()
    # working arrays from torch's allocator: arrays NumPy allocates in the engine's threads and a block
    # outlives fragmented glibc's heap (select.Appended)
    if isinstance(experts, StackedRows):
        e = experts.stacked.view(n_exp, n)
    else:
        e = torch.empty((n_exp, n), dtype=torch.float32)
        for i, x in enumerate(experts):
            e[i].copy_(x.reshape(-1))  # cast to float32 on the way
    masked = np.zeros(n_exp, dtype=np.bool_)
    # rows of experts without a mask are never read (masked[i] false)
    keep = torch.empty((n_exp, n if masks and any(m is not None for m in masks) else 1), dtype=torch.bool)
    for i, m in enumerate(masks or []):
        if m is not None:
            masked[i] = True
            keep[i].copy_(m.reshape(-1))
    out = torch.empty(n, dtype=torch.float32)
    nonfinite = np.zeros(n_exp + 1, dtype=np.int64)
    kernel(
        base.reshape(-1).float().numpy(),
        e.numpy(),
        masked,
        keep.numpy(),
        np.asarray(divisors or [0.0] * n_exp, np.float32),
        np.asarray(weights, np.float32),
        all(x == 1.0 for x in weights),
        vote_weighted,
        elect,
        normalize,
        np.float32(divide_by),
        np.float32(lambda_),
        out.numpy(),
        nonfinite,
    )
    if refuse_nonfinite and nonfinite.any():
        raise NonFinite("an input of the block holds NaN or Inf")
    return out.view(base.shape).to(base.dtype)


# ---------------------------------------------------------------- DELLA's ranks


def placed_by_rank(rows: torch.Tensor, by_rank: torch.Tensor) -> torch.Tensor | None:
    """``out[i, j] = by_rank[rank of |rows[i, j]| in row i]`` (stable ascending ranks: ties by position) for a
    float32 CPU tensor, as ``sparsify._placed_by_rank`` defines it, or None where an entry is not finite.

    A radix sort by the magnitudes' 31 bits instead of a comparison sort of 64-bit keys: a fixed number of
    passes however long the row, several times faster on an embedding whether ranked as one row or by rows;
    12 bytes of scratch per entry, as the keys and ``out`` of the sort."""
    r, n = rows.shape
    index = torch.int32 if r * n < 2**31 else torch.int64
    # from torch's allocator, like merge_rows' working arrays (glibc's heap in the engine's threads)
    pa, pb = torch.empty(r * n, dtype=index), torch.empty(r * n, dtype=index)
    out = torch.empty((r, n), dtype=torch.float32)
    bits = rows.contiguous().view(torch.int32).numpy().reshape(-1).view(np.uint32)
    if not _kernels()[2](bits, n, by_rank.numpy(), pa.numpy(), pb.numpy(), out.numpy().reshape(-1)):
        return None
    return out
