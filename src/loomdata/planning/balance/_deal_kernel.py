"""Compiled LPT rounds (_deal's hot loop): each step of a block dealt round by round, one step after the other.

The same decisions, in the same order, as the rounds NumPy ran in lockstep over a block's steps: a step's
rounds read only that step's slots, so dealing the steps one after the other changes nothing (each slot's
cost is the same float additions in the same order). A round serves the k least loaded ranks (stable order)
whose load is within the round's largest cost of the minimum; each takes its item into its least loaded
micro-batch with room; items whose rank was full go to the least loaded ranks with room (place_whole_step, or
_place_few without allocations for up to 32 of them). At dp > 32 the ranks' order a round (nearly every round
there is dp wide, so every load changed) comes from buckets and an insertion pass (_order_loads), the merge
sort's order exactly.

The dealing order (by step, largest cost first, ties in position order) is found on lengths where they give it
(by_length_order, O(items)), else by sorting costs (by_cost_order).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import _SHORT, njit, stable_argsort, stable_argsort_into

__all__ = ["by_cost_order", "by_length_order", "deal_rounds", "place_whole_step"]

FALLBACK_PASSES = 3  # passes pairing items whose rank was full with ranks that have room, before one by one


RADIX_MIN = 512
RADIX_STEP = 256
"""Blocks of at least RADIX_MIN items and RADIX_STEP items a step on average are ordered by one radix sort
(_radix_order: 1.4 ms a 64K-item block at dp 1024, 6.9 ms step by step); smaller steps one after the other
(insertion or merge sort each: 2.8 ms a 64K-item block of 61-item steps, where the radix sort took 3.2 ms)."""
_SIGN = np.uint64(1 << 63)
_DIGIT = 11  # bits of the key a radix pass sorts on (2048 buckets)


@njit
def by_cost_order(cost: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """Positions of items grouped by step (step i's are cut[i]..cut[i+1]-1) ordered by step, then largest cost
    first, ties in position order: np.lexsort((-cost, step)), a stable sort of each step's items."""
    if len(cost) >= max(RADIX_MIN, RADIX_STEP * (len(cut) - 1)):
        out = _radix_order(cost, cut)
        if len(out) == len(cost):
            return out
    return _steps_order(cost, cut)


LENGTH_SPAN_MIN = 64
"""by_length_order counts lengths when their span (max - min + 1) is at most the block's items or this many;
a wider span (a small block of long segments) leaves the block to by_cost_order."""


@njit
def by_length_order(cost: np.ndarray, length: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """by_cost_order (step, then largest cost first, ties in position order) found as step, then longest first,
    ties in position order: two stable counting passes, on the length then on the step, O(items + span)
    (13-17 ns an item on a 262K-item block of 61-item steps, where by_cost_order took 31-35).

    The same order wherever a step's cost is a strictly increasing function of its items' lengths, as a text
    segment's cost in the short lane is (_cost.segment_cost) unless attention = linear = 0. Each step's order is
    checked against its costs (along it, a longer item costs strictly more than the next, an equal length costs
    the same): a step that fails (images, a zero cost model, several cp sizes, NaN) is sorted on its costs as
    by_cost_order sorts it, so the result is by_cost_order's whatever the costs."""
    n = len(cost)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    lo, hi = length[0], length[0]
    for i in range(n):
        lo = min(lo, length[i])
        hi = max(hi, length[i])
    span = hi - lo + 1
    if span > max(n, LENGTH_SPAN_MIN) or n >= 1 << 32:
        return by_cost_order(cost, cut)
    pos = np.zeros(span + 1, dtype=np.int64)  # longest first: bucket hi - length
    for i in range(n):
        pos[hi - length[i] + 1] += 1
    for v in range(span):
        pos[v + 1] += pos[v]
    key = np.empty(n, dtype=np.int64)  # (step << 32) | item, longest first: the step pass reads no step array
    b = len(cut) - 1
    for s in range(b):
        for i in range(cut[s], cut[s + 1]):
            k = hi - length[i]
            key[pos[k]] = (s << 32) | i
            pos[k] += 1
    nxt = cut[:-1].copy()
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        v = key[i]
        s = v >> 32
        out[nxt[s]] = v & 0xFFFFFFFF
        nxt[s] += 1
    for s in range(b):
        a, e = cut[s], cut[s + 1]
        for j in range(a, e - 1):
            p, q = out[j], out[j + 1]
            if not (cost[p] > cost[q] if length[p] > length[q] else cost[p] == cost[q]):
                o = stable_argsort(-cost[a:e])
                for t in range(e - a):
                    out[a + t] = a + o[t]
                break
    return out


@njit
def _radix_order(cost: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """by_cost_order of a whole block by one LSD radix sort: each cost's descending sort key (the bits of
    0.0 - cost, +0.0 for both zeros, mapped so that unsigned order is float order), _DIGIT bits a pass over the
    bits where keys differ, then a stable counting pass by step. Empty (the caller falls back) when a cost is NaN."""
    n = len(cost)
    neg = np.empty(n)
    for i in range(n):
        if cost[i] != cost[i]:
            return np.empty(0, dtype=np.int64)
        neg[i] = 0.0 - cost[i]
    bits = neg.view(np.uint64)
    key = np.empty(n, dtype=np.uint64)
    differ = np.uint64(0)
    for i in range(n):
        b = bits[i]
        key[i] = ~b if b & _SIGN else b | _SIGN
        differ |= key[i] ^ key[0]
    lo, hi = 0, 0  # the keys differ only in bits lo..hi-1
    while hi < 64 and differ >> np.uint64(hi):
        hi += 1
    while lo < hi and not (differ >> np.uint64(lo)) & np.uint64(1):
        lo += 1
    passes = (hi - lo + _DIGIT - 1) // _DIGIT
    hist = np.zeros((max(passes, 1), 1 << _DIGIT), dtype=np.int64)
    mask = np.uint64((1 << _DIGIT) - 1)
    for i in range(n):
        for d in range(passes):
            hist[d, (key[i] >> np.uint64(lo + _DIGIT * d)) & mask] += 1
    idx = np.arange(n)
    idx2 = np.empty(n, dtype=np.int64)
    key2 = np.empty(n, dtype=np.uint64)
    pos = np.empty(1 << _DIGIT, dtype=np.int64)
    for d in range(passes):
        at = 0
        for v in range(1 << _DIGIT):
            pos[v] = at
            at += hist[d, v]
        shift = np.uint64(lo + _DIGIT * d)
        for i in range(n):
            k = key[i]
            v = (k >> shift) & mask
            p = pos[v]
            pos[v] = p + 1
            key2[p] = k
            idx2[p] = idx[i]
        key, key2 = key2, key
        idx, idx2 = idx2, idx
    step = np.empty(n, dtype=np.int64)
    for s in range(len(cut) - 1):
        step[cut[s] : cut[s + 1]] = s
    nxt = cut[:-1].copy()
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        j = idx[i]
        s = step[j]
        out[nxt[s]] = j
        nxt[s] += 1
    return out


@njit
def _steps_order(cost: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """by_cost_order step by step: a stable argsort of each step's negated costs."""
    out = np.empty(len(cost), dtype=np.int64)
    for i in range(len(cut) - 1):
        a, b = cut[i], cut[i + 1]
        o = stable_argsort(-cost[a:b])
        for j in range(b - a):
            out[a + j] = a + o[j]
    return out


@njit
def _best_slot(cost: np.ndarray, room: np.ndarray, need: int) -> int:
    """The first least loaded micro-batch of one rank with room for `need` tokens, or -1."""
    best, low = -1, np.inf
    for m in range(len(cost)):
        if room[m] >= need and cost[m] < low:
            best, low = m, cost[m]
    return best


@njit
def _commit(
    s: int,
    r: int,
    m: int,
    item: int,
    ln: int,
    c: float,
    cost3: np.ndarray,
    room3: np.ndarray,
    rank_cost: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
) -> None:
    cost3[s, r, m] += c
    room3[s, r, m] -= ln
    rank_cost[s, r] += c
    p_rank[item] = r
    p_mb[item] = m


@njit
def _place_whole(
    s: int,
    i: int,
    length: np.ndarray,
    cost: np.ndarray,
    cost3: np.ndarray,
    room3: np.ndarray,
    rank_cost: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
) -> bool:
    """state.place_whole in step s: item i into the least loaded rank with a slot that has room."""
    dp = room3.shape[1]
    need = length[i]
    r, low = -1, np.inf
    for q in range(dp):
        if room3[s, q].max() >= need and (r < 0 or rank_cost[s, q] < low):
            r, low = q, rank_cost[s, q]
    if r < 0:
        return False
    m = _best_slot(cost3[s, r], room3[s, r], need)
    _commit(s, r, m, i, need, cost[i], cost3, room3, rank_cost, p_rank, p_mb)
    return True


@njit
def place_whole_step(
    s: int,
    items: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    cost3: np.ndarray,
    room3: np.ndarray,
    rank_cost: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
) -> None:
    """Place the failed `items` of step s: passes pairing them, largest first, with the least loaded ranks that
    have room (a pass without candidates ends it), then one by one (_place_whole)."""
    dp = room3.shape[1]
    for _ in range(FALLBACK_PASSES):
        n = len(items)
        if n == 0:
            return
        items = items[stable_argsort(-cost[items])]
        need = length[items].min()
        key = np.full(dp, np.inf)
        n_elig = 0
        for q in range(dp):
            if room3[s, q].max() >= need:
                key[q] = rank_cost[s, q]
                n_elig += 1
        n_c = min(n_elig, n)
        if n_c == 0:
            return
        ranks = stable_argsort(key)
        placed = np.zeros(n, dtype=np.bool_)
        for j in range(n_c):
            i, r = items[j], ranks[j]
            m = _best_slot(cost3[s, r], room3[s, r], length[i])
            if m >= 0:
                _commit(s, r, m, i, length[i], cost[i], cost3, room3, rank_cost, p_rank, p_mb)
                placed[j] = True
        items = items[~placed]
    items = items[stable_argsort(-cost[items])]
    for i in items:
        _place_whole(s, i, length, cost, cost3, room3, rank_cost, p_rank, p_mb)


@njit
def _place_few(
    s: int,
    items: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    cost3: np.ndarray,
    room3: np.ndarray,
    rank_cost: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    x: np.ndarray,
    key: np.ndarray,
    ranks: np.ndarray,
    taken: np.ndarray,
) -> None:
    """place_whole_step(s, items, ...) for at most _SHORT items, allocating nothing (a round's few failed items
    took ~1.2 us of allocations a call; 25% of deal_rounds at dp 4): the same passes, each sorting its items by
    stable_argsort's insertion sort on their negated costs, and taking the least loaded ranks with room in
    stable_argsort's order (its insertion sort where dp <= _SHORT, else the first n_c of the merge sort's order,
    NaN last, picked one by one). `items` is overwritten; x, key, ranks, taken (dp each) are scratch."""
    dp = room3.shape[1]
    n = len(items)
    for _ in range(FALLBACK_PASSES):
        if n == 0:
            return
        _by_cost(items, n, cost, x)
        need = length[items[0]]
        for j in range(1, n):
            need = min(need, length[items[j]])
        n_elig = 0
        for q in range(dp):
            key[q] = np.inf
            if room3[s, q].max() >= need:
                key[q] = rank_cost[s, q]
                n_elig += 1
        n_c = min(n_elig, n)
        if n_c == 0:
            return
        if dp <= _SHORT:
            stable_argsort_into(key, ranks)
        else:
            taken[:] = False
            for t in range(n_c):
                best = -1
                for q in range(dp):
                    if not taken[q] and (best < 0 or _load_lt(key[q], key[best], q, best)):
                        best = q
                taken[best] = True
                ranks[t] = best
        kept = 0
        for j in range(n):
            i = items[j]
            m = -1
            if j < n_c:
                r = ranks[j]
                m = _best_slot(cost3[s, r], room3[s, r], length[i])
                if m >= 0:
                    _commit(s, r, m, i, length[i], cost[i], cost3, room3, rank_cost, p_rank, p_mb)
            if m < 0:
                items[kept] = i
                kept += 1
        n = kept
    _by_cost(items, n, cost, x)
    for j in range(n):
        _place_whole(s, items[j], length, cost, cost3, room3, rank_cost, p_rank, p_mb)


@njit
def _by_cost(items: np.ndarray, n: int, cost: np.ndarray, x: np.ndarray) -> None:
    """items[:n] = items[:n][stable_argsort(-cost[items[:n]])] for n <= _SHORT (its insertion sort, in place)."""
    for i in range(n):
        x[i] = -cost[items[i]]
    for i in range(1, n):
        v, it = x[i], items[i]
        j = i
        while j > 0 and x[j - 1] > v:
            x[j] = x[j - 1]
            items[j] = items[j - 1]
            j -= 1
        x[j] = v
        items[j] = it


SHIFT_BUDGET = 4
"""_order_loads gives up on its buckets (and merge sorts) once its insertion pass has moved more than this many
ranks a rank: loads bunched in a few buckets (an outlier stretching the range)."""


@njit
def _load_lt(a: float, b: float, i: int, j: int) -> bool:
    """Load a (rank i) before load b (rank j) in np.argsort(kind="stable")'s order: ascending, NaN last, ties
    (NaN with NaN, -0.0 with 0.0) by rank."""
    if a < b:
        return True
    if a == b:
        return i < j
    return b != b and (a == a or i < j)


@njit
def _order_loads(x: np.ndarray, out: np.ndarray, bucket: np.ndarray, cnt: np.ndarray) -> None:
    """out[:] = np.argsort(x, kind="stable") (NaN last, ties by rank) of a step's rank loads, without a merge sort:
    one stable counting pass into len(x) buckets of equal width between the least and largest load (the bucket
    is monotone in the load, NaN in its own last bucket), then an insertion pass that orders each bucket's few
    ranks. Rounds at dp > 32 sort every rank (a full-width round changes every load); this is 3-4x faster than
    np.argsort there. Falls back to np.argsort where the range is not finite or the buckets bunch
    (SHIFT_BUDGET). `bucket` (len(x)) and `cnt` (len(x) + 2) are scratch."""
    n = len(x)
    lo, hi = np.inf, -np.inf
    for i in range(n):
        v = x[i]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    span = hi - lo
    scale = (n - 1) / span if span > 0.0 else 0.0
    if not (lo <= hi and span < np.inf and scale < np.inf):
        out[:] = np.argsort(x, kind="mergesort")
        return
    cnt[:] = 0
    for i in range(n):
        v = x[i]
        b = n
        if v == v:
            b = min(int((v - lo) * scale), n - 1)
        bucket[i] = b
        cnt[b + 1] += 1
    for b in range(n + 1):
        cnt[b + 1] += cnt[b]
    for i in range(n):
        b = bucket[i]
        out[cnt[b]] = i
        cnt[b] += 1
    moved = 0
    for i in range(1, n):
        r = out[i]
        v = x[r]
        j = i
        while j > 0 and _load_lt(v, x[out[j - 1]], r, out[j - 1]):
            out[j] = out[j - 1]
            j -= 1
        moved += i - j
        out[j] = r
        if moved > SHIFT_BUDGET * n:
            out[:] = np.argsort(x, kind="mergesort")
            return


@njit
def deal_rounds(
    cost3: np.ndarray,
    room3: np.ndarray,
    rank_cost: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    g_item: np.ndarray,
    start: np.ndarray,
    n_deal: np.ndarray,
    length: np.ndarray,
    all_cost: np.ndarray,
) -> None:
    """Deal every step s of a block: its n_deal[s] short items g_item[start[s]:] (dealing order; their costs
    all_cost[item], lengths length[item]) in LPT rounds into the (steps, dp, mb) slot state, recording p_rank and
    p_mb. The slot state is indexed in place (what _best_slot and _commit do on views, without the views)."""
    dp, mb = cost3.shape[1], cost3.shape[2]
    failed = np.empty(dp, dtype=np.int64)
    rk = np.empty(dp, dtype=np.int64)
    bucket = np.empty(dp, dtype=np.int64)
    cnt = np.empty(dp + 2, dtype=np.int64)
    neg, key = np.empty(dp), np.empty(dp)  # _place_few's scratch
    ranks, taken = np.empty(dp, dtype=np.int64), np.empty(dp, dtype=np.bool_)
    for s in range(cost3.shape[0]):
        at, left = start[s], n_deal[s]
        while left > 0:
            if dp > _SHORT:  # the ranks by load, ties by rank, NaN last: stable_argsort_into's merge sort's order
                _order_loads(rank_cost[s], rk, bucket, cnt)
            else:  # in place (no view)
                for i in range(dp):
                    v = rank_cost[s, i]
                    j = i
                    while j > 0 and rank_cost[s, rk[j - 1]] > v:
                        rk[j] = rk[j - 1]
                        j -= 1
                    rk[j] = i
            thr = rank_cost[s, rk[0]] + all_cost[g_item[at]]
            within = 0
            for q in range(dp):
                if rank_cost[s, q] <= thr:
                    within += 1
            k = min(left, max(within, 1))
            nf = 0
            for e in range(k):
                r, it = rk[e], g_item[at + e]
                ln = length[it]
                m, low = -1, np.inf  # _best_slot, without branches (data-dependent: often mispredicted)
                for x in range(mb):
                    cx = cost3[s, r, x]
                    ok = (room3[s, r, x] >= ln) & (cx < low)
                    m = x if ok else m
                    low = cx if ok else low
                if m < 0:
                    failed[nf] = it
                    nf += 1
                else:  # _commit
                    c = all_cost[it]
                    cost3[s, r, m] += c
                    room3[s, r, m] -= ln
                    rank_cost[s, r] += c
                    p_rank[it] = r
                    p_mb[it] = m
            if nf > _SHORT:
                place_whole_step(s, failed[:nf].copy(), length, all_cost, cost3, room3, rank_cost, p_rank, p_mb)
            elif nf:
                few = failed[:nf]
                _place_few(s, few, length, all_cost, cost3, room3, rank_cost, p_rank, p_mb, neg, key, ranks, taken)
            at += k
            left -= k
