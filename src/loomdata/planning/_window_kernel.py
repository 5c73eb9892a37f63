"""Compiled windowed draw (planning.draw_window = W > 0, steps at dp 1): the greedy fill of a run of steps.

Per step, its `slots` rows of seq_len tokens are filled by repeating: for the sources weighted at the step, in
order of how far each is ahead of its target (least ahead first, the first source on ties), take the first segment
of that source's window that fits a row (best fit: the row with the least room that holds it); stop at the first
source that has one; until no weighted source has a segment that fits. A source's window is its pending positions
(skipped at an earlier step, oldest first) and then its next not-yet-drawn positions, W in all; the next positions
do not cross an epoch start while a position of the earlier epoch is pending. A source's target is the tokens the
plan has drawn so far weighted by each step's weights (sum over steps s of w[s, k] x tokens drawn at s), so the
shares follow the weights whatever share of the rows the fill fills. Before the greedy fill a step takes every
pending segment that has waited MAX_WAIT steps or more (oldest first, any source, weighted or not: it was drawn
when its source was), where one fits: the first always does (a row is empty and a segment is at most seq_len), so
a segment waits at most MAX_WAIT + (pending segments of all sources) steps. A greedy take never puts its source
more than seq_len tokens ahead of its target, so (offsets from the targets sum to 0) no source is more than
(sources - 1) x seq_len behind; takes of waiting segments are outside that rule.

State (carried from call to call, so a run of steps is worked out a block at a time): each source's frontier (the
first position never in its window), its pending positions and the steps they were skipped at, its drawn tokens
and its target. Output per step: the taken-prefix pointer of each source (its first pending position, else its
frontier: every position below it is placed at a step before) and the taken positions (source, position, step),
sorted within the step by (source, position).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["by_source", "window_steps"]

DONE = 0
FULL = 1  # the take buffers may not hold another step: the caller grows them and calls again from `at`
RUN_OUT = 2  # a window read past the stream this plan built (`at`, `source`): the caller refuses


@njit
def window_steps(
    lens: np.ndarray,
    off: np.ndarray,
    epoch_segs: np.ndarray,
    weights: np.ndarray,
    t0: int,
    t_end: int,
    w0: int,
    slots: np.ndarray,
    seq_len: int,
    window: int,
    max_wait: int,
    state: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ptr_rows: np.ndarray,
    takes: tuple[np.ndarray, np.ndarray, np.ndarray],
    n_taken: int,
) -> tuple[int, int, int, int]:
    """Steps t0..t_end-1 (weights[t - w0] their rows; slots[t] their rows of seq_len tokens). lens: every source's
    segment lengths laid end to end (source k's at off[k]..off[k+1]-1); epoch_segs: segments an epoch (huge where
    the stream holds less than one). state = (frontier, pend (sources, W), pend_step (sources, W), pend_n, drawn,
    target), updated in place. ptr_rows[t - w0 + 1] gets the pointers after step t (row t0 - w0 is the caller's).
    takes = (source int32, position int64, step int32) from index n_taken. Returns (status, at, source, n_taken):
    DONE with at = t_end, FULL before step `at`, RUN_OUT at step `at` for `source`."""
    frontier, pend, pend_step, pend_n, drawn, target = state
    t_src, t_pos, t_step = takes
    n_src = len(frontier)
    rooms = np.empty(slots.max() if len(slots) else 1, dtype=np.int64)
    # each source's shortest candidate (0 where its window reaches past its stream: it must be tried to be refused)
    shortest = np.empty(n_src, dtype=np.int64)
    for k in range(n_src):
        shortest[k] = _shortest(k, lens, off, epoch_segs, window, state)
    failed = np.full(n_src, -1, dtype=np.int64)  # the pick at which a source had nothing that fits
    pick = 0
    for t in range(t0, t_end):
        sl = slots[t]
        if len(t_src) - n_taken < sl * seq_len + n_src * window:  # each take is a token at least
            return FULL, t, -1, n_taken
        first = n_taken
        w = weights[t - w0]
        for r in range(sl):
            rooms[r] = seq_len
        used = 0
        # the pending that have waited max_wait steps, oldest first, where they fit
        while True:
            best_k, best_i, best_s = -1, -1, t - max_wait + 1
            for k in range(n_src):
                for i in range(pend_n[k]):
                    if pend_step[k, i] < best_s:
                        best_k, best_i, best_s = k, i, pend_step[k, i]
            if best_k < 0:
                break
            length = lens[off[best_k] + pend[best_k, best_i]]
            r = _best_row(rooms, sl, length)
            if r < 0:
                break
            rooms[r] -= length
            used += length
            drawn[best_k] += length
            t_src[n_taken], t_pos[n_taken], t_step[n_taken] = best_k, pend[best_k, best_i], t
            n_taken += 1
            _drop_pending(pend, pend_step, pend_n, best_k, best_i)
            shortest[best_k] = _shortest(best_k, lens, off, epoch_segs, window, state)
        args = (lens, off, epoch_segs, w, rooms, sl, seq_len, window, state, takes)
        while True:
            most = 0  # the most room a row has: a source whose shortest candidate is longer has none that fits
            for r in range(sl):
                most = max(most, rooms[r])
            pick += 1
            code = _NONE
            tried = -1
            while True:  # the least ahead first (the first on ties) of the sources that may have one that fits
                tried = -1
                best = np.inf
                for k in range(n_src):
                    if w[k] > 0 and shortest[k] <= most and failed[k] != pick:
                        kv = drawn[k] - target[k] - w[k] * used
                        if kv < best:
                            tried, best = k, kv
                if tried < 0:
                    break
                code, n_taken, used = _take_one(tried, t, used, n_taken, args)
                if code != _NONE:
                    break
                failed[tried] = pick
            if code == _RUN:
                return RUN_OUT, t, tried, n_taken
            if code == _NONE:
                break
            shortest[tried] = _shortest(tried, lens, off, epoch_segs, window, state)
        for k in range(n_src):
            target[k] += w[k] * used
            ptr_rows[t - w0 + 1, k] = pend[k, 0] if pend_n[k] > 0 else frontier[k]
        _sort_step(t_src, t_pos, first, n_taken)
    return DONE, t_end, -1, n_taken


_NONE, _TOOK, _RUN = 0, 1, 2


@njit
def _shortest(k: int, lens: np.ndarray, off: np.ndarray, epoch_segs: np.ndarray, window: int, state: tuple) -> int:
    """The shortest segment in source k's window (what _take_one would try), 0 where the window reads past the
    stream (so that trying it refuses), a huge number where the window is empty."""
    frontier, pend, _, pend_n, _, _ = state
    out = np.iinfo(np.int64).max
    for i in range(pend_n[k]):
        out = min(out, lens[off[k] + pend[k, i]])
    epoch = pend[k, 0] // epoch_segs[k] if pend_n[k] > 0 else -1
    for d in range(window - pend_n[k]):
        p = frontier[k] + d
        if epoch >= 0 and p // epoch_segs[k] != epoch:
            break
        if p >= off[k + 1] - off[k]:
            return 0
        out = min(out, lens[off[k] + p])
    return out


@njit
def _take_one(k: int, t: int, used: int, n_taken: int, args: tuple) -> tuple[int, int, int]:
    """Source k takes the first segment of its window that fits a row and keeps it within seq_len of its target:
    its pending positions first (oldest first), then its next ones (not past an epoch start while a position of the
    earlier epoch is pending). Returns (_TOOK / _NONE / _RUN: the window reads past the stream, n_taken, used)."""
    lens, off, epoch_segs, w, rooms, sl, seq_len, window, state, takes = args
    frontier, pend, pend_step, pend_n, drawn, target = state
    t_src, t_pos, t_step = takes
    for i in range(pend_n[k]):
        length = lens[off[k] + pend[k, i]]
        r = _best_row(rooms, sl, length) if _within(drawn, target, w, k, used, length, seq_len) else -1
        if r >= 0:
            rooms[r] -= length
            drawn[k] += length
            t_src[n_taken], t_pos[n_taken], t_step[n_taken] = k, pend[k, i], t
            _drop_pending(pend, pend_step, pend_n, k, i)
            return _TOOK, n_taken + 1, used + length
    epoch = pend[k, 0] // epoch_segs[k] if pend_n[k] > 0 else -1
    for d in range(window - pend_n[k]):
        p = frontier[k] + d
        if epoch >= 0 and p // epoch_segs[k] != epoch:
            break
        if p >= off[k + 1] - off[k]:
            return _RUN, n_taken, used
        length = lens[off[k] + p]
        r = _best_row(rooms, sl, length) if _within(drawn, target, w, k, used, length, seq_len) else -1
        if r >= 0:
            rooms[r] -= length
            drawn[k] += length
            t_src[n_taken], t_pos[n_taken], t_step[n_taken] = k, p, t
            for q in range(frontier[k], p):  # skipped: pending from this step on
                pend[k, pend_n[k]] = q
                pend_step[k, pend_n[k]] = t
                pend_n[k] += 1
            frontier[k] = p + 1
            return _TOOK, n_taken + 1, used + length
    return _NONE, n_taken, used


@njit
def _within(drawn: np.ndarray, target: np.ndarray, w: np.ndarray, k: int, used: int, length: int, seq_len: int) -> bool:
    """Whether source k taking `length` tokens stays at most seq_len tokens ahead of its target (the source least
    ahead does: the sources' offsets from their targets sum to 0, so its offset is <= 0; but for a curriculum's
    unweighted sources, so an empty step takes its first segment whatever it does)."""
    return used == 0 or drawn[k] + length - target[k] - w[k] * (used + length) <= seq_len


@njit
def _best_row(rooms: np.ndarray, sl: int, length: int) -> int:
    """The row with the least room that holds `length` tokens (the first on ties), or -1."""
    best = -1
    for r in range(sl):
        if rooms[r] >= length and (best < 0 or rooms[r] < rooms[best]):
            best = r
    return best


@njit
def _drop_pending(pend: np.ndarray, pend_step: np.ndarray, pend_n: np.ndarray, k: int, i: int) -> None:
    """Remove source k's pending entry i (the rest keep their order)."""
    for j in range(i, pend_n[k] - 1):
        pend[k, j] = pend[k, j + 1]
        pend_step[k, j] = pend_step[k, j + 1]
    pend_n[k] -= 1


@njit
def _sort_step(src: np.ndarray, pos: np.ndarray, a: int, b: int) -> None:
    """Sort one step's takes src[a:b], pos[a:b] by (source, position) (insertion: a step takes few)."""
    for i in range(a + 1, b):
        s, p = src[i], pos[i]
        j = i
        while j > a and (src[j - 1] > s or (src[j - 1] == s and pos[j - 1] > p)):
            src[j] = src[j - 1]
            pos[j] = pos[j - 1]
            j -= 1
        src[j] = s
        pos[j] = p


@njit
def by_source(
    src: np.ndarray, pos: np.ndarray, step: np.ndarray, at: np.ndarray, out_pos: np.ndarray, out_step: np.ndarray
) -> None:
    """Scatter takes (in step order) to out_*[at[k]] for their source k, advancing at[k] (each source's slice of the
    flat outputs, filled in order part after part)."""
    for i in range(len(src)):
        k = src[i]
        out_pos[at[k]] = pos[i]
        out_step[at[k]] = step[i]
        at[k] += 1
