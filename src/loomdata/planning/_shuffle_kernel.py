"""Compiled LRU replay for the shuffle figures (planning._shuffle.lru_hits): one pass over the accesses.

Access i of key b, last used at j, hits iff fewer than `capacity` other keys were used in (j, i): the keys used
there are counted once each at their latest use, kept marked in a Fenwick tree over access positions (a key's
mark moves to its newest use), so each access costs O(log n).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["lru_replay"]


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
