"""Membership's held pass as it was at main 8f9077a (session 27 moved its nearest searches to where a source's
pick may change, skipping the re-check where only the search's answer moves): `held_membership_ref` is
_mixture_kernel.held_membership of then, with its `_near_at` and `_held_fill`, kept as the oracle its randomized
test compares the compiled pass of now with (same changes, pointers and targets)."""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["held_membership_ref"]


@njit
def _near_at(cw: np.ndarray, sh: int, n: int, j: int, xt: float) -> tuple[int, int, float]:
    """nearest_run's step for one source at target xt, its search at j (cw[sh + i] is its cum[i]): the search's
    new answer, the nearest prefix, and the smallest target above which the answer or the prefix may next change
    (the pick is re-worked out only there: both are monotone in the target)."""
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
    nxt = np.inf if j >= n else np.float64(c) - 1.0  # ceil(x) > c only for x > c: re-checked a token early
    if at > 0 and (xt - a) <= (c - xt):
        # lower until x passes the midpoint; re-checked well before it (rounding of x - a and c - x is far
        # below a token at any count a float64 holds exactly)
        mid_x = 0.5 * (np.float64(a) + np.float64(c)) - 1.0 - 1e-9 * np.float64(c)
        return j, lower, min(nxt, mid_x)
    return j, at, nxt


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


@njit
def held_membership_ref(
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
    cap = max(1024, 4 * r)
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
                j, pick, nx = _near_at(cw, shift[k], n_of[k], state[k, 0], acc[k])
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
        if short > sl * seq_len:  # repair_rows' deferrals, over the sources that draw (the others are -inf there)
            for i in range(na):
                k = active[i]
                ahead[i] = cw[shift[k] + rr[i]] - acc[k]
            while True:
                bi = 0
                for i in range(1, na):  # np.argmax over the sources: the largest, the first source on ties
                    if ahead[i] > ahead[bi] or (ahead[i] == ahead[bi] and active[i] < active[bi]):
                        bi = i
                k = active[bi]
                at = shift[k] + rr[bi]
                short -= cw[at] - cw[at - 1]
                rr[bi] -= 1
                ahead[bi] = cw[at - 1] - acc[k] if rr[bi] > cur[k] else -np.inf
                if short <= sl * seq_len:
                    break
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
