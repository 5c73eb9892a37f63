"""The local search's compiled rounds as they were before the branch-free scans (main 4207467): the pairwise
rounds (_refine_kernel.refine_rounds), the wide rounds (_wide_kernel.wide_rounds) and refine_flat's NumPy set-up
(np.where, np.searchsorted, _state.step_max), kept verbatim as the oracle the randomized tests compare the
current search with (the same placements, slot state and keys, bit for bit)."""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit, stable_argsort
from loomdata.planning.balance._refine import MAX_CANDIDATES, SWAP_ROUNDS, TOLERANCE
from loomdata.planning.balance._state import step_max
from loomdata.planning.balance._wide import (
    EXCHANGE_MAX,
    MULTI_CANDIDATES,
    MULTI_PARTNERS,
    PARTNER_CANDIDATES,
    WIDE_CANDIDATES,
    WIDE_MIN_GAIN,
    WIDE_PARTNERS,
    WIDE_ROUNDS,
    WIDE_STALL,
    WIDE_TOLERANCE,
)

__all__ = ["refine_flat_ref"]

_NEAR_ONE = 1 - 1e-12


def refine_flat_ref(
    cost3: np.ndarray,
    room3: np.ndarray,
    lane3: np.ndarray,
    rc: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    g_cost: np.ndarray,
    g_len: np.ndarray,
    movable: np.ndarray,
    step_of: np.ndarray,
) -> np.ndarray:
    """_refine.refine_flat at main 4207467 (its arguments updated in place): returns the keys it left."""
    n_steps, dp = rc.shape
    if dp < 2 or n_steps == 0:
        return np.zeros(0, dtype=np.int64)
    key = np.where(movable, step_of * dp + p_rank, n_steps * dp)
    off = np.searchsorted(step_of, np.arange(n_steps + 1))
    g_cost = np.ascontiguousarray(g_cost, dtype=np.float64)
    g_len = g_len.astype(np.int64, copy=False)
    refine_rounds_ref(
        cost3, room3, lane3, rc, p_rank, p_mb, g_cost, g_len, key, off, SWAP_ROUNDS, TOLERANCE, MAX_CANDIDATES
    )
    top = step_max(g_cost[:-1][p_rank >= 0], step_of[p_rank >= 0], n_steps)
    lb = np.maximum(rc.sum(axis=1) / dp, top)
    ints = np.array(
        [
            WIDE_ROUNDS,
            WIDE_STALL,
            WIDE_PARTNERS,
            WIDE_CANDIDATES,
            PARTNER_CANDIDATES,
            MULTI_PARTNERS,
            MULTI_CANDIDATES,
            EXCHANGE_MAX,
        ],
        dtype=np.int64,
    )
    wide_rounds_ref(
        cost3,
        room3,
        rc,
        p_rank,
        p_mb,
        key,
        g_cost,
        g_len,
        np.searchsorted(step_of, np.arange(n_steps + 1)),
        np.ascontiguousarray(lb, dtype=np.float64),
        ints,
        np.array([WIDE_TOLERANCE, WIDE_MIN_GAIN]),
    )
    return key


@njit
def _rank_lists(
    key: np.ndarray, a: int, b: int, base: int, dp: int, spare: int, at: np.ndarray, n: np.ndarray, buf: np.ndarray
) -> None:
    """Each rank's movable items of a step (items a..b-1 whose key is base + rank), ascending: rank r's are
    buf[at[r] : at[r] + n[r]], with room for `spare` more (a step's rounds add at most one item to a rank each)."""
    n[:] = 0
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
def refine_rounds_ref(
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
    buf = np.empty(most + dp * rounds, dtype=np.int64)
    # the light rank's candidates' costs, lengths and the room a pair leaves there (cap + 1 at most)
    jc = np.empty(cap + 2)
    jl = np.empty(cap + 2, dtype=np.int64)
    jr = np.empty(cap + 2, dtype=np.int64)
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
                _rank_lists(key, a0, b0, s * dp, dp, rounds, at, cnt, buf)
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
                for j in range(nb):
                    delta = ca - jc[j]
                    if delta <= 0 or delta >= gap or la > jr[j] or jl[j] > room_hi:
                        continue
                    score = abs(delta - half)
                    if score < best:
                        best, bi, bj = score, i, j
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
    for qi in range(n_p):
        if part[qi] < 0:
            continue
        on = items[first[part[qi]] : first[part[qi] + 1]]
        for m in range(mb):
            buf = np.empty(len(on), dtype=np.int64)
            n = 0
            for i in on:
                if p_mb[i] == m:
                    buf[n] = i
                    n += 1
            if n < 2:
                continue
            mine = buf[:n][stable_argsort(g_cost[buf[:n]])]
            cs, ls = g_cost[mine[0]], g_len[mine[0]]
            cheap[qi, m, 0] = mine[0]
            for t in range(1, min(n, jmax)):
                cs += g_cost[mine[t]]
                ls += g_len[mine[t]]
                cheap[qi, m, t] = mine[t]
                ec[qi, m, t - 1], el[qi, m, t - 1] = cs, ls
    best, bi, bq, bm, bj = np.inf, -1, 0, 0, 0
    for i in range(len(a)):
        ca, la = g_cost[a[i]], g_len[a[i]]
        for qi in range(n_p):
            if part[qi] < 0:
                continue
            ler = rc[s, part[qi]]
            for m in range(mb):
                room_e = room3[s, part[qi], m]
                for jx in range(jmax - 1):
                    if not np.isfinite(ec[qi, m, jx]):
                        continue
                    d = ca - ec[qi, m, jx]
                    if d <= 0 or la > room_e + el[qi, m, jx] or el[qi, m, jx] > room_h[i] + la:
                        continue
                    pair = max(lh - d, ler + d)
                    if pair < best:
                        best, bi, bq, bm, bj = pair, i, qi, m, jx
    if bi < 0 or not best < lh * _NEAR_ONE:
        return -1, 0, 0, cheap[0, 0, :0].copy()
    return bi, part[bq], bm, cheap[bq, bm, : bj + 2].copy()


@njit
def wide_rounds_ref(
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
                n_b = 0
                for qi in range(n_p):
                    if part[qi] >= 0:
                        n_b += first[part[qi] + 1] - first[part[qi]]
                on_p = np.empty(n_b, dtype=np.int64)
                n_b = 0
                for qi in range(n_p):
                    if part[qi] >= 0:
                        q_items = items[first[part[qi]] : first[part[qi] + 1]]
                        on_p[n_b : n_b + len(q_items)] = q_items
                        n_b += len(q_items)
                b = _spaced(np.sort(on_p), cand_p if p == 1 else cand_m)
                vs, si, sj = np.inf, 0, 0
                for i in range(na):
                    ca, la = g_cost[a[i]], g_len[a[i]]
                    for j in range(len(b)):
                        cb, lbn = g_cost[b[j]], g_len[b[j]]
                        rb, mbb = p_rank[b[j]], p_mb[b[j]]
                        d = ca - cb
                        if d <= 0 or la > room3[s, rb, mbb] + lbn or lbn > room_h[i] + la:
                            continue
                        pair = max(lh - d, rc[s, rb] + d)
                        if pair < vs:
                            vs, si, sj = pair, i, j
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
