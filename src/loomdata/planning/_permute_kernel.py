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

__all__ = [
    "bucket_starts",
    "bucket_starts_split",
    "permute_into",
    "scatter_buckets",
    "shuffle_buckets",
    "shuffle_states",
]


@njit
def _step(
    s0: np.uint64, s1: np.uint64, s2: np.uint64, s3: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64, np.uint64]:
    """The next output of xoshiro256** (Blackman and Vigna) from the state (s0, s1, s2, s3): (output, the state
    after). Kernels keep their state in four locals this way, 2.5-3x faster than in a state array (40M draws: 0.11
    -> 0.04 s), which the compiler must load and store at every draw (it cannot tell it from the loop's arrays)."""
    x = s1 * np.uint64(5)
    result = ((x << np.uint64(7)) | (x >> np.uint64(57))) * np.uint64(9)
    t = s1 << np.uint64(17)
    s2 ^= s0
    s3 ^= s1
    s1 ^= s2
    s0 ^= s3
    s2 ^= t
    s3 = (s3 << np.uint64(45)) | (s3 >> np.uint64(19))
    return result, s0, s1, s2, s3


@njit
def _below_step(
    s0: np.uint64, s1: np.uint64, s2: np.uint64, s3: np.uint64, m: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64, np.uint64]:
    """A uniform integer in [0, m) for 0 < m < 2^32 (Lemire's multiply-shift on 32 random bits, with rejection) from
    the state (s0, s1, s2, s3): (the integer, the state after)."""
    mask = np.uint64(0xFFFFFFFF)
    r, s0, s1, s2, s3 = _step(s0, s1, s2, s3)
    prod = (r >> np.uint64(32)) * m
    low = prod & mask
    if low < m:
        floor = ((mask + np.uint64(1)) - m) % m
        while low < floor:
            r, s0, s1, s2, s3 = _step(s0, s1, s2, s3)
            prod = (r >> np.uint64(32)) * m
            low = prod & mask
    return prod >> np.uint64(32), s0, s1, s2, s3


@njit
def permute_into(src: np.ndarray, dense: bool, out: np.ndarray, state: np.ndarray, bits: int) -> None:
    """out = a uniform permutation of src (dense: of 0..len(out)-1, src unused), from xoshiro256** `state`
    (4 uint64, not all zero; advanced in place) with 2^bits buckets (bits 0..16)."""
    none = np.zeros(0, dtype=np.uint8)
    _permute(src, dense, out, none, none, False, state, bits)


@njit
def bucket_starts(state: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Where each of the 2^bits buckets of n items starts (int64, 2^bits + 1), from n draws of `state` (advanced in
    place): the first pass of permute_into."""
    start, _, _ = bucket_starts_split(state, n, bits, np.zeros(0, dtype=np.int64))
    return start


@njit
def bucket_starts_split(
    state: np.ndarray, n: int, bits: int, splits: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bucket_starts, and at each item `splits[t]` (ascending) the generator's state before that item's draw (t, 4)
    and how many items before it each bucket got (t, 2^bits): what a scatter of the items from splits[t] on starts
    from, so item ranges can be scattered apart (each to its own places)."""
    nb = 1 << bits
    start = np.zeros(nb + 1, dtype=np.int64)
    states = np.empty((len(splits), 4), dtype=np.uint64)
    counts = np.zeros((len(splits), nb), dtype=np.int64)
    if bits == 0:
        start[1] = n
        return start, states, counts
    shift = np.uint64(64 - bits)
    s0, s1, s2, s3 = state[0], state[1], state[2], state[3]
    i = 0
    for t in range(len(splits) + 1):  # the items up to each split (the last: to n), then the state there
        stop = n if t == len(splits) else min(max(splits[t], i), n)
        for _ in range(i, stop):
            r, s0, s1, s2, s3 = _step(s0, s1, s2, s3)
            start[(r >> shift) + np.uint64(1)] += 1
        i = stop
        if t < len(splits):
            states[t, 0], states[t, 1], states[t, 2], states[t, 3] = s0, s1, s2, s3
            for b in range(nb):
                counts[t, b] = start[b + 1]
    state[0], state[1], state[2], state[3] = s0, s1, s2, s3
    for b in range(nb):
        start[b + 1] += start[b]
    return start, states, counts


@njit
def scatter_buckets(
    src: np.ndarray,
    dense: bool,
    out: np.ndarray,
    values: np.ndarray,
    values_out: np.ndarray,
    carry: bool,
    first: np.ndarray,
    start: np.ndarray,
    bits: int,
    k0: int,
    k1: int,
    i0: int,
    i1: int,
    before: np.ndarray,
) -> None:
    """The items i0..i1-1 of buckets [k0, k1) to their places in `out` (their values to `values_out` with `carry`),
    in item order, replaying bucket_starts' draws from `first` (the state before item i0's draw; not advanced);
    before[b]: the items before i0 in bucket b (zeros from item 0). Item ranges write disjoint places."""
    if bits == 0:
        if k0 == 0 and k1 >= 1:
            for i in range(i0, i1):
                item = i if dense else src[i]
                out[i] = item
                if carry:
                    values_out[i] = values[item]
        return
    shift = np.uint64(64 - bits)
    s0, s1, s2, s3 = first[0], first[1], first[2], first[3]
    at = start[:-1] + before
    lo, hi = np.uint64(k0), np.uint64(k1)
    for i in range(i0, i1):
        r, s0, s1, s2, s3 = _step(s0, s1, s2, s3)
        bk = r >> shift
        if lo <= bk < hi:
            item = i if dense else src[i]
            out[at[bk]] = item
            if carry:
                values_out[at[bk]] = values[item]
            at[bk] += 1


@njit
def shuffle_states(state: np.ndarray, start: np.ndarray, k0: int, k1: int) -> np.ndarray:
    """The generator's state as each bucket k0..k1 begins its shuffle ((k1 - k0 + 1, 4): the last row the state after
    bucket k1 - 1), from `state` (the state as bucket k0 begins; not advanced): shuffle_buckets' draws replayed
    without the swaps, so bucket ranges can be shuffled apart."""
    s0, s1, s2, s3 = state[0], state[1], state[2], state[3]
    out = np.empty((k1 - k0 + 1, 4), dtype=np.uint64)
    for b in range(k0, k1):
        out[b - k0, 0], out[b - k0, 1], out[b - k0, 2], out[b - k0, 3] = s0, s1, s2, s3
        a = start[b]
        for j in range(start[b + 1] - 1, a, -1):
            _, s0, s1, s2, s3 = _below_step(s0, s1, s2, s3, np.uint64(j - a + 1))
    out[k1 - k0, 0], out[k1 - k0, 1], out[k1 - k0, 2], out[k1 - k0, 3] = s0, s1, s2, s3
    return out


@njit
def shuffle_buckets(
    out: np.ndarray, values_out: np.ndarray, carry: bool, state: np.ndarray, start: np.ndarray, k0: int, k1: int
) -> None:
    """Fisher-Yates on each bucket [k0, k1) in order with Lemire's bounded draws from `state` (advanced in place;
    the state after buckets [0, k0) were shuffled), values_out alongside with `carry`."""
    s0, s1, s2, s3 = state[0], state[1], state[2], state[3]
    for b in range(k0, k1):
        a = start[b]
        for j in range(start[b + 1] - 1, a, -1):
            d, s0, s1, s2, s3 = _below_step(s0, s1, s2, s3, np.uint64(j - a + 1))
            k = a + np.int64(d)
            v = out[j]
            out[j] = out[k]
            out[k] = v
            if carry:
                w = values_out[j]
                values_out[j] = values_out[k]
                values_out[k] = w
    state[0], state[1], state[2], state[3] = s0, s1, s2, s3


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
    """permute_into's algorithm: bucket sizes, the scatter, each bucket's shuffle; with `carry`, values_out permuted
    alongside out (the same draws, the same order)."""
    first = state.copy()
    n = len(out)
    start = bucket_starts(state, n, bits)
    nb = 1 << bits
    scatter_buckets(src, dense, out, values, values_out, carry, first, start, bits, 0, nb, 0, n, np.zeros(nb, np.int64))
    shuffle_buckets(out, values_out, carry, state, start, 0, nb)
