"""Compiled pairwise local search (_refine's rounds): each step of a block refined round by round, one step
after the other.

The same decisions, in the same order, as the rounds NumPy ran in lockstep over a block's steps (a step's
rounds read and write only its own slots and items): per round the most and least loaded ranks (first
maximum, first minimum), every MAX_CANDIDATES-subsampled pair (a on the heavy rank; a move to the light
rank's roomiest short micro-batch, or a swap with b) in (a, b) order, the first pair whose cost difference
is nearest half the gap. A step's items of each rank are listed once, ascending, and the lists follow the
moves (no scan of the step's items a round: a 64K-item block at dp 1024 4.8 -> 0.8 ms).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["refine_rounds", "search_setup"]


@njit
def search_setup(
    movable: np.ndarray, step_of: np.ndarray, p_rank: np.ndarray, g_cost: np.ndarray, n_steps: int, dp: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The searches' set-up in one pass over a block's items (step_of ascending): (key: step * dp + rank of a
    movable item, n_steps * dp for the others; off: where each step's items start, n_steps + 1; top: each
    step's largest placed cost, 0 where none). The same arrays as np.where, np.searchsorted and
    _state.step_max; placement (p_rank >= 0) and costs are what the searches never change, so `top` is the
    same before them as after."""
    n = len(step_of)
    key = np.empty(n, dtype=np.int64)
    off = np.zeros(n_steps + 1, dtype=np.int64)
    top = np.zeros(n_steps)
    # the current step's running maximum in a register, its start and maximum written as the step changes
    # (steps ascending), no branch an item otherwise
    cur, t = 0, 0.0
    for i in range(n):
        s = step_of[i]
        if s != cur:
            top[cur] = t
            t = 0.0
            for q in range(cur + 1, s + 1):
                off[q] = i
            cur = s
        r = p_rank[i]
        key[i] = s * dp + r if movable[i] else n_steps * dp
        c = g_cost[i]
        t = c if (r >= 0) & (c > t) else t
    if n_steps:
        top[cur] = t
    for q in range(cur + 1, n_steps + 1):
        off[q] = n
    return key, off, top


@njit
def _beats(row: np.ndarray, n: int, best: float) -> bool:
    """Whether any of row[:n] is below `best` (an OR over the row, no branch an element: vectorized)."""
    hit = False
    for j in range(n):
        hit |= row[j] < best
    return hit


@njit
def _rank_lists(
    key: np.ndarray,
    a: int,
    b: int,
    base: int,
    dp: int,
    spare: int,
    at: np.ndarray,
    n: np.ndarray,
    buf: np.ndarray,
    stride: int,
) -> None:
    """Each rank's movable items of a step (items a..b-1 whose key is base + rank), ascending: rank r's are
    buf[at[r] : at[r] + n[r]], with room for `spare` more (a step's rounds add at most one item to a rank each).
    stride > 0 (at least b - a + spare): rank r's list starts at r * stride, listed in one pass; 0: the lists
    packed (a counting pass first), for a buffer of only b - a + dp * spare."""
    n[:] = 0
    if stride > 0:
        for r in range(dp):
            at[r] = r * stride
        for i in range(a, b):
            r = key[i] - base
            if 0 <= r < dp:
                buf[at[r] + n[r]] = i
                n[r] += 1
        return
    for i in range(a, b):
        r = key[i] - base
        if 0 <= r < dp:
            n[r] += 1
    total = 0
    for r in range(dp):
        at[r] = total
        total += n[r] + spare
    n[:] = 0
    for i in range(a, b):
        r = key[i] - base
        if 0 <= r < dp:
            buf[at[r] + n[r]] = i
            n[r] += 1


@njit
def _candidates(buf: np.ndarray, at: int, n: int, cap: int) -> np.ndarray:
    """A rank's items buf[at : at + n]; every stride-th of them when more than `cap` (from the first)."""
    if n <= cap:
        return buf[at : at + n]
    return buf[at : at + n : -(-n // cap)]


@njit
def _list_move(item: int, src: int, dst: int, at: np.ndarray, n: np.ndarray, buf: np.ndarray) -> None:
    """Move `item` from rank src's ascending list to rank dst's, keeping both ascending."""
    j = at[src]
    while buf[j] != item:
        j += 1
    for q in range(j, at[src] + n[src] - 1):
        buf[q] = buf[q + 1]
    n[src] -= 1
    j = at[dst] + n[dst]
    while j > at[dst] and buf[j - 1] > item:
        buf[j] = buf[j - 1]
        j -= 1
    buf[j] = item
    n[dst] += 1


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
    at = np.empty(dp, dtype=np.int64)
    cnt = np.empty(dp, dtype=np.int64)
    most = 0
    for s in range(n_steps):
        most = max(most, off[s + 1] - off[s])
    # the rank lists one pass a step (each rank room for a whole step) where that buffer stays within a few
    # times the packed one (small dp); else packed, after a counting pass
    stride = most + rounds
    if dp * stride > 4 * (most + dp * rounds):
        stride = 0
    buf = np.empty(dp * stride if stride else most + dp * rounds, dtype=np.int64)
    # the light rank's candidates' costs, lengths and the room a pair leaves there (cap + 1 at most)
    jc = np.empty(cap + 2)
    jl = np.empty(cap + 2, dtype=np.int64)
    jr = np.empty(cap + 2, dtype=np.int64)
    score = np.empty(cap + 2)  # one a's scores against them
    for s in range(n_steps):
        a0, b0 = off[s], off[s + 1]
        listed = False
        for _ in range(rounds):
            r_s = rc[s]
            hi, lo = int(np.argmax(r_s)), int(np.argmin(r_s))
            gap = r_s[hi] - r_s[lo]
            if gap <= tolerance * r_s[hi]:
                break
            if not listed:  # each rank's movable items, kept up to date as items move (no scan a round)
                _rank_lists(key, a0, b0, s * dp, dp, rounds, at, cnt, buf, stride)
                listed = True
            ia = _candidates(buf, at[hi], cnt[hi], cap)
            if len(ia) == 0:
                break
            ib = _candidates(buf, at[lo], cnt[lo], cap)
            roomiest, top = 0, -2
            for m in range(mb):
                v = room3[s, lo, m] if lane3[s, lo, m] == 0 else -1
                if v > top:
                    roomiest, top = m, v
            half = gap / 2
            # the light rank's side of every pair (j 0: a move to its roomiest micro-batch), read once a round
            nb = len(ib) + 1
            for j in range(nb):
                if j == 0:
                    cb, lb, mj = 0.0, 0, roomiest
                else:
                    cb, lb, mj = g_cost[ib[j - 1]], g_len[ib[j - 1]], p_mb[ib[j - 1]]
                jc[j], jl[j] = cb, lb
                jr[j] = room3[s, lo, mj] + lb if lane3[s, lo, mj] == 0 else -1
            best, bi, bj = np.inf, -1, -1
            for i in range(len(ia)):
                ca, la = g_cost[ia[i]], g_len[ia[i]]
                room_hi = room3[s, hi, p_mb[ia[i]]] + la
                # a's row of scores without a branch (an infeasible pair scores inf, which never wins), whether
                # any beats the best so far (an OR, also branch-free), and only then the row's first best: the
                # same pair as testing each in turn, without a mispredicted branch a pair
                for j in range(nb):
                    delta = ca - jc[j]
                    ok = (delta > 0) & (delta < gap) & (la <= jr[j]) & (jl[j] <= room_hi)
                    score[j] = abs(delta - half) if ok else np.inf
                if _beats(score, nb, best):
                    for j in range(nb):
                        if score[j] < best:
                            best, bi, bj = score[j], i, j
            if bi < 0:
                break
            item_a = ia[bi]
            item_b = ib[bj - 1] if bj > 0 else -1
            ma = p_mb[item_a]
            mj = roomiest if bj == 0 else p_mb[item_b]
            c_a = _shift(item_a, s, (hi, ma), (lo, mj), cost3, room3, p_rank, p_mb, key, g_cost, g_len)
            _list_move(item_a, hi, lo, at, cnt, buf)
            c_b = 0.0
            if bj > 0:
                c_b = _shift(item_b, s, (lo, mj), (hi, ma), cost3, room3, p_rank, p_mb, key, g_cost, g_len)
                _list_move(item_b, lo, hi, at, cnt, buf)
            dl = c_a - c_b
            rc[s, hi] -= dl
            rc[s, lo] += dl
