"""Compiled pairwise local search (_refine's rounds): each step of a block refined round by round, one step
after the other.

The same decisions, in the same order, as the rounds NumPy ran in lockstep over a block's steps (a step's
rounds read and write only its own slots and items): per round the most and least loaded ranks (first
maximum, first minimum), every MAX_CANDIDATES-subsampled pair (a on the heavy rank; a move to the light
rank's roomiest short micro-batch, or a swap with b) in (a, b) order, the first pair whose cost difference
is nearest half the gap.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["refine_rounds"]


@njit
def _members(key: np.ndarray, a: int, b: int, want: int, cap: int) -> np.ndarray:
    """Items a..b-1 whose key is `want`, ascending; every stride-th of them when more than `cap`."""
    n = 0
    for i in range(a, b):
        if key[i] == want:
            n += 1
    stride = 1 if n <= cap else -(-n // cap)
    out = np.empty(-(-n // stride), dtype=np.int64)
    at = k = 0
    for i in range(a, b):
        if key[i] == want:
            if at % stride == 0:
                out[k] = i
                k += 1
            at += 1
    return out


@njit
def _shift(
    item: int,
    s: int,
    src: tuple[int, int],
    dst: tuple[int, int],
    cost3: np.ndarray,
    room3: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    key: np.ndarray,
    g_cost: np.ndarray,
    g_len: np.ndarray,
) -> float:
    """Move an item of step s from slot src to slot dst (rank, micro-batch; rank costs are the caller's): its cost."""
    c, ln = g_cost[item], g_len[item]
    cost3[s, src[0], src[1]] -= c
    room3[s, src[0], src[1]] += ln
    cost3[s, dst[0], dst[1]] += c
    room3[s, dst[0], dst[1]] -= ln
    p_rank[item], p_mb[item] = dst
    key[item] = s * cost3.shape[1] + dst[0]
    return float(c)


@njit
def refine_rounds(
    cost3: np.ndarray,
    room3: np.ndarray,
    lane3: np.ndarray,
    rc: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    g_cost: np.ndarray,
    g_len: np.ndarray,
    key: np.ndarray,
    off: np.ndarray,
    rounds: int,
    tolerance: float,
    cap: int,
) -> None:
    """Up to `rounds` rounds of moves and swaps between the most and least loaded rank of every step (items
    off[s]..off[s+1]-1; key: step * dp + rank of a movable item, updated as items move), in place."""
    n_steps, dp, mb = cost3.shape
    for s in range(n_steps):
        a0, b0 = off[s], off[s + 1]
        for _ in range(rounds):
            r_s = rc[s]
            hi, lo = int(np.argmax(r_s)), int(np.argmin(r_s))
            gap = r_s[hi] - r_s[lo]
            if gap <= tolerance * r_s[hi]:
                break
            ia = _members(key, a0, b0, s * dp + hi, cap)
            if len(ia) == 0:
                break
            ib = _members(key, a0, b0, s * dp + lo, cap)
            roomiest, top = 0, -2
            for m in range(mb):
                v = room3[s, lo, m] if lane3[s, lo, m] == 0 else -1
                if v > top:
                    roomiest, top = m, v
            half = gap / 2
            best, bi, bj = np.inf, -1, -1
            for i in range(len(ia)):
                ca, la = g_cost[ia[i]], g_len[ia[i]]
                room_hi = room3[s, hi, p_mb[ia[i]]] + la
                for j in range(len(ib) + 1):
                    if j == 0:
                        cb, lb, mj = 0.0, 0, roomiest
                    else:
                        cb, lb, mj = g_cost[ib[j - 1]], g_len[ib[j - 1]], p_mb[ib[j - 1]]
                    room_lo = room3[s, lo, mj] + lb if lane3[s, lo, mj] == 0 else -1
                    delta = ca - cb
                    if delta <= 0 or delta >= gap or la > room_lo or lb > room_hi:
                        continue
                    score = abs(delta - half)
                    if score < best:
                        best, bi, bj = score, i, j
            if bi < 0:
                break
            item_a = ia[bi]
            ma = p_mb[item_a]
            mj = roomiest if bj == 0 else p_mb[ib[bj - 1]]
            c_a = _shift(item_a, s, (hi, ma), (lo, mj), cost3, room3, p_rank, p_mb, key, g_cost, g_len)
            c_b = 0.0
            if bj > 0:
                c_b = _shift(ib[bj - 1], s, (lo, mj), (hi, ma), cost3, room3, p_rank, p_mb, key, g_cost, g_len)
            dl = c_a - c_b
            rc[s, hi] -= dl
            rc[s, lo] += dl
