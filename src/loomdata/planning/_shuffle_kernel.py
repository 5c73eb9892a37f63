"""Compiled parts of the shuffle figures (planning._shuffle): the LRU replay and the figures' one pass.

lru_replay (planning._shuffle.lru_hits): access i of key b, last used at j, hits iff fewer than `capacity` other
keys were used in (j, i): the keys used there are counted once each at their latest use, kept marked in a Fenwick
tree over access positions (a key's mark moves to its newest use), so each access costs O(log n).

block_reads (the figures' read counts, session 14): the same hits from a plain LRU cache (a doubly linked list over
the blocks, O(1) an access: a key is cached iff fewer than `capacity` other keys were used since its last use, the
same rule), with each access's block found by binary search over the block starts and the fetched blocks' tokens
summed as they are first fetched, in one pass with the jumps between consecutive positions.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["block_reads", "lru_replay", "stable_ranks"]


@njit
def lru_replay(keys: np.ndarray, capacity: int) -> np.ndarray:
    """For each access of `keys` (non-negative ints), whether an LRU cache of `capacity` entries holds it."""
    m = len(keys)
    hit = np.zeros(m, dtype=np.bool_)
    if m == 0:
        return hit
    last = np.full(keys.max() + 1, -1, dtype=np.int64)
    tree = np.zeros(m + 1, dtype=np.int64)  # Fenwick tree: marks at access positions 1..m
    for i in range(m):
        b = keys[i]
        j = last[b]
        if j >= 0:
            between = 0  # marks at positions j+1..i-1 (0-based): prefix(i - 1) - prefix(j)
            x = i
            while x > 0:
                between += tree[x]
                x -= x & -x
            x = j + 1
            while x > 0:
                between -= tree[x]
                x -= x & -x
            hit[i] = between < capacity
            x = j + 1
            while x <= m:
                tree[x] -= 1
                x += x & -x
        x = i + 1
        while x <= m:
            tree[x] += 1
            x += x & -x
        last[b] = i
    return hit


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
) -> tuple[int, int, int, bool]:
    """(misses, fetched tokens, sum of |p[i+1] - p[i]|, exact) of the storage positions `p` (int64, each in
    [0, starts[-1])) read through an LRU cache of `capacity` blocks (block b: positions starts[b]:starts[b+1],
    at most `block` of them; found as np.searchsorted(starts, p, "right") - 1): a miss fetches its whole block,
    whose tokens are the `lengths` of its index rows (positions themselves where `order` is empty, else
    order[positions]). `exact` is False where the fetched tokens reached 2**53 (then they are not summed on: a
    float64 sum may round there)."""
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
    exact = True
    jump = 0
    for i in range(m):
        x = p[i]
        if i:
            d = x - p[i - 1]
            jump += d if d >= 0 else -d
        # no block holds more than `block` positions, so x's block is at least x // block: most often that one
        b = min(x // block, nb - 1)
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
        if exact:
            t = block_tokens[b]
            if t < 0:
                t = 0
                for q in range(starts[b], starts[b + 1]):
                    t += lengths[q] if len(order) == 0 else lengths[order[q]]
                block_tokens[b] = t
            fetched += t
            if fetched >= 1 << 53:
                exact = False
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
    return misses, fetched, jump, exact
