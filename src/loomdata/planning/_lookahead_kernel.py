"""Compiled natural steps of a run of consecutive stream positions (_lookahead's per-source pass).

`run_steps(col, lo, hi)` is searchsorted(col, arange(lo, hi), "right") - 1 for a non-decreasing `col` with
col[0] <= lo: one binary search for the first step, then one merged walk over the positions and the steps
they span. The NumPy form (each step repeated by how many positions fall in it: a clip, a diff and a repeat
over every step the run spans) costs O(steps) a call: with many sources at small dp a source draws a
fraction of a segment a step (300 sources, dp 4: 166K steps, ~0.2 positions of a source a step), so
the steps dominated. `col` may be a strided column of the (steps + 1, sources) pointer grid.

The look-ahead's passes over all segments are compiled here too (NumPy's masks, gathers and bincounts made
a dozen passes over every segment, and the merged natural order's indices read the segments of 300 sources
interleaved): `classify` (each segment's kind and the per-step sums, one pass), `scatter_natural` (the
heavy or light segments' lengths in natural order: each source's slice read in order, a segment placed by its
rank), `write_natural` (every segment's assigned step), `light_counts` and `overflowing` (the lights' searches
over a _Cum); `collect` and `write_steps` do the same through a permutation (positions not in stream order).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["run_steps"]


HEAVY = 1
"""`classify`'s kind of a heavy segment the look-ahead moves."""
LIGHT = 2
"""`classify`'s kind of a light segment the look-ahead pours into the steps' room."""


@njit
def _upper(a: np.ndarray, n: int, v: int) -> int:
    """The first index i < n with a[i] > v (n if none): searchsorted(a[:n], v, "right") for a non-decreasing `a`."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] <= v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit
def run_steps(col: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """(hi - lo,) int64: for v in lo..hi-1 the last step t with col[t] <= v (col non-decreasing, col[0] <= lo)."""
    n = len(col)
    t = _upper(col, n, lo) - 1
    out = np.empty(max(hi - lo, 0), dtype=np.int64)
    for v in range(lo, hi):
        while t + 1 < n and col[t + 1] <= v:
            t += 1
        out[v - lo] = t
    return out


@njit
def _cum_at(pre: np.ndarray, pad: np.ndarray, i: int) -> int:
    """c[i] of a _Cum (pre: every 64th sum, pad: the lengths as (blocks, 64))."""
    b = i // pad.shape[1]
    s = pre[b]
    for r in range(i - b * pad.shape[1]):
        s += pad[b, r]
    return s


@njit
def _cum_right(pre: np.ndarray, pad: np.ndarray, n_c: int, x: int) -> int:
    """np.searchsorted(c, x, "right") over the n_c entries of a _Cum (_Cum.searchsorted's block walk)."""
    nb = np.searchsorted(pre, x, side="right")
    if nb == 0:
        return 0
    jb = nb - 1
    base = jb * pad.shape[1]
    s = pre[jb]
    k = 0
    for r in range(pad.shape[1]):
        if base + r >= n_c or s > x:
            break
        k += 1
        s += pad[jb, r]
    return base + k


@njit
def fit_lights(cnt: np.ndarray, pre: np.ndarray, pad: np.ndarray, n_c: int, room: np.ndarray, bad: np.ndarray) -> None:
    """_lookahead._fit_lights from its overflowing steps `bad` on, over a _Cum's arrays (pre, pad, n_c): push the
    last lights of a step over its room on to the next step, and on while the next overflows (in place)."""
    n = len(cnt)
    i = 0
    while i < len(bad):
        t = bad[i]
        dirty = True
        while dirty and t < n - 1:
            before = cnt[t - 1] if t else 0
            limit = _cum_at(pre, pad, before) + max(room[t], 0)
            fit = _cum_right(pre, pad, n_c, limit) - 1
            cnt[t] = max(min(cnt[t], fit), before)
            t += 1
            if cnt[t] < cnt[t - 1]:
                cnt[t] = cnt[t - 1]
            dirty = _cum_at(pre, pad, cnt[t]) - _cum_at(pre, pad, cnt[t - 1]) > room[t]
        i = np.searchsorted(bad, t, side="right")


@njit
def add_step_counts(step: np.ndarray, first: int, out: np.ndarray) -> None:
    """out[t - first] += how many of `step` equal t, for t in first..first+len(out)-1 (one pass over `step`)."""
    n = len(out)
    for i in range(len(step)):
        t = step[i] - first
        if 0 <= t < n:
            out[t] += 1


@njit
def segments_of(
    doc_col: np.ndarray,
    pos: np.ndarray,
    lengths: np.ndarray,
    split_pos: np.ndarray,
    split_off: np.ndarray,
    split_len: np.ndarray,
    threshold: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """_lookahead.segments_at in one pass: (doc, offset, length, lane) of stream positions `pos` of a stream whose
    documents are `doc_col` and split pieces (split_pos sorted, their offsets and lengths); a document longer
    than `threshold` is in the long lane (threshold < 0: no long lane)."""
    n = len(pos)
    doc = np.empty(n, dtype=doc_col.dtype)
    offset = np.zeros(n, dtype=np.uint32)
    length = np.empty(n, dtype=np.uint32)
    lane = np.zeros(n, dtype=np.uint8)
    n_split = len(split_pos)
    last_p, last_i = -1, 0  # the previous position's search: increasing positions search from there on
    for j in range(n):
        p = int(pos[j])
        d = doc_col[p]
        doc[j] = d
        dl = lengths[d]
        length[j] = dl
        if threshold >= 0 and dl > threshold:
            lane[j] = 1
        if n_split:
            lo, hi = 0, last_i  # the first split piece at or after p (searchsorted "left") lies in [lo, hi]
            if p >= last_p:  # positions mostly increase: gallop on from the previous answer
                lo = hi = last_i
                if lo < n_split and split_pos[lo] < p:
                    step = 1
                    while lo + step < n_split and split_pos[lo + step] < p:
                        lo += step
                        step *= 2
                    hi = min(lo + step, n_split)  # split_pos[lo] < p <= split_pos[hi] (or hi the end)
                    lo += 1
            while lo < hi:
                mid = (lo + hi) // 2
                if split_pos[mid] < p:
                    lo = mid + 1
                else:
                    hi = mid
            last_p, last_i = p, lo
            i = min(lo, n_split - 1)
            if split_pos[i] == p:
                offset[j] = split_off[i]
                length[j] = split_len[i]
    return doc, offset, length, lane


@njit
def classify(
    raw: np.ndarray,
    nt: np.ndarray,
    length: np.ndarray,
    is_long: np.ndarray,
    kind: np.ndarray,
    offs: np.ndarray,
    short_epoch: np.ndarray,
    tall_over: float,
    n: int,
    lo_step: int,
    span: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The look-ahead's per-segment flags and per-step sums in one pass over all segments (natural steps `nt` in
    0..n-1; source s's segments are offs[s]..offs[s+1]-1). A short-lane segment is pinned (stays in its natural
    step) where `kind` is set on entry (drawn near an epoch start) or its source's `short_epoch` is; on return
    `kind` holds each segment's kind: HEAVY (a moving segment longer than `tall_over` tokens), LIGHT (another
    moving short-lane one) or 0 (long-lane or pinned). Returns, per step (int64): the sequences taken by what
    stays (long-lane segments and pinned heavy ones), the pinned lights' tokens, the short-lane tokens, the heavy
    segments and their tokens, the lights' tokens; then (int64, `span` entries) the heavy and the light segments
    of each unclipped natural step lo_step + r of `raw` (`nt` is `raw` clipped into 0..n-1) (_lookahead's masks
    and bincounts over all segments, one compiled pass)."""
    n_long = np.zeros(n, dtype=np.int64)
    pinned_light = np.zeros(n, dtype=np.int64)
    short_tok = np.zeros(n, dtype=np.int64)
    h_cnt = np.zeros(n, dtype=np.int64)
    h_tok = np.zeros(n, dtype=np.int64)
    l_tok = np.zeros(n, dtype=np.int64)
    h_raw = np.zeros(span, dtype=np.int64)
    l_raw = np.zeros(span, dtype=np.int64)
    s, stop, pin = -1, 0, False  # the source of segment i, where its slice ends, whether it is pinned whole
    for i in range(len(nt)):
        while i >= stop:
            s += 1
            stop = offs[s + 1]
            pin = short_epoch[s]
        t = nt[i]
        ln = np.int64(length[i])
        tall = length[i] > tall_over
        if is_long[i]:
            n_long[t] += 1
            kind[i] = 0
            continue
        short_tok[t] += ln
        if kind[i] or pin:  # pinned
            if tall:
                n_long[t] += 1
            else:
                pinned_light[t] += ln
            kind[i] = 0
        elif tall:
            h_cnt[t] += 1
            h_tok[t] += ln
            kind[i] = HEAVY
            h_raw[raw[i] - lo_step] += 1
        else:
            kind[i] = LIGHT
            l_tok[t] += ln
            l_raw[raw[i] - lo_step] += 1
    return n_long, pinned_light, short_tok, h_cnt, h_tok, l_tok, h_raw, l_raw


@njit
def collect(idx: np.ndarray, kind: np.ndarray, want: int, vals: np.ndarray, dst: np.ndarray, at: int) -> int:
    """Append vals[i] of the segments of kind `want` among the global indices `idx` (a chunk of the natural order)
    to dst from index `at`; returns the next free index (scatter_natural's order through a permutation)."""
    for i in idx:
        if kind[i] == want:
            dst[at] = vals[i]
            at += 1
    return at


@njit
def write_steps(
    idx: np.ndarray,
    kind: np.ndarray,
    nt: np.ndarray,
    out: np.ndarray,
    h_step: np.ndarray,
    cnt0: np.ndarray,
    hj: int,
    lj: int,
    t: int,
    last: int,
    t0: int,
) -> tuple[int, int, int]:
    """The assigned step of each segment among `idx` (a chunk of the natural order) into `out` (which may be `nt`
    or the array it was clipped from: each index is read before it is written): the j-th heavy segment in
    natural order goes to h_step[j], the j-th light one to the last step t with cnt0[t] <= j (cnt0: 0, then the
    cumulative lights a step; `t` carries that walk from chunk to chunk, -1 before the first), the others stay
    in nt; every step is capped at `last` and offset by t0. Returns the next (hj, lj, t)."""
    m = len(cnt0)
    for i in idx:
        k = kind[i]
        if k == HEAVY:
            v = np.int64(h_step[hj])
            hj += 1
        elif k == LIGHT:
            if t < 0:  # the first light: one binary search (searchsorted(cnt0, lj, "right") - 1)
                t = _upper(cnt0, m, lj) - 1
            while t + 1 < m and cnt0[t + 1] <= lj:
                t += 1
            v = np.int64(t)
            lj += 1
        else:
            v = np.int64(nt[i])
        out[i] = (v if v < last else last) + t0
    return hj, lj, t


@njit
def light_counts(pre: np.ndarray, pad: np.ndarray, n_c: int, room: np.ndarray) -> np.ndarray:
    """(len(room),) int64: the running maximum of max(searchsorted(c, room[t], "right") - 1, 0) over the _Cum c
    (pre, pad, n_c): the lights each step's cumulative room takes, never fewer than the step before."""
    out = np.empty(len(room), dtype=np.int64)
    best = 0
    for t in range(len(room)):
        v = _cum_right(pre, pad, n_c, room[t]) - 1
        if v > best:
            best = v
        out[t] = best
    return out


@njit
def overflowing(cnt: np.ndarray, pre: np.ndarray, pad: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Steps t whose lights (c[cnt[t]] - c[cnt[t-1]], cnt[-1] = 0) exceed room[t] (np.flatnonzero, int64)."""
    n = len(cnt)
    flag = np.zeros(n, dtype=np.bool_)
    k = 0
    prev = 0  # c[0]
    for t in range(n):
        cur = _cum_at(pre, pad, cnt[t])
        if cur - prev > room[t]:
            flag[t] = True
            k += 1
        prev = cur
    out = np.empty(k, dtype=np.int64)
    j = 0
    for t in range(n):
        if flag[t]:
            out[j] = t
            j += 1
    return out


@njit
def scatter_natural(
    raw: np.ndarray,
    offs: np.ndarray,
    cuts: np.ndarray,
    kind: np.ndarray,
    want: int,
    nxt: np.ndarray,
    lo_step: int,
    vals: np.ndarray,
    dst: np.ndarray,
) -> None:
    """dst[j] = vals[i] for the segments i of kind `want`, j their rank among those in natural order (natural
    step `raw`, then source, then position), where every source's slice (offs) is in natural order already.
    `nxt[r]`: on entry the rank of the first such segment of natural step lo_step + r (the exclusive prefix sums
    of their counts a step), advanced as they are placed. Source slices are read in order a chunk of steps at a
    time (cuts[s, c]: where chunk c starts in source s's slice): within a step, source after source, so a step's
    ranks go out in natural order, and the writes stay within the chunk's ranks (no gather through a
    permutation: _lookahead's merged walk read the segments in natural order, 300 slices interleaved)."""
    for c in range(cuts.shape[1] - 1):
        for s in range(cuts.shape[0]):
            for i in range(offs[s] + cuts[s, c], offs[s] + cuts[s, c + 1]):
                if kind[i] == want:
                    r = raw[i] - lo_step
                    dst[nxt[r]] = vals[i]
                    nxt[r] += 1


@njit
def write_natural(
    raw: np.ndarray,
    offs: np.ndarray,
    cuts: np.ndarray,
    edges: np.ndarray,
    kind: np.ndarray,
    nt: np.ndarray,
    out: np.ndarray,
    h_step: np.ndarray,
    hnxt: np.ndarray,
    lnxt: np.ndarray,
    cnt0: np.ndarray,
    lo_step: int,
    last: int,
    t0: int,
) -> None:
    """write_steps over all segments in the layout scatter_natural reads (its heavy and light ranks from `hnxt`
    and `lnxt`, each the exclusive prefix sums of the kind's counts a natural step, with one entry more: the
    total): the j-th heavy segment in natural order goes to h_step[j], the j-th light one to the last step t
    with cnt0[t] <= j (run_steps over the chunk's ranks), the others stay in nt; capped at `last`, offset by t0,
    into `out` (which may be `raw`: each segment is read before it is written)."""
    r_all = len(lnxt) - 1
    for c in range(cuts.shape[1] - 1):
        a = min(edges[c] - lo_step, r_all)
        b = min(edges[c + 1] - lo_step, r_all)
        l0 = lnxt[a]
        lsteps = run_steps(cnt0, l0, lnxt[b])  # the steps of the chunk's lights, by rank
        for s in range(cuts.shape[0]):
            for i in range(offs[s] + cuts[s, c], offs[s] + cuts[s, c + 1]):
                k = kind[i]
                if k == HEAVY:
                    r = raw[i] - lo_step
                    v = np.int64(h_step[hnxt[r]])
                    hnxt[r] += 1
                elif k == LIGHT:
                    r = raw[i] - lo_step
                    v = lsteps[lnxt[r] - l0]
                    lnxt[r] += 1
                else:
                    v = np.int64(nt[i])
                out[i] = (v if v < last else last) + t0
