"""Compiled parts of the shuffle figures (planning._shuffle): their read counts in one pass, the Spearman ranks.

block_reads: an LRU cache of blocks (a doubly linked list over the blocks, O(1) an access: a block is cached iff
fewer than `capacity` other blocks were used since its last use), each access's block found by a guess then a
binary search over the block starts, the fetched blocks' tokens summed as they are first fetched, in one pass with
the jumps between consecutive positions.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["block_reads", "stable_ranks"]


@njit
def stable_ranks(p: np.ndarray, hi: int) -> np.ndarray:
    """float64 rank of each of `p` (ints in [0, hi)) in its stable sort: r[np.argsort(p, kind="stable")] =
    arange(len(p)), by a counting sort (O(len(p) + hi): for values of a small range, as a source's storage
    positions are where it has few documents)."""
    start = np.zeros(hi + 1, dtype=np.int64)
    for i in range(len(p)):
        start[p[i] + 1] += 1
    for v in range(hi):
        start[v + 1] += start[v]
    rank = np.empty(len(p), dtype=np.float64)
    for i in range(len(p)):
        rank[i] = start[p[i]]
        start[p[i]] += 1
    return rank


@njit
def block_reads(
    p: np.ndarray, starts: np.ndarray, block: int, capacity: int, lengths: np.ndarray, order: np.ndarray
) -> tuple[int, float, int]:
    """(misses, fetched tokens, sum of |p[i+1] - p[i]|) of the storage positions `p` (int64, each in
    [0, starts[-1])) read through an LRU cache of `capacity` blocks (block b: positions starts[b]:starts[b+1],
    at most `block` of them; found as np.searchsorted(starts, p, "right") - 1): a miss fetches its whole block,
    whose tokens are the `lengths` of its index rows (positions themselves where `order` is empty, else
    order[positions]). The fetched tokens are summed as integers, so exactly, below 2**53 and in float64 past it
    (never reached by real lengths in FIGURE_SEGMENTS segments; no overflow either way)."""
    m = len(p)
    nb = len(starts) - 1
    prev = np.full(max(nb, 1), -1, dtype=np.int64)
    nxt = np.full(max(nb, 1), -1, dtype=np.int64)
    cached = np.zeros(max(nb, 1), dtype=np.bool_)
    block_tokens = np.full(max(nb, 1), -1, dtype=np.int64)
    head = -1
    tail = -1
    size = 0
    misses = 0
    fetched = 0
    fetched_f = 0.0  # the sum once it reaches 2**53
    jump = 0
    inv = 1.0 / block
    for i in range(m):
        x = p[i]
        if i:
            d = x - p[i - 1]
            jump += d if d >= 0 else -d
        # no block holds more than `block` positions, so x's block is at least x // block: most often that one
        b = min(int(x * inv), nb - 1)  # (a guess: a float product, not an integer division)
        if starts[b] > x or starts[b + 1] <= x:
            lo = 0 if starts[b] > x else b + 1  # (0: blocks larger than `block`, a hand-made layout's)
            hi = nb + 1
            while lo < hi:  # the number of starts <= x
                mid = (lo + hi) >> 1
                if starts[mid] <= x:
                    lo = mid + 1
                else:
                    hi = mid
            b = lo - 1
        if cached[b]:
            if b != head:  # unlink, then to the front
                nxt[prev[b]] = nxt[b]
                if nxt[b] >= 0:
                    prev[nxt[b]] = prev[b]
                else:
                    tail = prev[b]
                prev[b] = -1
                nxt[b] = head
                prev[head] = b
                head = b
            continue
        misses += 1
        t = block_tokens[b]
        if t < 0:
            t = 0
            for q in range(starts[b], starts[b + 1]):
                t += lengths[q] if len(order) == 0 else lengths[order[q]]
            block_tokens[b] = t
        if fetched_f > 0.0:
            fetched_f += t
        else:
            fetched += t
            if fetched >= 1 << 53:
                fetched_f = float(fetched)
        cached[b] = True
        prev[b] = -1
        nxt[b] = head
        if head >= 0:
            prev[head] = b
        head = b
        if tail < 0:
            tail = b
        size += 1
        if size > capacity:  # evict the least recently used
            e = tail
            tail = prev[e]
            nxt[tail] = -1
            prev[e] = -1
            cached[e] = False
            size -= 1
    return misses, fetched_f if fetched_f > 0.0 else float(fetched), jump
