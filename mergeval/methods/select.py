"""Exact top-k selection by a threshold, without sorting or ``topk`` over the whole tensor.

The k entries of largest magnitude are {a > tau} plus some of the entries equal
to tau, where tau is the k-th largest |d|. ``Threshold`` finds tau exactly from
a strided sample (candidate bounds lo <= tau <= hi, verified by counting) and a
``kthvalue`` over the few entries between the bounds; the data may arrive in
chunks, seen twice (``sample`` on every chunk, then ``count`` on every chunk),
so a tensor streamed in row blocks never has to be whole in memory.

Two tie orders at the cut:

* **by position** (``first_k_mask``, paper mode): of the entries equal to tau,
  the m = k - #{a > tau} first in row-major order are kept, i.e. exactly the
  first k of a *stable* descending sort. It needs only the count of tied
  entries per chunk, so it is computed chunk by chunk, on any machine the same.
* **a caller's sort order** (``top_k_mask``, compat=mergekit): the kept set is
  decided without a tie order when it is unambiguous, and None otherwise, when
  the caller must use its own sort (mergekit's argsort):

      c_gt = #{a > tau}, c_eq = #{a == tau}, m = k - c_gt tied entries to keep
      tau == 0:      keep a > tau   (the tied entries are zeros: kept or not, every value is the same)
      m == c_eq:     keep a >= tau  (every tied entry is kept)
      otherwise:     ambiguous: the caller uses its own tie order (torch.topk / argsort) instead

  so a mask from there equals, value for value, the one the caller's sort would give.
"""

from __future__ import annotations

import numpy as np
import torch


def kth_smallest(a: torch.Tensor, k: int) -> float:
    """The k-th smallest (1-based) of the finite values ``a``, as ``a.reshape(-1).kthvalue(k)`` gives it.

    On the CPU: non-negative float32 values (TIES' magnitudes) by ``_radix_kth``, others by NumPy's introselect
    (``np.partition``); the same order statistic as ``kthvalue``, without its sort."""
    flat = a.reshape(-1)
    if flat.device.type != "cpu" or flat.dtype not in (torch.float32, torch.float64):
        return float(flat.kthvalue(k).values)
    v = flat.numpy()
    found = _radix_kth(v, k) if flat.dtype == torch.float32 else None
    return float(np.partition(v, k - 1)[k - 1]) if found is None else found


def _radix_kth(v: np.ndarray, k: int) -> float | None:
    """The k-th smallest of a float32 array whose values are all non-negative and finite (else None), by a
    radix selection: such values order as their bit patterns, so count the entries by their upper 16 bits, then,
    in the bin that holds the k-th, by their lower 16 bits. Two counting passes whatever the values; an
    introselect slows several-fold on the many equal magnitudes that differences of bfloat16 weights give."""
    bits = v.view(np.uint32)
    high = bits >> 16
    per_high = np.bincount(high)
    if per_high.size > 0x7F80:  # a pattern of Inf, NaN or a negative number (the sign bit, -0.0 included)
        return None
    upto = np.cumsum(per_high)
    h = int(np.searchsorted(upto, k))  # the first bin with k entries at or below it
    rank = k - (int(upto[h - 1]) if h else 0)  # the k-th's rank within its bin
    upto_low = np.cumsum(np.bincount(bits[high == h] & 0xFFFF, minlength=1 << 16))
    low = int(np.searchsorted(upto_low, rank))
    return float(np.uint32((h << 16) | low).view(np.float32))


SAMPLE = 1 << 16  # sample size that bounds tau; the candidate window holds about 12 / sqrt(SAMPLE) of the entries
SMALL = 1 << 15  # below this many entries kthvalue over everything is cheaper than sampling


class Appended:
    """Values appended chunk by chunk into one buffer, grown by doubling, and read back whole or per chunk.

    The reason is memory, not speed: a tensor kept per chunk of a tensor streamed in row blocks (the samples and
    candidates of each expert's |d_i|) lies in glibc's heap between the blocks' freed buffers and keeps their
    pages from being reused or returned, so a TIES merge's resident memory grew with the number of experts
    (benchmarks/RESULTS.md, the whole run at Llama-3.2-3B's shapes)."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity  # entries of the first buffer (0: the first chunk's size)
        self.buf: torch.Tensor | None = None
        self.ends: list[int] = []  # where each chunk ends

    def slot(self, count: int, like: torch.Tensor) -> torch.Tensor:
        """The next chunk's ``count`` entries, to be filled by the caller (dtype and device of ``like``)."""
        used = self.ends[-1] if self.ends else 0
        if self.buf is None or used + count > self.buf.numel():
            size = max(used + count, self.capacity, 2 * (0 if self.buf is None else self.buf.numel()))
            grown = torch.empty(size, dtype=like.dtype, device=like.device)
            if self.buf is not None:
                grown[:used].copy_(self.buf[:used])
            self.buf = grown
        self.ends.append(used + count)
        return self.buf[used : used + count]

    def append(self, values: torch.Tensor) -> None:
        self.slot(values.numel(), values).copy_(values.reshape(-1))

    def values(self) -> torch.Tensor:
        """Every value appended, in order (a view of the buffer)."""
        return self.buf[: self.ends[-1]] if self.buf is not None and self.ends else torch.empty(0)

    def chunks(self) -> list[torch.Tensor]:
        whole = self.values()
        return [whole[a:b] for a, b in zip([0, *self.ends[:-1]], self.ends)]


class Threshold:
    """The k-th largest of n non-negative values seen in chunks: ``sample`` each chunk, ``count`` each chunk,
    then ``result()`` -> (tau, c_gt, c_eq), or None when the sampled bounds missed (call ``exact`` instead)."""

    def __init__(self, n: int, k: int):
        if not 1 <= k <= n:
            raise ValueError(f"k={k} outside 1..{n}")
        self.n, self.k = n, k
        self.stride = max(1, n // SAMPLE)
        self._sampled = 0  # chunks sampled so far: the seed of the next chunk's positions
        self._samples = Appended(-(-n // self.stride) + 4096)
        self.lo: float | None = None
        self.hi: float | None = None
        self.above = 0
        self._cands = Appended()
        self.chunk_ties: list[int] = []  # after result(): #{a == tau} in each counted chunk, in order

    def positions(self, numel: int) -> torch.Tensor:
        """Where pass 1 samples the next chunk of ``numel`` values: about numel / stride flat positions drawn
        from a fixed seed (a regular stride would follow the columns of a matrix, whose scales differ)."""
        count = -(-numel // self.stride)
        return torch.randint(0, numel, (count,), generator=torch.Generator().manual_seed(self._sampled))

    def add_sample(self, values: torch.Tensor) -> None:
        """Pass 1: the chunk's values at ``positions`` (a caller may compute only those)."""
        self._samples.append(values)
        self._sampled += 1

    def sample(self, a: torch.Tensor) -> None:
        """Pass 1 on a whole chunk: its values at ``positions``."""
        flat = a.reshape(-1)
        self.add_sample(flat[self.positions(flat.numel())])

    def bounds(self) -> tuple[float, float]:
        """lo/hi: sample ranks k/n of the way down, widened by 6 standard deviations of the rank (+8)."""
        s, self._samples = self._samples.values(), Appended()
        m = s.numel()
        centre = self.k / self.n * m
        margin = 6.0 * (m * (self.k / self.n) * (1 - self.k / self.n)) ** 0.5 + 8

        def descending(rank: int) -> float:  # s sorted descending, at 0-based rank (two selections, no sort)
            return kth_smallest(s, m - rank)

        hi = descending(max(0, int(centre - margin))) if centre - margin >= 1 else float("inf")
        lo = descending(min(m - 1, int(centre + margin))) if centre + margin < m - 1 else float("-inf")
        self.lo, self.hi = lo, hi
        # the candidates' buffer sized once from the sample's share between the bounds, with a quarter to
        # spare: it grows by doubling if that falls short
        share = int(((s >= lo) & (s <= hi)).sum()) / max(m, 1)
        self._cands.capacity = int(self.n * share * 1.25) + 4096
        return lo, hi

    def bounds_for_count(self) -> tuple[float, float]:
        """(lo, hi) for pass 2, from the samples the first time."""
        if self.lo is None or self.hi is None:
            return self.bounds()
        return self.lo, self.hi

    def count(self, a: torch.Tensor) -> None:
        """Pass 2: count the values above hi and keep those in [lo, hi] (in order)."""
        lo, hi = self.bounds_for_count()
        flat = a.reshape(-1)
        if lo != float("-inf") and _plain_cpu_float32(flat):
            self._count_numpy(flat, lo, hi)
            return
        # one pass over all values (>= lo), the rest over those alone: about k/n of them. Copied into the
        # candidates' buffer either way: they outlive ``a``, which a caller may reuse as a buffer
        upper = flat[flat >= lo] if lo != float("-inf") else flat
        if hi == float("inf"):
            self._cands.append(upper)
            return
        below = upper <= hi
        self.above += upper.numel() - int(below.sum())
        self._cands.append(upper[below])

    def _count_numpy(self, flat: torch.Tensor, lo: float, hi: float) -> None:
        """``count`` with NumPy's comparisons (exact, and several times faster than torch's on one thread,
        whose mask work was a sizeable share of a TIES merge); the candidates are compressed straight into the
        candidates' buffer (``Appended``: no array kept per chunk between the temporaries)."""
        v = flat.numpy()
        upper = np.greater_equal(v, lo)
        band = upper
        if hi != float("inf"):
            band = np.less_equal(v, hi)
            band &= upper
        # a copy (``a`` may be a buffer its caller reuses)
        kept = self._cands.slot(int(np.count_nonzero(band)), flat)
        np.compress(band, v, out=kept.numpy())
        if band is not upper:
            self.above += int(np.count_nonzero(upper)) - kept.numel()

    def result(self) -> tuple[float, int, int] | None:
        """(tau, c_gt, c_eq), or None if the k-th largest is not among the candidates."""
        chunks, cands = self._cands.chunks(), self._cands.values()
        self._cands = Appended()
        r = self.k - self.above  # rank of tau among the candidates, 1 = largest
        if not 1 <= r <= cands.numel():
            return None
        tau = kth_smallest(cands, cands.numel() - r + 1)
        self.chunk_ties = [int((c == tau).sum()) for c in chunks]
        return float(tau), self.above + int((cands > tau).sum()), sum(self.chunk_ties)


def tie_quotas(chunk_ties: list[int], wanted: int) -> list[int]:
    """How many of each chunk's tied entries the first-by-position rule keeps: ``wanted`` in chunk order."""
    quotas = []
    for ties in chunk_ties:
        quotas.append(min(ties, wanted))
        wanted -= quotas[-1]
    return quotas


def first_ties_mask(a: torch.Tensor, tau: float, quota: int) -> torch.Tensor:
    """{a > tau} plus the first ``quota`` entries equal to tau in row-major order."""
    keep = a > tau
    if quota:
        flat = keep.view(-1)
        tied = (a.reshape(-1) == tau).nonzero().view(-1)
        flat[tied[:quota]] = True
    return keep


def first_ties_drop(a: torch.Tensor, tau: float, quota: int) -> torch.Tensor:
    """The complement of ``first_ties_mask``: {a <= tau} less the first ``quota`` entries equal to tau
    (one comparison pass where the mask and its negation take two)."""
    drop = a <= tau
    if quota:
        tied = (a.reshape(-1) == tau).nonzero().view(-1)
        drop.view(-1)[tied[:quota]] = False
    return drop


def zero_dropped_(d: torch.Tensor, tau: float, quota: int) -> torch.Tensor:
    """``d.masked_fill_(first_ties_drop(d.abs(), tau, quota), 0.0)``, bit for bit: every entry with
    |d| <= tau except the first ``quota`` with |d| == tau becomes +0.0, in place.

    For a float32 tensor on the CPU it works on the bits: with the sign bit cleared, the int32 patterns of
    non-NaN floats order as their magnitudes, so |d| > tau is ``bits & 0x7FFFFFFF > bits(tau)`` (a NaN, whose
    pattern is above every other, is kept, as ``NaN <= tau`` is false), and multiplying a pattern by the 0/1
    keep mask leaves it or makes it all zeros, +0.0. About five times faster than masked_fill_ here, whose
    scattered writes at a random half of the entries mispredict."""
    if not (_plain_cpu_float32(d) and 0.0 <= tau):
        return d.masked_fill_(first_ties_drop(d.abs(), tau, quota), 0.0)
    bits = d.numpy().reshape(-1).view(np.int32)
    magnitude = np.bitwise_and(bits, 0x7FFFFFFF)
    cut = np.float32(tau).view(np.int32)
    keep = np.greater(magnitude, cut)
    if quota:
        keep[np.flatnonzero(magnitude == cut)[:quota]] = True
    np.multiply(bits, keep.view(np.uint8), out=bits)
    return d


def keep_only_(d: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``d.masked_fill_(~keep, 0.0)``, bit for bit, in place: the entries outside the bool mask ``keep`` become
    +0.0. Float32 on the CPU: each entry's bit pattern times 0 or 1 (as in ``zero_dropped_``)."""
    if not (_plain_cpu_float32(d) and keep.dtype == torch.bool and keep.is_contiguous() and keep.shape == d.shape):
        return d.masked_fill_(~keep, 0.0)
    bits = d.numpy().reshape(-1).view(np.int32)
    np.multiply(bits, keep.numpy().reshape(-1).view(np.uint8), out=bits)
    return d


def _plain_cpu_float32(a: torch.Tensor) -> bool:
    """Whether ``a.numpy()`` is a view of ``a``'s own contiguous float32 storage."""
    return a.device.type == "cpu" and a.dtype == torch.float32 and a.is_contiguous() and not a.requires_grad


def first_k_mask(a: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the k largest of ``a`` (non-negative), ties at the cut by position: the first k of a stable
    descending sort, without the sort."""
    tau, c_gt, c_eq = kth_largest(a, k)
    rule = keep_rule(tau, c_gt, c_eq, k)
    if rule is not None:  # tied zeros, or every tied entry kept: kept or dropped, every value is the same
        return keep_mask(a, tau, rule)
    return first_ties_mask(a, tau, k - c_gt)


def exact(a: torch.Tensor, k: int) -> tuple[float, int, int]:
    """(tau, c_gt, c_eq) of the k largest of ``a`` by kthvalue over all of it."""
    flat = a.reshape(-1)
    tau = kth_smallest(flat, flat.numel() - k + 1)
    return tau, int((flat > tau).sum()), int((flat == tau).sum())


def kth_largest(a: torch.Tensor, k: int) -> tuple[float, int, int]:
    """(tau, c_gt, c_eq) for the k largest of the whole tensor ``a`` (sampled bounds, else ``exact``)."""
    if a.numel() < SMALL:
        return exact(a, k)
    t = Threshold(a.numel(), k)
    t.sample(a)
    t.count(a)
    return t.result() or exact(a, k)


def keep_rule(tau: float, c_gt: int, c_eq: int, k: int) -> str | None:
    """ ">" (keep a > tau), ">=" (keep a >= tau), or None when the tied entries need a tie order (module doc)."""
    if tau == 0:
        return ">"
    if c_gt + c_eq == k:
        return ">="
    return None


def keep_mask(a: torch.Tensor, tau: float, rule: str) -> torch.Tensor:
    """The kept entries of ``a`` by ``keep_rule``'s rule."""
    return a > tau if rule == ">" else a >= tau


def top_k_mask(a: torch.Tensor, k: int) -> torch.Tensor | None:
    """Mask of the k largest of ``a`` (non-negative), or None when ties at the cut need a tie order."""
    tau, c_gt, c_eq = kth_largest(a, k)
    rule = keep_rule(tau, c_gt, c_eq, k)
    return None if rule is None else keep_mask(a, tau, rule)
