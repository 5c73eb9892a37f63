"""Compiled manifest order of a block's placed pieces (_block._placed): one counting sort instead of gathers, a
search and three stable radix passes over all of them.

A block's pieces are its long items (ascending), its short items in dealing order (step after step) and the
leftovers' split pieces (step after step); the manifest wants them by step, then slot (rank x micro-batches +
micro-batch), then that phase (long, dealt, split), each group in that input order: np.lexsort((phase, slot,
step)), which a stable counting sort on the one key ((step x slots + slot) x 3 + phase) gives alike.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["placed_rows"]


@njit
def placed_rows(
    long_idx: np.ndarray,
    order: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    length: np.ndarray,
    off: np.ndarray,
    pieces: np.ndarray,
    nb: int,
    dp: int,
    mb: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(step, item, delta, length, rank, micro-batch) of the placed pieces of steps 0..nb-1 in manifest order:
    long items `long_idx` (ascending) and dealt items `order` (global indices, grouped by step in step order;
    those with p_rank >= 0), then `pieces` (int64 rows: step, item within the step, delta, length, rank,
    micro-batch); `off`: each step's first item."""
    slots = dp * mb
    n_keys = nb * slots * 3
    start = np.zeros(n_keys + 1, dtype=np.int64)
    n_whole = len(long_idx) + len(order)
    key = np.empty(n_whole + len(pieces), dtype=np.int64)
    s = 0
    for j in range(n_whole):
        if j == len(long_idx):  # the dealt items: a step's after the step before's, as the long items
            s = 0
        i = long_idx[j] if j < len(long_idx) else order[j - len(long_idx)]
        while i >= off[s + 1]:  # the item's step: on from the previous item's
            s += 1
        if p_rank[i] < 0:
            key[j] = -1
            continue
        phase = 0 if j < len(long_idx) else 1
        key[j] = ((s * dp + p_rank[i]) * mb + p_mb[i]) * 3 + phase
        start[key[j] + 1] += 1
    for j in range(len(pieces)):
        k = ((pieces[j, 0] * dp + pieces[j, 4]) * mb + pieces[j, 5]) * 3 + 2
        key[n_whole + j] = k
        start[k + 1] += 1
    for k in range(n_keys):
        start[k + 1] += start[k]
    n = start[n_keys]
    step = np.empty(n, dtype=np.int64)
    item = np.empty(n, dtype=np.int64)
    delta = np.zeros(n, dtype=np.int64)
    plen = np.empty(n, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    mbs = np.empty(n, dtype=np.int64)
    for j in range(len(key)):
        k = key[j]
        if k < 0:
            continue
        at = start[k]
        start[k] += 1
        step[at] = k // (3 * slots)
        if j < n_whole:
            i = long_idx[j] if j < len(long_idx) else order[j - len(long_idx)]
            item[at] = i
            plen[at] = length[i]
            rank[at] = p_rank[i]
            mbs[at] = p_mb[i]
        else:
            q = j - n_whole
            item[at] = pieces[q, 1] + off[pieces[q, 0]]
            delta[at] = pieces[q, 2]
            plen[at] = pieces[q, 3]
            rank[at] = pieces[q, 4]
            mbs[at] = pieces[q, 5]
    return step, item, delta, plen, rank, mbs
