"""Compiled gathering of one source's assigned segments straight into a block's step-major columns (_items).

With look-ahead membership a block's segments were gathered source by source (`segments_of`, the sample ids,
then the columns concatenated), then put step-major by a stable argsort of their steps and every column
gathered through it. The block's steps and how many segments each holds are known before (the assignment's
counts), so each segment's place is known too: a step's segments are its sources' in source order, each
source's in its stream order, so source by source a segment goes to the next free slot of its step (a
counting sort). `place_assigned` writes a source's segments there: no per-source columns handed back, no
concatenation, no sort, no permutation of the block's columns; the same values in the same places. Its passes are
separate loops (documents, their lengths and lanes, split pieces, slots, then one column at a time): a fused loop
measured 1.5-2x slower on a captured 300-source block (55-58 against 27-38 ns a segment), each segment's split
search and scattered writes holding back the next documents' loads.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["place_assigned"]

LINEAR = 8
"""Split pieces walked one by one past the previous position's before galloping (positions mostly come one
after the other, and a quarter or more of them are split pieces: the next piece is usually a step or two on)."""


@njit
def _split_at(split_pos: np.ndarray, p: int, last_p: int, last_i: int) -> int:
    """searchsorted(split_pos, p, "left"), searching on from `last_i` (the answer for `last_p`) where p >= last_p:
    a short walk, then galloping, then halving; below last_p a search of split_pos[:last_i + 1]."""
    n = len(split_pos)
    if p < last_p:
        lo, hi = 0, last_i
    else:
        lo = last_i
        end = min(n, lo + LINEAR)
        while lo < end and split_pos[lo] < p:
            lo += 1
        if lo < end or lo == n:
            return lo
        lo -= 1  # split_pos[lo] < p: gallop on from it
        step = 1
        while lo + step < n and split_pos[lo + step] < p:
            lo += step
            step *= 2
        hi = min(lo + step, n)  # split_pos[lo] < p <= split_pos[hi] (or hi the end)
        lo += 1
    while lo < hi:
        mid = (lo + hi) // 2
        if split_pos[mid] < p:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit
def _lower(a: np.ndarray, v: int) -> int:
    """searchsorted(a, v, "left") of a non-decreasing `a`."""
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit
def place_assigned(
    doc_col: np.ndarray,
    pos: np.ndarray,
    at: np.ndarray,
    t0: int,
    t1: int,
    lengths: np.ndarray,
    split_pos: np.ndarray,
    split_off: np.ndarray,
    split_len: np.ndarray,
    threshold: int,
    ids: np.ndarray,
    dense: bool,
    k: int,
    nxt: np.ndarray,
    src: np.ndarray,
    sample: np.ndarray,
    offset: np.ndarray,
    length: np.ndarray,
    lane: np.ndarray,
) -> int:
    """Source k's segments assigned to steps t0..t1-1 (stream positions `pos` assigned to steps `at`, non-decreasing:
    a StepAssignment's arrays of the source) into the block's columns: segment j at nxt[at[j] - t0], which then
    moves on one. Its values are _lookahead.segments_at's (doc, offset, length as uint32, lane: its document longer
    than `threshold`, none where threshold < 0), the sample id its document's row as uint64 (`dense`) or ids[doc]
    as uint64, the length widened to int64. Returns how many segments it placed, or -1 (nothing written) where
    a step's slots would run past the columns: the writes are unchecked, so the counts are checked first."""
    a = _lower(at, t0)
    m = _lower(at, t1) - a
    # in separate passes (see the module doc)
    doc = np.empty(m, dtype=doc_col.dtype)
    for j in range(m):
        doc[j] = doc_col[pos[a + j]]
    ln = np.empty(m, dtype=np.uint32)
    ln_lane = np.zeros(m, dtype=np.uint8)
    for j in range(m):
        dl = lengths[doc[j]]
        ln[j] = np.uint32(dl)
        if threshold >= 0 and dl > threshold:
            ln_lane[j] = 1
    off = np.zeros(m, dtype=np.uint32)
    n_split = len(split_pos)
    if n_split:
        last_p, last_i = -1, 0
        for j in range(m):
            p = int(pos[a + j])
            i = _split_at(split_pos, p, last_p, last_i)
            last_p, last_i = p, i
            i = min(i, n_split - 1)
            if split_pos[i] == p:
                off[j] = split_off[i]
                ln[j] = np.uint32(split_len[i])
    slot = np.empty(m, dtype=np.int64)
    n = len(src)
    for j in range(m):
        s = int(at[a + j]) - t0
        if nxt[s] >= n:  # more segments than the counts hold (see _items._placed): before any write
            return -1
        slot[j] = nxt[s]
        nxt[s] += 1
    for j in range(m):  # one column at a time
        src[slot[j]] = k
    if dense:
        for j in range(m):
            sample[slot[j]] = np.uint64(doc[j])
    else:
        for j in range(m):
            sample[slot[j]] = np.uint64(ids[doc[j]])
    for j in range(m):
        offset[slot[j]] = off[j]
    for j in range(m):
        length[slot[j]] = np.int64(ln[j])
    for j in range(m):
        lane[slot[j]] = ln_lane[j]
    return m
