"""The numba kernels behind ``fused.py`` (imported only where they run: numba's import costs about half a
second). ``fused.py`` says what each computes and why; the definitions they reproduce bit for bit are the
torch functions in ``task_vector.py``, ``sparsify.py``, ``select.py`` and ``draws.py``.

Defined at module level so numba's on-disk cache finds them again in the next process (a kernel defined
inside a function that calls another kernel was compiled anew in every process: its cache key held the
callee's identity).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mergeval.methods.task_vector import SIGN_SAFE as _SIGN_SAFE

CHUNK = 512  # entries per step of merge_rows: its scratch rows stay in the L1 cache
SIGN_SAFE = np.float32(_SIGN_SAFE)  # beyond it every summation order has one sign (task_vector.sign_of_sum)

jit = njit(nogil=True, cache=True, error_model="numpy")

# ---------------------------------------------------------------- the draws: Threefry-2x32-20 (methods/draws.py)

U32 = np.uint32
WORD = np.uint64(0xFFFFFFFF)
# inlined into the loops that call them (numba's own inlining): called as functions, the loops are not vectorized
inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")


@inline
def _round(x0, x1, rot):
    """One round: x0 += x1; x1 = rotl(x1, rot) ^ x0 (uint32 words)."""
    x0 = U32(x0 + x1)
    x1 = U32((x1 << rot) | (x1 >> (U32(32) - rot)))
    return x0, x1 ^ x0


@inline
def _four_rounds(x0, x1, first):
    """Rounds 4t .. 4t + 3, with the rotations R[0..3] (first) or R[4..7]."""
    if first:
        x0, x1 = _round(x0, x1, U32(13))
        x0, x1 = _round(x0, x1, U32(15))
        x0, x1 = _round(x0, x1, U32(26))
        x0, x1 = _round(x0, x1, U32(6))
    else:
        x0, x1 = _round(x0, x1, U32(17))
        x0, x1 = _round(x0, x1, U32(29))
        x0, x1 = _round(x0, x1, U32(16))
        x0, x1 = _round(x0, x1, U32(24))
    return x0, x1


@inline
def first_word(k0, k1, index):
    """x0 of Threefry-2x32-20 (key (k0, k1), counter (index mod 2^32, index >> 32)); x1 after the last round
    is not needed, so its last key injection is left out."""
    k2 = U32(U32(0x1BD11BDA) ^ k0 ^ k1)
    x0 = U32(U32(index & WORD) + k0)
    x1 = U32(U32(index >> np.uint64(32)) + k1)
    x0, x1 = _four_rounds(x0, x1, True)
    x0, x1 = U32(x0 + k1), U32(x1 + k2 + U32(1))
    x0, x1 = _four_rounds(x0, x1, False)
    x0, x1 = U32(x0 + k2), U32(x1 + k0 + U32(2))
    x0, x1 = _four_rounds(x0, x1, True)
    x0, x1 = U32(x0 + k0), U32(x1 + k1 + U32(3))
    x0, x1 = _four_rounds(x0, x1, False)
    x0, x1 = U32(x0 + k1), U32(x1 + k2 + U32(4))
    x0, x1 = _four_rounds(x0, x1, True)
    return U32(x0 + k2)


@jit
def keep_mask(k0, k1, start, threshold, out):
    """out[j] = (x0 of entry start + j) >> 8 < threshold. One loop without a data-dependent branch, storing 0/1
    bytes: the compiler vectorizes it."""
    k0, k1, threshold = U32(k0), U32(k1), U32(threshold)
    dst = out.view(np.uint8)
    first = np.uint64(start)
    for j in range(out.size):
        m = first_word(k0, k1, first + np.uint64(j)) >> U32(8)
        dst[j] = np.uint8(1) if m < threshold else np.uint8(0)


@jit
def uniforms(k0, k1, start, out):
    """out[j] = ((x0 of entry start + j) >> 8) * 2^-24 (float32, exact)."""
    k0, k1 = U32(k0), U32(k1)
    first = np.uint64(start)
    scale = np.float32(2.0**-24)
    for j in range(out.size):
        out[j] = np.float32(first_word(k0, k1, first + np.uint64(j)) >> U32(8)) * scale


@jit
def merge_rows(b, e, masked, masks, divisors, w, unit, vote_weighted, elect, normalize, divide_by, lam, out, nonfinite):
    """One block: out = b + lam * combine(s), s_i = sparsified e_i - b (see the module's docstring).
    nonfinite[0] (the base) and nonfinite[1 + i] (expert i) count the NaN and Inf entries of every input
    (x - x is 0 for a finite x and NaN for NaN or Inf): the reader's own pass over the block is left out.

    masked[i]: keep d_i where masks[i] (DARE; +0.0 elsewhere), else all of it. s_i = kept d_i / divisors[i]
    where divisors[i] > 0. elect: TIES' disjoint mean
    (normalize) or sum; else the weighted sum, divided by divide_by unless it is 0. w: the weights,
    unit: all of them 1, vote_weighted: the election votes with w_i s_i.

    Each step is a loop over a chunk of entries with no data-dependent branch, which the compiler turns
    into vector code with selects (a per-entry branch on a random mask mispredicts half the time).
    """
    n_exp, n = e.shape
    zero, one = np.float32(0.0), np.float32(1.0)
    close_at = SIGN_SAFE * np.float32(n_exp - 1)
    s = np.empty((n_exp, CHUNK), np.float32)
    total = np.empty(CHUNK, np.float32)
    size = np.empty(CHUNK, np.float32)
    tau = np.empty(CHUNK, np.float32)
    mass = np.empty(CHUNK, np.float32)
    v = np.empty(n_exp, np.float32)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        bi = b[start : start + m]
        bad = 0
        for j in range(m):
            bad += 1 if bi[j] - bi[j] != zero else 0
        nonfinite[0] += bad
        for i in range(n_exp):
            si, ei = s[i], e[i, start : start + m]
            bad = 0
            for j in range(m):
                bad += 1 if ei[j] - ei[j] != zero else 0
            nonfinite[1 + i] += bad
            if masked[i]:
                mi = masks[i, start : start + m]
                for j in range(m):
                    si[j] = ei[j] - bi[j] if mi[j] else zero
            else:
                for j in range(m):
                    si[j] = ei[j] - bi[j]
            if divisors[i] > zero:
                div = divisors[i]
                for j in range(m):
                    si[j] = si[j] / div
        if not elect:  # weighted_sum: 0 + w_1 s_1 + ... in order (s * 1.0 is s exactly)
            tau[:m] = zero
            for i in range(n_exp):
                wi = w[i]
                for j in range(m):
                    tau[j] += s[i, j] * wi
            if divide_by != zero:
                for j in range(m):
                    tau[j] = tau[j] / divide_by
        else:  # disjoint_merge with sign_rule sum
            total[:m] = zero
            size[:m] = zero
            for i in range(n_exp):
                wi = w[i] if vote_weighted else one
                for j in range(m):
                    x = s[i, j] * wi
                    total[j] += x
                    size[j] += abs(x)
            if n_exp > 2:
                for j in range(m):
                    if size[j] > zero and abs(total[j]) <= size[j] * close_at:
                        for i in range(n_exp):  # sign_of_sum: near zero, the sign of the sorted sum
                            v[i] = s[i, j] * w[i] if vote_weighted else s[i, j]
                        v.sort()
                        total[j] = zero
                        for i in range(n_exp):
                            total[j] += v[i]
            for j in range(m):  # gamma = sign(total); only s_i * gamma > 0 matters, so NaN may be 0
                total[j] = (one if total[j] > zero else zero) - (one if total[j] < zero else zero)
            tau[:m] = zero
            mass[:m] = zero
            for i in range(n_exp):
                wi = w[i]
                for j in range(m):
                    a = one if s[i, j] * total[j] > zero else zero
                    if unit:
                        mass[j] += a
                        tau[j] += a * s[i, j]
                    else:
                        mass[j] += wi * a
                        tau[j] += a * (s[i, j] * wi)
            if normalize:
                for j in range(m):
                    tau[j] = tau[j] / (one if mass[j] == zero else mass[j])
        oi = out[start : start + m]  # a slice: indexing out[start + j] kept this loop scalar (not vectorized)
        for j in range(m):
            oi[j] = tau[j] * lam + bi[j]


LOW_BITS, HIGH_BITS = 16, 15  # the two digits of a float32's magnitude bits (31): two counting passes


@jit
def place_by_rank(x, row_len, by_rank, pa, pb, out):
    """out[p] = by_rank[rank of |x[p]| within its row of ``row_len`` entries], ranks ascending, ties by
    position; False (nothing written) where an entry is not finite.

    x: the tensor's float32 bits as uint32, flat; the sign cleared, they order as the magnitudes. An LSD
    radix sort of all entries by those 31 bits (two stable counting passes, 16 then 15 bits) puts the
    positions in (magnitude, position) order; walking that order, each entry's rank in its row is the
    number of its row's entries seen before it. pa, pb (int32 or int64): scratch of x's size; the keys
    between the passes live in ``out`` (float32), which is written only after the last pass has read them."""
    n = x.size
    ka = out.view(np.uint32)
    low = np.zeros(1 << LOW_BITS, np.int64)
    high = np.zeros(1 << HIGH_BITS, np.int64)
    mag, finite = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)
    for p in range(n):
        k = x[p] & mag
        if k >= finite:
            return False
        low[k & np.uint32(0xFFFF)] += 1
        high[k >> np.uint32(LOW_BITS)] += 1
    start = 0
    for d in range(low.size):
        c = low[d]
        low[d] = start
        start += c
    start = 0
    for d in range(high.size):
        c = high[d]
        high[d] = start
        start += c
    for p in range(n):  # by the low digit, in position order
        k = x[p] & mag
        d = k & np.uint32(0xFFFF)
        t = low[d]
        low[d] = t + 1
        ka[t] = k
        pa[t] = p
    for j in range(n):  # by the high digit, stable: (magnitude, position) order
        d = ka[j] >> np.uint32(LOW_BITS)
        t = high[d]
        high[d] = t + 1
        pb[t] = pa[j]
    if row_len == n:
        for j in range(n):
            out[pb[j]] = by_rank[j]
        return True
    seen = np.zeros(n // row_len, np.int64)
    for j in range(n):
        p = pb[j]
        i = p // row_len
        out[p] = by_rank[seen[i]]
        seen[i] += 1
    return True
