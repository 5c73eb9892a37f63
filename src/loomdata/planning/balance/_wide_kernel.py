"""Compiled wide local search (_wide's rounds): each step of a block searched round by round, one step after
the other.

The same decisions, in the same order, as the rounds NumPy ran over all units of a block at once: a step's
units share no rank, so evaluating and trading them one after the other reads the same state as evaluating
all of them first (see _wide for the search itself). Candidates are tried in the grids' order (a, then the
partner, its micro-batch or segment, then j), so the first best one is taken.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit, stable_argsort, stable_argsort_into
from loomdata.planning.balance._refine_kernel import _beats

__all__ = ["wide_rounds"]

_NEAR_ONE = 1 - 1e-12  # a candidate must bring the heavy rank below this fraction of its load


@njit
def _by_rank(key: np.ndarray, a0: int, b0: int, base: int, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """The movable items a0..b0-1 of a step grouped by rank (key - base), ascending within a rank: (items,
    where each rank's start; dp + 1)."""
    first = np.zeros(dp + 1, dtype=np.int64)
    for i in range(a0, b0):
        r = key[i] - base
        if 0 <= r < dp:
            first[r + 1] += 1
    for r in range(dp):
        first[r + 1] += first[r]
    at = first[:-1].copy()
    items = np.empty(first[dp], dtype=np.int64)
    for i in range(a0, b0):
        r = key[i] - base
        if 0 <= r < dp:
            items[at[r]] = i
            at[r] += 1
    return items, first


@njit
def _spaced(members: np.ndarray, cap: int) -> np.ndarray:
    """Every stride-th of `members` when there are more than `cap`."""
    return members[:: max(1, -(-len(members) // cap))].copy()


@njit
def _move(
    item: int,
    s: int,
    r0: int,
    m0: int,
    r1: int,
    m1: int,
    cost3: np.ndarray,
    room3: np.ndarray,
    rc: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    key: np.ndarray,
    g_cost: np.ndarray,
    g_len: np.ndarray,
) -> None:
    """Move an item of step s from slot (r0, m0) to (r1, m1)."""
    c, ln = g_cost[item], g_len[item]
    dp = rc.shape[1]
    cost3[s, r0, m0] -= c
    room3[s, r0, m0] += ln
    rc[s, r0] -= c
    cost3[s, r1, m1] += c
    room3[s, r1, m1] -= ln
    rc[s, r1] += c
    p_rank[item], p_mb[item] = r1, m1
    key[item] = s * dp + r1


@njit
def _partners(by: np.ndarray, k: int, p: int, wide: int, multi: int) -> np.ndarray:
    """Unit k's partner ranks (-1: none) of a step with p units (_wide._units)."""
    dp = len(by)
    q = 2 * wide
    out = np.full(q, -1, dtype=np.int64)
    for jj in range(q):
        if dp > q + 1 and p == 1:
            idx, ok = (jj if jj < wide else dp - 1 - q + jj), True
        else:
            idx = k + jj * p
            ok = idx < dp - p and (jj < multi or p == 1)
        if ok:
            out[jj] = by[min(idx, dp - 1)]
    return out


@njit
def _exchange(
    s: int,
    a: np.ndarray,
    part: np.ndarray,
    lh: float,
    room_h: np.ndarray,
    items: np.ndarray,
    first: np.ndarray,
    cost3: np.ndarray,
    room3: np.ndarray,
    rc: np.ndarray,
    p_mb: np.ndarray,
    g_cost: np.ndarray,
    g_len: np.ndarray,
    jmax: int,
) -> tuple[int, int, int, np.ndarray]:
    """The best trade of one of a for the j = 2..jmax cheapest segments of one partner micro-batch: (index into
    a, partner rank, micro-batch, the segments), or index -1 when none lowers the heavy rank."""
    mb = cost3.shape[2]
    n_p = len(part)
    ec = np.full((n_p, mb, jmax - 1), np.inf)
    el = np.zeros((n_p, mb, jmax - 1), dtype=np.int64)
    cheap = np.full((n_p, mb, jmax), -1, dtype=np.int64)
    # a micro-batch's segments, their costs and cost order: buffers for the largest partner, reused
    most = 0
    for qi in range(n_p):
        if part[qi] >= 0:
            most = max(most, first[part[qi] + 1] - first[part[qi]])
    buf = np.empty(most, dtype=np.int64)
    buf_c = np.empty(most)
    order = np.empty(most, dtype=np.int64)
    for qi in range(n_p):
        if part[qi] < 0:
            continue
        on = items[first[part[qi]] : first[part[qi] + 1]]
        for m in range(mb):
            n = 0
            for i in on:
                if p_mb[i] == m:
                    buf[n] = i
                    buf_c[n] = g_cost[i]
                    n += 1
            if n < 2:
                continue
            stable_argsort_into(buf_c[:n], order[:n])
            mine = buf[:n][order[:n]]
            cs, ls = g_cost[mine[0]], g_len[mine[0]]
            cheap[qi, m, 0] = mine[0]
            for t in range(1, min(n, jmax)):
                cs += g_cost[mine[t]]
                ls += g_len[mine[t]]
                cheap[qi, m, t] = mine[t]
                ec[qi, m, t - 1], el[qi, m, t - 1] = cs, ls
    # the trades that exist (finite cost), in (partner, micro-batch, j) order: their cost, length, the room
    # their slot would have and their rank's load; then per a, its row of values without a branch (infeasible:
    # inf, which never wins) and the row's first best: the trade that testing each in turn takes
    n_t = 0
    t_at = np.empty(n_p * mb * (jmax - 1), dtype=np.int64)
    for qi in range(n_p):
        if part[qi] < 0:
            continue
        for m in range(mb):
            for jx in range(jmax - 1):
                if np.isfinite(ec[qi, m, jx]):
                    t_at[n_t] = (qi * mb + m) * (jmax - 1) + jx
                    n_t += 1
    tc, tload, row = np.empty(n_t), np.empty(n_t), np.empty(n_t)
    tl, troom = np.empty(n_t, dtype=np.int64), np.empty(n_t, dtype=np.int64)
    for t in range(n_t):
        qm, jx = divmod(t_at[t], jmax - 1)
        qi, m = divmod(qm, mb)
        tc[t], tl[t] = ec[qi, m, jx], el[qi, m, jx]
        troom[t] = room3[s, part[qi], m] + tl[t]
        tload[t] = rc[s, part[qi]]
    best, bi, bt = np.inf, -1, 0
    for i in range(len(a)):
        ca, la = g_cost[a[i]], g_len[a[i]]
        room_a = room_h[i] + la
        for t in range(n_t):
            d = ca - tc[t]
            ok = (d > 0) & (la <= troom[t]) & (tl[t] <= room_a)
            row[t] = max(lh - d, tload[t] + d) if ok else np.inf
        if _beats(row, n_t, best):
            for t in range(n_t):
                if row[t] < best:
                    best, bi, bt = row[t], i, t
    bqm, bj = divmod(t_at[bt], jmax - 1) if n_t else (0, 0)
    bq, bm = divmod(bqm, mb)
    if bi < 0 or not best < lh * _NEAR_ONE:
        return -1, 0, 0, cheap[0, 0, :0].copy()
    return bi, part[bq], bm, cheap[bq, bm, : bj + 2].copy()


@njit
def wide_rounds(
    cost3: np.ndarray,
    room3: np.ndarray,
    rc: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    key: np.ndarray,
    g_cost: np.ndarray,
    g_len: np.ndarray,
    off: np.ndarray,
    lb: np.ndarray,
    ints: np.ndarray,
    floats: np.ndarray,
) -> None:
    """The wide search on every step s of a block (items off[s]..off[s+1]-1), in place. ints: rounds, stall,
    wide partners, a-candidates, partner candidates, multi partners, multi candidates, exchange max; floats:
    tolerance, minimum gain."""
    rounds, stall_max, wide, cand_a, cand_p, multi, cand_m, jmax = (
        ints[0],
        ints[1],
        ints[2],
        ints[3],
        ints[4],
        ints[5],
        ints[6],
        ints[7],
    )
    tolerance, min_gain = floats[0], floats[1]
    n_steps, dp = rc.shape
    top_b = max(cand_p, cand_m) + 1  # _spaced keeps at most this many partner segments
    sw = np.empty((3, top_b))  # the swap candidates' costs, their ranks' loads, one a's values
    swl = np.empty((2, top_b), dtype=np.int64)  # their lengths, the room their slots would have
    most = 0
    for s in range(n_steps):
        most = max(most, off[s + 1] - off[s])
    mark = np.zeros(most, dtype=np.bool_)  # a step's items on the partner ranks (cleared as read)
    for s in range(n_steps):
        a0, b0, base = off[s], off[s + 1], s * dp
        best_max = rc[s].max()
        stall = 0
        for _ in range(rounds):
            load = rc[s].copy()
            top = load.max()
            if top < best_max * (1 - min_gain):
                best_max, stall = top, 0
            else:
                stall += 1
            thr = lb[s] * (1 + tolerance)
            if not (top > thr and stall <= stall_max):
                break
            by = stable_argsort(load)
            items, first = _by_rank(key, a0, b0, base, dp)  # a round's units read only their own ranks
            over = 0
            for r in range(dp):
                if load[r] > thr:
                    over += 1
            p = max(1, min(over, dp // (wide + 1)))
            done = False
            for k in range(p):
                h = by[dp - 1 - k]
                lh = load[h]
                part = _partners(by, k, p, wide, multi)
                a = _spaced(items[first[h] : first[h + 1]], cand_a)
                if len(a) == 0:
                    continue
                na = len(a)
                ma = p_mb[a]
                room_h = np.empty(na, dtype=np.int64)
                for i in range(na):
                    room_h[i] = room3[s, h, ma[i]]
                # moves: a to a partner's roomiest micro-batch
                n_p = len(part)
                best_mb = np.zeros(n_p, dtype=np.int64)
                rmax = np.full(n_p, -1, dtype=np.int64)
                for qi in range(n_p):
                    if part[qi] >= 0:
                        best_mb[qi] = np.argmax(room3[s, part[qi]])
                        rmax[qi] = room3[s, part[qi], best_mb[qi]]
                vm, mi, mq = np.inf, 0, 0
                for i in range(na):
                    ca, la = g_cost[a[i]], g_len[a[i]]
                    for qi in range(n_p):
                        if part[qi] < 0 or la > rmax[qi]:
                            continue
                        pair = max(lh - ca, rc[s, part[qi]] + ca)
                        if pair < vm:
                            vm, mi, mq = pair, i, qi
                if vm <= thr:
                    _move(
                        a[mi], s, h, ma[mi], part[mq], best_mb[mq], cost3, room3, rc, p_rank, p_mb, key, g_cost, g_len
                    )
                    done = True
                    continue
                # swaps: a for one segment b of a partner
                # the partners' segments ascending: where they are 1/32 of the step or more (few ranks), each
                # marked at its place in the step and the places read in order (partners are distinct ranks);
                # else (many ranks: a pass over the step per unit costs more than a sort) their lists sorted
                n_b = 0
                for qi in range(n_p):
                    if part[qi] >= 0:
                        n_b += first[part[qi] + 1] - first[part[qi]]
                on_p = np.empty(n_b, dtype=np.int64)
                by_place = b0 - a0 <= 32 * n_b
                n_b = 0
                for qi in range(n_p):
                    if part[qi] >= 0:
                        q_items = items[first[part[qi]] : first[part[qi] + 1]]
                        if by_place:
                            for it in q_items:
                                mark[it - a0] = True
                        else:
                            on_p[n_b : n_b + len(q_items)] = q_items
                        n_b += len(q_items)
                if by_place:
                    n_b = 0
                    for i in range(b0 - a0):
                        if mark[i]:
                            on_p[n_b] = a0 + i
                            n_b += 1
                            mark[i] = False
                else:
                    on_p.sort()
                b = _spaced(on_p, cand_p if p == 1 else cand_m)
                # b's side of every pair read once (cost, length, the room b's slot would have, its rank's
                # load), then a's row of values without a branch (infeasible: inf, which never wins) and its
                # first best: the pair that testing each in turn takes
                nb = len(b)
                bc, bl, br, bload = sw[0, :nb], swl[0, :nb], swl[1, :nb], sw[1, :nb]
                for j in range(nb):
                    rb = p_rank[b[j]]
                    bc[j], bl[j] = g_cost[b[j]], g_len[b[j]]
                    br[j] = room3[s, rb, p_mb[b[j]]] + bl[j]
                    bload[j] = rc[s, rb]
                vs, si, sj = np.inf, 0, 0
                row = sw[2, :nb]
                for i in range(na):
                    ca, la = g_cost[a[i]], g_len[a[i]]
                    room_a = room_h[i] + la
                    for j in range(nb):
                        d = ca - bc[j]
                        ok = (d > 0) & (la <= br[j]) & (bl[j] <= room_a)
                        row[j] = max(lh - d, bload[j] + d) if ok else np.inf
                    if _beats(row, nb, vs):
                        for j in range(nb):
                            if row[j] < vs:
                                vs, si, sj = row[j], i, j
                if vm <= vs and vm < lh * _NEAR_ONE:
                    _move(
                        a[mi], s, h, ma[mi], part[mq], best_mb[mq], cost3, room3, rc, p_rank, p_mb, key, g_cost, g_len
                    )
                    done = True
                    continue
                if vs < vm and vs < lh * _NEAR_ONE:
                    rb, mbb = p_rank[b[sj]], p_mb[b[sj]]
                    _move(a[si], s, h, ma[si], rb, mbb, cost3, room3, rc, p_rank, p_mb, key, g_cost, g_len)
                    _move(b[sj], s, rb, mbb, h, ma[si], cost3, room3, rc, p_rank, p_mb, key, g_cost, g_len)
                    done = True
                    continue
                # exchanges: a for the j cheapest segments of one partner micro-batch
                xi, xr, xm, back = _exchange(
                    s, a, part, lh, room_h, items, first, cost3, room3, rc, p_mb, g_cost, g_len, jmax
                )
                if xi >= 0:
                    _move(a[xi], s, h, ma[xi], xr, xm, cost3, room3, rc, p_rank, p_mb, key, g_cost, g_len)
                    for it in back:
                        _move(it, s, xr, xm, h, ma[xi], cost3, room3, rc, p_rank, p_mb, key, g_cost, g_len)
                    done = True
            if not done:
                break
