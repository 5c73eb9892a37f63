"""Compiled membership passes: the nearest pointers and the repair (planning._mixture).

`nearest_column` does what NumPy did over a source's targets (a searchsorted, a running maximum down the
steps). The targets themselves are NumPy's cumsums a block at a time (planning._mixture.CumulativeTargets).
The repair (`repair_rows`) is a pass over a chunk of steps, deferring segments
of the source most ahead of its target until each step fits its slots.

Per step it sums the sources' short-lane tokens and long-lane segments between the repaired pointer row before
the step and the nearest row after it (integers: exact); a step that overflows defers, one segment at a time,
from the source whose count is furthest ahead of its target (the first such source on ties), as the
per-step loop it replaces did, then gives back deferred segments that fit again, least ahead first (planner
version 10: deferring a large segment last used to leave its step part empty, and on one slot a source with long
documents could stay behind its share for good). The counts come as the chunk's window of every source's
stream, laid end to end (`off`: where each source's window starts; `lo`: the stream position of its first entry).
"""

from __future__ import annotations

import numba
import numpy as np

from loomdata.planning._jit import njit

__all__ = [
    "changes_by_source",
    "held_membership",
    "held_rows",
    "held_targets",
    "nearest_column",
    "nearest_run",
    "repair_rows",
]


@njit
def nearest_column(cum: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[t + 1] = the running maximum over steps <= t of the prefix length j whose cum[j] is nearest to x[t]
    (one source's targets; ties go to the shorter prefix; searched as the target's ceiling, as
    planning._mixture's _nearest does); out[0] is left as it is: nearest_run from the first step."""
    state = np.zeros(2, dtype=np.int64)
    nearest_run(cum, x, out[1:], state)


@njit
def nearest_run(cum: np.ndarray, x: np.ndarray, out: np.ndarray, state: np.ndarray) -> None:
    """out[t] = the running maximum of the nearest prefix lengths of x[..t] (nearest_column's, for a run of a
    source's steps), carried on from `state` (the last search's answer j and the running maximum, updated:
    zeros before the first step). Targets of a source do not decrease, so each search walks on from the last
    one (a binary search where one goes back)."""
    n = len(cum)
    j = state[0]
    best = state[1]
    for t in range(len(x)):
        xt = x[t]
        needle = np.int64(np.ceil(xt))
        if j > 0 and cum[j - 1] >= needle:  # behind the last answer: search [0, j)
            lo, hi = 0, j
            while lo < hi:
                mid = (lo + hi) >> 1
                if cum[mid] < needle:
                    lo = mid + 1
                else:
                    hi = mid
            j = lo
        else:
            while j < n and cum[j] < needle:
                j += 1
        at = min(j, n - 1)
        lower = max(at - 1, 0)
        pick = lower if at > 0 and (xt - cum[lower]) <= (cum[at] - xt) else at
        best = max(best, pick)
        out[t] = best
    state[0] = j
    state[1] = best


WALK_MAX = 64
"""A step's deferrals (repair_rows', held_membership's) walked one segment at a time up to this many; past it, and
where the segments it could still defer are at least WALK_MAX a drawing source (a search by level costs about
sources x log^2 of them), the rest are found by level (`_to_level`): a step at dp 1 whose
sources run a backlog ahead of what fits its rows defers thousands of segments a step."""


@njit
def _backlog(base: np.ndarray, r: np.ndarray) -> int:
    """Segments a step could still defer (its pointers r above the step's first ones, base)."""
    n = 0
    for k in range(len(r)):
        n += r[k] - base[k]
    return n


@njit
def _active_backlog(active: np.ndarray, na: int, cur: np.ndarray, rr: np.ndarray) -> int:
    """held_membership's `_backlog`: over its drawing sources (active[:na], pointers rr from cur)."""
    n = 0
    for i in range(na):
        n += rr[i] - cur[active[i]]
    return n


@njit
def _kept_at(cw: np.ndarray, at0: int, lo: int, hi: int, acc_k: float, v: float) -> int:
    """The last position p in lo..hi (lo: the step's first pointer) whose deferral's key, cw[at0 + p] - acc_k (the
    deferral loop's `ahead` of a source whose pointer is at p), is <= v: lo where none is (keys grow with p). Both
    passes: at0 is where the source's cumulative tokens start less its first position."""
    a, b = lo + 1, hi
    while a <= b:
        m = (a + b) // 2
        if cw[at0 + m] - acc_k <= v:
            a = m + 1
        else:
            b = m - 1
    return b


@njit
def _step_tokens(
    of: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], base: np.ndarray, r: np.ndarray
) -> tuple[int, int]:
    """(short tokens, long segments) of a step whose sources' pointers go from `base` to `r`; `of`: (short tokens,
    long segments, each source's offset into both less its first position, its long offset or -1 for none)."""
    short_of, long_of, at0, l0 = of
    short = n_long = 0
    for i in range(len(r)):
        short += short_of[at0[i] + r[i]] - short_of[at0[i] + base[i]]
        if l0[i] >= 0:
            n_long += long_of[l0[i] + r[i]] - long_of[l0[i] + base[i]]
    return short, n_long


@njit
def _to_level(
    cum: np.ndarray,
    of: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    base: np.ndarray,
    r: np.ndarray,
    tgt: np.ndarray,
    ids: np.ndarray,
    sl: int,
    seq_len: int,
) -> tuple[int, int]:
    """The rest of a step's deferrals by level (both passes' loop: the source furthest ahead, the first source on
    ties, one segment at a time until the step fits its `sl` slots) in O(sources x log^2 backlog). Source i (id
    ids[i], pointers from base[i], now r[i], updated in place) at pointer p defers at key cum[at0[i] + p] - tgt[i],
    increasing in p (at0 = of[2]), so the loop defers in decreasing key order. v*, the smallest key whose kept
    segments still overflow the step, is found by halving the widest source's range of candidate keys; every key >
    v* is deferred, then the sources at v* in id order until the step fits. Returns (short tokens, long segments)."""
    at0 = of[2]
    n = len(r)
    a_p = base + 1  # candidate keys: source i's pointers a_p[i]..b_p[i]
    b_p = r.copy()
    cut = np.empty(n, dtype=np.int64)
    best = np.inf  # the smallest key found that overflows (the largest key does: the step overflows)
    while True:
        w = 0
        bi = -1
        for i in range(n):
            if b_p[i] - a_p[i] + 1 > w:
                w = b_p[i] - a_p[i] + 1
                bi = i
        if bi < 0:
            break
        m = (a_p[bi] + b_p[bi]) // 2
        v = cum[at0[bi] + m] - tgt[bi]
        for i in range(n):
            cut[i] = _kept_at(cum, at0[i], base[i], r[i], tgt[i], v)
        short, n_long = _step_tokens(of, base, cut)
        if not (n_long <= sl and short <= (sl - n_long) * seq_len):  # v* <= v: keys >= v out of the running
            best = min(best, v)
            for i in range(n):
                b = cut[i]
                if b > base[i] and cum[at0[i] + b] - tgt[i] == v:
                    b -= 1
                b_p[i] = min(b_p[i], b)
        else:  # v* > v: keys <= v out
            for i in range(n):
                a_p[i] = max(a_p[i], cut[i] + 1)
    for i in range(n):
        r[i] = _kept_at(cum, at0[i], base[i], r[i], tgt[i], best)
    short, n_long = _step_tokens(of, base, r)
    while not (n_long <= sl and short <= (sl - n_long) * seq_len):  # the sources at v*, the first id first
        bi = -1
        for i in range(n):
            if r[i] > base[i] and cum[at0[i] + r[i]] - tgt[i] == best and (bi < 0 or ids[i] < ids[bi]):
                bi = i
        r[bi] -= 1
        short, n_long = _step_tokens(of, base, r)
    return short, n_long


@njit
def repair_rows(
    ptr: np.ndarray,
    targets: np.ndarray,
    counts: tuple[np.ndarray, np.ndarray, np.ndarray],
    off: tuple[np.ndarray, np.ndarray],
    lo: np.ndarray,
    slots: np.ndarray,
    seq_len: int,
    steps: tuple[int, int],
    prior: np.ndarray,
    n_of: np.ndarray,
    budget: np.ndarray,
) -> int:
    """Rewrite ptr[t + 1] (nearest pointers on entry) for every step t of steps[0]..steps[1]-1 that overflows its
    slots (`targets`: those steps' rows, row 0 being steps[0]'s; `prior`: the row of the step before steps[0]),
    or that draws nothing (the fill: `fill_pick`); after an overflowing step's deferrals, the give-back: while a
    deferred segment fits again (the slots, and `budget[t]` tokens counting a long segment as a sequence's), the
    next one of the source least ahead of its target is drawn back (a large segment deferred last can leave room
    that the others' deferred segments fill). counts: the windows' tokens, short-lane tokens and long-lane
    segments (a source without a long lane has an empty long window); off: where each source's window starts in
    them (tokens and short, long); n_of: each source's whole stream length (len(cum)).

    A step's pointer is max(its nearest, the step before's) (a filled segment stays drawn). Returns steps[1],
    or the first step whose fill would read past a source's window (ptr[t] final, ptr[t + 1] raised to it: the
    caller widens the windows and calls again from that step) or its stream's end (the caller refuses)."""
    cum, short_of, long_of = counts
    off_s, off_l = off
    n_src = ptr.shape[1]
    t0 = steps[0]
    r = np.empty(n_src, dtype=np.int64)
    ahead = np.empty(n_src)
    for t in range(steps[0], steps[1]):
        short = n_long = 0
        drew = False
        for k in range(n_src):
            if ptr[t + 1, k] < ptr[t, k]:  # after a fill: a pointer never goes back
                ptr[t + 1, k] = ptr[t, k]
            p, q = ptr[t, k] - lo[k], ptr[t + 1, k] - lo[k]
            drew = drew or q > p
            short += short_of[off_s[k] + q] - short_of[off_s[k] + p]
            if off_l[k + 1] > off_l[k]:
                n_long += long_of[off_l[k] + q] - long_of[off_l[k] + p]
        sl = slots[t]
        if n_long <= sl and short <= (sl - n_long) * seq_len:
            if not drew:
                before = prior if t == t0 else targets[t - t0 - 1]
                k = fill_pick(ptr[t], targets[t - t0], before, counts, off, lo, n_of, sl, seq_len)
                if k == -2:
                    return t
                if k >= 0:
                    ptr[t + 1, k] = ptr[t, k] + 1
            continue
        for k in range(n_src):
            r[k] = ptr[t + 1, k]
            ahead[k] = cum[off_s[k] + r[k] - lo[k]] - targets[t - t0, k] if r[k] > ptr[t, k] else -np.inf
        nd = 0
        while True:
            if nd >= WALK_MAX and nd % WALK_MAX == 0 and _backlog(ptr[t], r) >= WALK_MAX * n_src:
                # a backlog: the rest by level, not a segment at a time
                at0 = off_s[:n_src] - lo
                l0 = np.where(off_l[1:] > off_l[:-1], off_l[:n_src] - lo, -1)
                of = (short_of, long_of, at0, l0)
                ids = np.arange(n_src)
                short, n_long = _to_level(cum, of, ptr[t].astype(np.int64), r, targets[t - t0], ids, sl, seq_len)
                break
            nd += 1
            k = int(np.argmax(ahead))
            at = off_s[k] + r[k] - lo[k]
            short -= short_of[at] - short_of[at - 1]
            if off_l[k + 1] > off_l[k]:
                at_l = off_l[k] + r[k] - lo[k]
                n_long -= long_of[at_l] - long_of[at_l - 1]
            r[k] -= 1
            ahead[k] = cum[at - 1] - targets[t - t0, k] if r[k] > ptr[t, k] else -np.inf
            if n_long <= sl and short <= (sl - n_long) * seq_len:
                break
        # the give-back (while the budget leaves a token): a deferred segment that fits again, of the source least
        # ahead of its target (first on ties)
        while budget[t] > short + n_long * seq_len:
            best = -1
            bv = np.inf
            for k in range(n_src):
                if r[k] >= ptr[t + 1, k]:
                    continue
                at = off_s[k] + r[k] + 1 - lo[k]
                d_long = 0
                if off_l[k + 1] > off_l[k]:
                    at_l = off_l[k] + r[k] + 1 - lo[k]
                    d_long = long_of[at_l] - long_of[at_l - 1]
                d_short = short_of[at] - short_of[at - 1]
                if n_long + d_long > sl or short + d_short > (sl - n_long - d_long) * seq_len:
                    continue
                if short + d_short + (n_long + d_long) * seq_len > budget[t]:  # (a long segment fills a slot)
                    continue
                v = cum[at] - targets[t - t0, k]
                if v < bv:
                    bv = v
                    best = k
            if best < 0:
                break
            at = off_s[best] + r[best] + 1 - lo[best]
            short += short_of[at] - short_of[at - 1]
            if off_l[best + 1] > off_l[best]:
                at_l = off_l[best] + r[best] + 1 - lo[best]
                n_long += long_of[at_l] - long_of[at_l - 1]
            r[best] += 1
        ptr[t + 1] = r
    return steps[1]


@njit
def fill_pick(
    row: np.ndarray,
    target: np.ndarray,
    before: np.ndarray,
    counts: tuple[np.ndarray, np.ndarray, np.ndarray],
    off: tuple[np.ndarray, np.ndarray],
    lo: np.ndarray,
    n_of: np.ndarray,
    sl: int,
    seq_len: int,
) -> int:
    """The fill of a step that draws nothing (repair_rows' mirror): the source whose next segment leaves it least
    ahead of its target (argmin of cum[row + 1] - target, the first source on ties) among the sources weighted at
    the step (target above the step before's) whose next segment fits the step's `sl` slots alone. -1: none;
    -2: a weighted source's next segment lies past its window (the caller widens it) or past its stream's end (the
    caller refuses the step: how far a stream was built must not change a plan)."""
    cum, short_of, long_of = counts
    off_s, off_l = off
    best = -1
    bv = np.inf
    for k in range(len(row)):
        if not target[k] > before[k]:
            continue
        if row[k] + 1 >= n_of[k]:
            return -2
        at = row[k] + 1 - lo[k]
        if at >= off_s[k + 1] - off_s[k]:
            return -2
        n_long = long_of[off_l[k] + at] - long_of[off_l[k] + at - 1] if off_l[k + 1] > off_l[k] else 0
        short = short_of[off_s[k] + at] - short_of[off_s[k] + at - 1]
        if n_long > sl or short > (sl - n_long) * seq_len:
            continue
        v = cum[off_s[k] + at] - target[k]
        if v < bv:
            bv = v
            best = k
    return best


@njit
def held_targets(last: np.ndarray, budget: np.ndarray, acc: np.ndarray) -> None:
    """acc[k] += last[k] * float64(budget[t]), step after step: the last row of CumulativeTargets.rows' cumsum over
    steps whose weights are all the held row `last` (the same products and the same additions in the same order,
    so bit for bit; no (steps x sources) block made)."""
    for t in range(len(budget)):
        b = np.float64(budget[t])
        for k in range(len(acc)):
            acc[k] = acc[k] + last[k] * b


@njit
def held_rows(last: np.ndarray, budget: np.ndarray, acc: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> None:
    """held_targets, each step's running sums also written as rows[t] and cols[:, t]: CumulativeTargets.rows of
    steps whose weights are all the held row `last` (`acc`: the row before them, zeros for the first step) and
    that block transposed, in one pass, bit for bit."""
    for t in range(len(budget)):
        b = np.float64(budget[t])
        for k in range(len(acc)):
            v = acc[k] + last[k] * b
            acc[k] = v
            rows[t, k] = v
            cols[k, t] = v


@numba.njit(cache=True, nogil=True, inline="always")
def _near_at(cw: np.ndarray, sh: int, n: int, end: int, j: int, xt: float) -> tuple[int, int, float]:
    """nearest_run's step for one source at target xt, its search at j (cw[sh + i] is its cum[i] for i below `end`,
    its window's end; n: its stream's length): the search's new answer, the nearest prefix, and a target below
    which the prefix does not change (the pick is re-worked out only past it: the prefix is monotone in the target,
    and targets here do not decrease).

    Inlined (numba's inline="always", not planning._jit.njit): held_membership calls it about once a segment drawn
    (9.9M times at 300 sources x dp 4), and as a call, its arguments pushed on the stack and its tuple returned
    through memory, it was half of that loop's time; inlined, held_membership runs in 0.37 instead of 0.39-0.41 s
    (the same changes; a branchless walk and prefix choice on top gained nothing)."""
    needle = np.int64(np.ceil(xt))
    if j > 0 and cw[sh + j - 1] >= needle:  # (targets do not decrease here: kept as nearest_run has it)
        lo, hi = 0, j
        while lo < hi:
            mid = (lo + hi) >> 1
            if cw[sh + mid] < needle:
                lo = mid + 1
            else:
                hi = mid
        j = lo
    else:
        while j < n and cw[sh + j] < needle:
            j += 1
    at = min(j, n - 1)
    lower = max(at - 1, 0)
    a = cw[sh + lower]
    c = cw[sh + at]
    if at > 0 and (xt - a) <= (c - xt):
        # lower until x passes the midpoint; re-checked well before it (rounding of x - a and c - x is far
        # below a token at any count a float64 holds exactly)
        return j, lower, _below_mid(a, c)
    # the pick is `at` until x passes the midpoint of cum[at] and cum[at + 1] (past cum[at] the search moves on to
    # at + 1, whose lower neighbour is `at`: the same pick), so the search is not re-worked out at cum[at] itself
    # (the answer j may lag by one: the walk from it finds the same j); none past the stream's last prefix; where
    # cum[at + 1] lies past the window (`end`), at cum[at] (a token early), which the run's targets do not pass
    if at + 1 >= n:
        return j, at, np.inf
    return j, at, _below_mid(c, cw[sh + at + 1]) if at + 1 < end else np.float64(c) - 1.0


@njit
def _below_mid(a: int, c: int) -> float:
    """A target a token (and a relative 1e-9) below the midpoint of the counts a <= c: where the nearest of the
    two may next change, early enough for any rounding of x - a and c - x."""
    return 0.5 * (np.float64(a) + np.float64(c)) - 1.0 - 1e-9 * np.float64(c)


@njit
def _held_fill(
    cw: np.ndarray,
    shift: np.ndarray,
    whi: np.ndarray,
    n_of: np.ndarray,
    acc: np.ndarray,
    prior: np.ndarray,
    cur: np.ndarray,
    room: int,
) -> int:
    """held_membership's fill (fill_pick's rule without a long lane; `room`: the step's slots x seq_len): the source,
    -1 for none, -2 where a weighted source's next segment lies past its window or its stream's end."""
    best = -1
    bv = np.inf
    for k in range(len(acc)):
        c = cur[k]
        if not acc[k] > prior[k]:
            continue
        if c + 1 >= n_of[k] or c + 1 >= whi[k]:
            return -2
        at = shift[k] + c + 1
        if cw[at] - cw[at - 1] > room:
            continue
        v = cw[at] - acc[k]
        if v < bv:
            bv = v
            best = k
    return best


HEAP_AFTER = 24
"""held_membership's deferrals in a step scan the drawing sources for np.argmax this many times, then keep them in
a heap (a backlog of ~170 drawing sources deferring ~150 segments a step spent most of membership in the scans;
a plan's step defers ~6 over ~65, where building the heap after 8 cost its held pass 4-13%)."""


@njit
def _sift_down(heap: np.ndarray, n: int, i: int, ahead: np.ndarray, active: np.ndarray) -> None:
    """Restore the heap order of heap[:n] below position i: each entry indexes ahead and active, and comes before
    another further ahead, or as far ahead and of the first source (np.argmax's order of the sources)."""
    x = heap[i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n:
            u, v = heap[c + 1], heap[c]
            if ahead[u] > ahead[v] or (ahead[u] == ahead[v] and active[u] < active[v]):
                c += 1
        y = heap[c]
        if not (ahead[y] > ahead[x] or (ahead[y] == ahead[x] and active[y] < active[x])):
            break
        heap[i] = y
        i = c
    heap[i] = x


@njit
def held_membership(
    windows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    last: np.ndarray,
    budgets: tuple[np.ndarray, np.ndarray],
    acc: np.ndarray,
    prior: np.ndarray,
    state: np.ndarray,
    cur: np.ndarray,
    slots: np.ndarray,
    seq_len: int,
    resume: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Membership of a run of steps whose weights are all the held row `last`, in one pass without a (steps x
    sources) block: each step's targets (held_rows' floats), each source's nearest pointer (nearest_run's search,
    carried on in `state`, re-worked out only where the target passes a point where it may change), the sum over
    the sources that draw (nearest pointer past the repaired one, `cur`) and repair_rows' deferrals and give-back
    where the step overflows its slots: the same pointers bit for bit. Sources with no long lane only (their
    cumulative tokens are their short-lane tokens).

    `windows`: (cw, off, lo, n): the run's window of every source's cumulative tokens laid end to end (source k's
    stream position lo[k] at cw[off[k]]; n[k] its whole stream's length), reaching every position the run reads.
    `budgets`: (each step's token budget, each step's give-back room: repair_rows' `budget`).
    `acc`, `prior` (the targets of the step before acc's), `state` and `cur` (the repaired row before the run) are
    updated to the run's last step. A step that draws nothing draws the fill's segment (repair_rows' fill_pick).
    Returns the run's changes in step order: (local step, source, repaired pointer after the step) of each (step,
    source) whose pointer moved, what compress_rows would find in the dense rows; and the steps done: len(budget),
    or the step whose fill would read past a source's window (its targets and nearest pointers worked out, its
    changes not: the caller widens the windows and calls again from it with `resume`, which skips that work)."""
    cw, off, wlo, n_of = windows
    budget, give = budgets
    n_src = len(acc)
    whi = np.empty(n_src, dtype=np.int64)  # each source's window end (stream positions)
    for k in range(n_src):
        whi[k] = wlo[k] + (off[k + 1] if k + 1 < n_src else len(cw)) - off[k]
    r = len(budget)
    cap = max(1024, min(len(cw), r * n_src))  # (a change moves a pointer on inside its window: never more)
    e_step = np.empty(cap, dtype=np.int32)
    e_src = np.empty(cap, dtype=np.int32)
    e_val = np.empty(cap, dtype=np.int64)
    m = 0
    shift = off - wlo  # cw[shift[k] + j] is source k's cum[j]
    nxt = np.full(n_src, -np.inf)  # each source's next target to re-work out its pick at (-inf: at once)
    is_on = np.zeros(n_src, dtype=np.bool_)
    active = np.empty(n_src, dtype=np.int64)  # sources whose nearest pointer is past the repaired one
    na = 0
    for k in range(n_src):
        if state[k, 1] > cur[k]:
            is_on[k] = True
            active[na] = k
            na += 1
    rr = np.empty(n_src, dtype=np.int64)
    hits = np.empty(n_src + 1, dtype=np.int64)  # (one spare: the last source is written before it is counted)
    ahead = np.empty(n_src)
    heap = np.empty(n_src, dtype=np.int64)
    for t in range(r):
        if not (resume and t == 0):  # (resume: the step's targets and nearest pointers were worked out before)
            b = np.float64(budget[t])
            for k in range(n_src):  # every source's target (a loop of its own: vectorised, the same float adds)
                prior[k] = acc[k]
                acc[k] = acc[k] + last[k] * b
            nh = 0
            for k in range(n_src):  # the sources whose target passed their next point, listed without a branch
                hits[nh] = k
                nh += acc[k] > nxt[k]
            for h in range(nh):  # (a branch a source and step mispredicted often: 66 -> 42 ms a 14K-step run)
                k = hits[h]
                j, pick, nx = _near_at(cw, shift[k], n_of[k], whi[k], state[k, 0], acc[k])
                state[k, 0] = j
                nxt[k] = nx
                if pick > state[k, 1]:
                    state[k, 1] = pick
                    if not is_on[k] and pick > cur[k]:
                        is_on[k] = True
                        active[na] = k
                        na += 1
        short = 0
        for i in range(na):
            k = active[i]
            rr[i] = state[k, 1]
            short += cw[shift[k] + rr[i]] - cw[shift[k] + cur[k]]
        sl = slots[t]
        over = short > sl * seq_len
        if over and na == 1:  # one drawing source: its deferrals end at the last position that fits
            k = active[0]
            lo = shift[k] + cur[k]  # (a search, not a walk back over a backlog of deferred segments: O(log) a step)
            rr[0] = cur[k] + np.searchsorted(cw[lo : shift[k] + rr[0] + 1], cw[lo] + sl * seq_len, side="right") - 1
            short = cw[shift[k] + rr[0]] - cw[lo]
        elif over:  # repair_rows' deferrals, over the sources that draw (the others are -inf there)
            for i in range(na):
                k = active[i]
                ahead[i] = cw[shift[k] + rr[i]] - acc[k]
            nd = 0  # deferrals so far: past HEAP_AFTER of them, np.argmax is the top of a heap of the drawing sources
            while True:
                if nd < HEAP_AFTER:
                    bi = 0
                    for i in range(1, na):  # np.argmax over the sources: the largest, the first source on ties
                        if ahead[i] > ahead[bi] or (ahead[i] == ahead[bi] and active[i] < active[bi]):
                            bi = i
                else:
                    if nd == HEAP_AFTER:
                        for i in range(na):
                            heap[i] = i
                        for i in range(na // 2 - 1, -1, -1):
                            _sift_down(heap, na, i, ahead, active)
                    bi = heap[0]
                k = active[bi]
                at = shift[k] + rr[bi]
                short -= cw[at] - cw[at - 1]
                rr[bi] -= 1
                ahead[bi] = cw[at - 1] - acc[k] if rr[bi] > cur[k] else -np.inf
                if short <= sl * seq_len:
                    break
                if nd >= WALK_MAX and nd % WALK_MAX == 0 and _active_backlog(active, na, cur, rr) >= WALK_MAX * na:
                    # a backlog: the rest by level, not a segment at a time
                    ids = active[:na]
                    of = (cw, cw[:0], shift[ids], np.full(na, -1, dtype=np.int64))
                    short = _to_level(cw, of, cur[ids], rr[:na], acc[ids], ids, sl, seq_len)[0]
                    break
                if nd >= HEAP_AFTER:  # only the top's value fell: back down to its place
                    _sift_down(heap, na, 0, ahead, active)
                nd += 1
        if over:
            # repair_rows' give-back (while the room leaves a token): a deferred segment that fits again, least ahead
            while give[t] > short:
                bi = -1
                bv = np.inf
                for i in range(na):
                    k = active[i]
                    if rr[i] >= state[k, 1]:
                        continue
                    at = shift[k] + rr[i] + 1
                    if short + cw[at] - cw[at - 1] > give[t]:
                        continue
                    v = cw[at] - acc[k]
                    if v < bv or (v == bv and k < active[bi]):
                        bv = v
                        bi = i
                if bi < 0:
                    break
                at = shift[active[bi]] + rr[bi] + 1
                short += cw[at] - cw[at - 1]
                rr[bi] += 1
        if m + na + 1 > cap:  # (one more: a fill)
            cap = max(2 * cap, m + na + 1)
            s2 = np.empty(cap, dtype=np.int32)
            s2[:m] = e_step[:m]
            e_step = s2
            k2 = np.empty(cap, dtype=np.int32)
            k2[:m] = e_src[:m]
            e_src = k2
            v2 = np.empty(cap, dtype=np.int64)
            v2[:m] = e_val[:m]
            e_val = v2
        if na == 0:  # the step draws nothing: the fill (fill_pick's rule, no long lane here)
            best = _held_fill(cw, shift, whi, n_of, acc, prior, cur, sl * seq_len)
            if best == -2:
                return e_step[:m], e_src[:m], e_val[:m], t
            if best >= 0:
                e_step[m] = t
                e_src[m] = best
                e_val[m] = cur[best] + 1
                m += 1
                cur[best] += 1
            continue
        keep = 0
        for i in range(na):
            k = active[i]
            if rr[i] != cur[k]:
                e_step[m] = t
                e_src[m] = k
                e_val[m] = rr[i]
                m += 1
                cur[k] = rr[i]
            if state[k, 1] > cur[k]:  # deferred: still draws next step
                active[keep] = k
                keep += 1
            else:
                is_on[k] = False
        na = keep
    return e_step[:m], e_src[:m], e_val[:m], r


@njit
def changes_by_source(
    step: np.ndarray, src: np.ndarray, val: np.ndarray, base: np.ndarray, step_out: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """A chunk's changes (local step, source, pointer after: in step order) laid out by source, step order kept
    within one, in one counting pass and one scatter: (indptr: where each source's entries start, the pointers
    less base[source] (int64), the least of them and 0, the most of them and 0); their steps are written into
    `step_out` (its dtype: the chunk's step type)."""
    m = len(step)
    n_src = len(base)
    indptr = np.zeros(n_src + 1, dtype=np.int64)
    for i in range(m):
        indptr[src[i] + 1] += 1
    for k in range(n_src):
        indptr[k + 1] += indptr[k]
    cursor = indptr[:-1].copy()
    out_end = np.empty(m, dtype=np.int64)
    low = 0
    most = 0
    for i in range(m):
        k = src[i]
        c = cursor[k]
        step_out[c] = step[i]
        v = val[i] - base[k]
        out_end[c] = v
        low = min(low, v)
        most = max(most, v)
        cursor[k] = c + 1
    return indptr, out_end, low, most
