"""Compiled uniform permutation (planning._permute): Rao-Sandelius bucketing, then Fisher-Yates in each bucket.

Every item draws a bucket from the top bits of one xoshiro256** output; the items are scattered into their
buckets in item order (the draws are replayed from the same state, so no bucket ids are stored), then each
bucket is shuffled by Fisher-Yates with Lemire's unbiased bounded draws. Uniform buckets and a uniform order
within each bucket give an exactly uniform permutation (Rao 1961, Sandelius 1962), and every memory access of
the scatter goes to one of a few thousand sequential streams, each bucket's shuffle to one cache-sized block:
a NumPy `Generator.shuffle` of 10M items swaps at random over all of them (cache misses, ~1.4 s here).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["permute_into", "permute_with_values_into"]


@njit
def _next(s: np.ndarray) -> np.uint64:
    """The next output of xoshiro256** (Blackman and Vigna) with state `s` (4 uint64, advanced in place)."""
    x = s[1] * np.uint64(5)
    result = ((x << np.uint64(7)) | (x >> np.uint64(57))) * np.uint64(9)
    t = s[1] << np.uint64(17)
    s[2] ^= s[0]
    s[3] ^= s[1]
    s[1] ^= s[2]
    s[0] ^= s[3]
    s[2] ^= t
    s[3] = (s[3] << np.uint64(45)) | (s[3] >> np.uint64(19))
    return result


@njit
def _below(s: np.ndarray, m: np.uint64) -> np.uint64:
    """A uniform integer in [0, m) for 0 < m < 2^32: Lemire's multiply-shift on 32 random bits, with rejection."""
    mask = np.uint64(0xFFFFFFFF)
    prod = (_next(s) >> np.uint64(32)) * m
    low = prod & mask
    if low < m:
        floor = ((mask + np.uint64(1)) - m) % m
        while low < floor:
            prod = (_next(s) >> np.uint64(32)) * m
            low = prod & mask
    return prod >> np.uint64(32)


@njit
def permute_into(src: np.ndarray, dense: bool, out: np.ndarray, state: np.ndarray, bits: int) -> None:
    """out = a uniform permutation of src (dense: of 0..len(out)-1, src unused), from xoshiro256** `state`
    (4 uint64, not all zero; advanced in place) with 2^bits buckets (bits 0..16)."""
    none = np.zeros(0, dtype=np.uint8)
    _permute(src, dense, out, none, none, False, state, bits)


@njit
def permute_with_values_into(
    src: np.ndarray,
    dense: bool,
    out: np.ndarray,
    values: np.ndarray,
    values_out: np.ndarray,
    state: np.ndarray,
    bits: int,
) -> None:
    """permute_into, and values_out[j] = values[out[j]] in the same pass: each item's value moves with it (read in
    item order, where src is sorted: sequential), so the caller needs no random gather of values by item."""
    _permute(src, dense, out, values, values_out, True, state, bits)


@njit
def _permute(
    src: np.ndarray,
    dense: bool,
    out: np.ndarray,
    values: np.ndarray,
    values_out: np.ndarray,
    carry: bool,
    state: np.ndarray,
    bits: int,
) -> None:
    """permute_into's algorithm; with `carry`, values_out permuted alongside out (the same draws, the same order)."""
    n = len(out)
    nb = 1 << bits
    start = np.zeros(nb + 1, dtype=np.int64)
    if bits > 0:
        shift = np.uint64(64 - bits)
        first = state.copy()
        for _ in range(n):
            start[(_next(state) >> shift) + np.uint64(1)] += 1
        for b in range(nb):
            start[b + 1] += start[b]
        at = start[:nb].copy()
        for i in range(n):  # the same draws again: each item to the next free place of its bucket
            bk = _next(first) >> shift
            item = i if dense else src[i]
            out[at[bk]] = item
            if carry:
                values_out[at[bk]] = values[item]
            at[bk] += 1
    else:
        start[1] = n
        for i in range(n):
            item = i if dense else src[i]
            out[i] = item
            if carry:
                values_out[i] = values[item]
    for b in range(nb):
        a = start[b]
        for j in range(start[b + 1] - 1, a, -1):
            k = a + np.int64(_below(state, np.uint64(j - a + 1)))
            v = out[j]
            out[j] = out[k]
            out[k] = v
            if carry:
                w = values_out[j]
                values_out[j] = values_out[k]
                values_out[k] = w
