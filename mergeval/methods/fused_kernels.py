"""The numba kernels behind ``fused.py`` (imported only where they run: numba's import costs about half a
second). ``fused.py`` says what each computes and why; the definitions they reproduce bit for bit are the
torch functions in ``task_vector.py``, ``sparsify.py`` and ``select.py``.

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

_MT_N = 624  # MT19937's state words: the algorithm's constant (fused._state_of reads torch's state with it)


@jit
def twist(mt):
    """MT19937's state transition (Matsumoto & Nishimura, 1998) over its 624 words, in place."""
    upper, lower, a, one = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x9908B0DF), np.uint32(1)
    for k in range(_MT_N - 397):
        y = (mt[k] & upper) | (mt[k + 1] & lower)
        mt[k] = mt[k + 397] ^ (y >> one) ^ ((np.uint32(0) - (y & one)) & a)
    for k in range(_MT_N - 397, _MT_N - 1):
        y = (mt[k] & upper) | (mt[k + 1] & lower)
        mt[k] = mt[k + 397 - _MT_N] ^ (y >> one) ^ ((np.uint32(0) - (y & one)) & a)
    y = (mt[_MT_N - 1] & upper) | (mt[0] & lower)
    mt[_MT_N - 1] = mt[396] ^ (y >> one) ^ ((np.uint32(0) - (y & one)) & a)


@jit
def keep_mask(mt, pos, threshold, out):
    """out[j] = (the next tempered word & 0xFFFFFF) < threshold; returns the state's new position.

    The inner loop runs over two slices and stores 0/1 bytes: the compiler then vectorizes it (indexing
    ``mt[pos + q]`` and storing Python bools into ``out`` kept it scalar, at twice the time per entry)."""
    j, n = 0, out.size
    bytes_out = out.view(np.uint8)
    while j < n:
        if pos >= _MT_N:
            twist(mt)
            pos = 0
        m = min(_MT_N - pos, n - j)
        words, dst = mt[pos : pos + m], bytes_out[j : j + m]
        for q in range(m):
            y = words[q]
            y ^= y >> np.uint32(11)
            y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
            y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
            y ^= y >> np.uint32(18)
            dst[q] = np.uint8(1) if (y & np.uint32(0xFFFFFF)) < threshold else np.uint8(0)
        pos += m
        j += m
    return pos


@jit
def merge_rows(
    b, e, kinds, masks, divisors, cuts, quotas, w, unit, vote_weighted, elect, normalize, divide_by, lam, out, nonfinite
):
    """One block: out = b + lam * combine(s), s_i = sparsified e_i - b (see the module's docstring).
    nonfinite[0] (the base) and nonfinite[1 + i] (expert i) count the NaN and Inf entries of every input
    (x - x is 0 for a finite x and NaN for NaN or Inf): the reader's own pass over the block is left out.

    kinds[i]: 0 keeps all of d_i, 1 keeps d_i where masks[i] (DARE; +0.0 elsewhere), 2 keeps |d_i| >
    cuts[i] and the first quotas[i] entries with |d_i| == cuts[i] (TIES' zero_dropped_; quotas counted
    down in place). s_i = kept d_i / divisors[i] where divisors[i] > 0. elect: TIES' disjoint mean
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
            if kinds[i] == 1:
                mi = masks[i, start : start + m]
                for j in range(m):
                    si[j] = ei[j] - bi[j] if mi[j] else zero
            elif kinds[i] == 2:
                cut = cuts[i]
                for j in range(m):
                    d = ei[j] - bi[j]
                    mag = abs(d)
                    si[j] = d if (mag > cut or np.isnan(mag)) else zero  # NaN kept: NaN <= tau is false
                for j in range(m):  # the tied entries, kept in order while the quota lasts (rare)
                    if abs(ei[j] - bi[j]) == cut and quotas[i] > 0:
                        si[j] = ei[j] - bi[j]
                        quotas[i] -= 1
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


@jit
def count_band(b, e, lo, hi, out):
    """TIES' counting pass (select.Threshold.count) on a = |e - b|: returns (#{a > hi}, k) with the k values in
    [lo, hi] written to out[:k] in order; NaN is neither (every comparison with it is false). Branch-free:
    each value is written and the count advanced by 0 or 1."""
    above, k = 0, 0
    for j in range(b.size):
        a = abs(e[j] - b[j])
        out[k] = a
        k += 1 if (a >= lo) & (a <= hi) else 0
        above += 1 if a > hi else 0
    return above, k


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
