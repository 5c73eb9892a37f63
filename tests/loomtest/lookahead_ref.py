"""The look-ahead's NumPy passes as they were before _lookahead's compiled ones (classify, scatter_natural,
write_natural, light_counts, overflowing): `assign_steps_ref` is _lookahead.assign_steps at main 7855524, kept as
the oracle its randomized test compares the compiled form with (same steps, positions and dtypes). The helpers
the change left alone are imported from _lookahead."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from loomdata.planning._allocator import trim_arenas
from loomdata.planning._jit import njit
from loomdata.planning._lookahead import (
    CHUNK,
    HEAVY_SHARE,
    PIN_WINDOWS,
    TRIM_BYTES,
    Positions,
    StepAssignment,
    _arr,
    _Cum,
    _epoch_order,
    _epoch_starts,
    _fit_end,
    _increasing,
    _natural_steps,
    _near_epoch_start,
    _nondecreasing,
    _pos_dtype,
    _sorted_pieces,
    _steps_of_run,
    stable_order,
)
from loomdata.planning._lookahead_kernel import fit_lights
from loomdata.planning._mixture import Stream
from loomdata.planning._packing import Lanes
from loomdata.planning._pointers import Pointers
from loomdata.schemas.spec import LOOKAHEAD_TOLERANCE

__all__ = ["assign_steps_ref"]


class _Order:
    """The drawn segments of all sources (concatenated source after source) in natural order: natural step,
    then source, then stream position; handed out a chunk of global indices at a time. Where every source's
    positions increase and natural steps do not decrease (as drawn), a chunk of steps is merged from the
    sources' slices (no permutation of all segments is stored); otherwise one lexsort of all of them."""

    def __init__(self, pos: Sequence[Positions], raw: np.ndarray, offs: np.ndarray, n: int) -> None:
        self.raw, self.offs, self.n = raw, offs, n
        sorted_ = all(
            _nondecreasing(raw[offs[s] : offs[s + 1]]) and (isinstance(p, range) or _increasing(np.asarray(p)))
            for s, p in enumerate(pos)
        )
        self.full: np.ndarray | None = None
        if not sorted_:
            src = np.repeat(np.arange(len(pos), dtype=np.int64), np.diff(offs))
            flat_pos = np.concatenate([_arr(p, np.int64) for p in pos])
            self.full = np.lexsort((flat_pos, src, raw))

    def chunks(self) -> Iterator[np.ndarray]:
        """Global indices in natural order, chunk after chunk."""
        if self.full is not None:
            for a in range(0, len(self.full), CHUNK):
                yield self.full[a : a + CHUNK]
            return
        raw, offs = self.raw, self.offs
        if len(raw) == 0:
            return
        lo_step, hi_step = int(raw.min()), int(raw.max()) + 1
        per_step = max(1, len(raw) // max(hi_step - lo_step, 1))
        width = max(1, CHUNK // per_step)
        edges = np.arange(lo_step, hi_step + width, width, dtype=np.int64)
        # where every chunk of steps starts in each source's slice: one search a source, not one a chunk and source
        cuts = np.stack(
            [np.searchsorted(raw[offs[s] : offs[s + 1]], edges.astype(raw.dtype)) for s in range(len(offs) - 1)]
        ).astype(np.int64)
        offs64 = np.ascontiguousarray(offs, dtype=np.int64)
        for c, a in enumerate(range(lo_step, hi_step, width)):
            idx = natural_chunk(raw, offs64, cuts, c, a, width)  # the chunk's slices, counting-sorted (compiled)
            if len(idx):
                yield idx


def assign_steps_ref(
    pos: Sequence[Positions],
    nat: Sequence[np.ndarray] | None,
    streams: list[Stream],
    lanes: Lanes,
    slots: np.ndarray,
    dp: np.ndarray,
    k: int,
    t0: int,
    t1: int,
    *,
    final: bool = True,
    planned_before: int = 0,
    ptr: Pointers | None = None,
    drop_counts: bool = False,
    tolerance: float = LOOKAHEAD_TOLERANCE,
    release_ptr: bool = False,
) -> StepAssignment:
    """_lookahead.assign_steps as it was before its compiled passes (the same arguments, the same result)."""
    n = t1 - t0
    seq = lanes.seq_len
    n_src = len(pos)
    offs = np.zeros(n_src + 1, dtype=np.int64)
    offs[1:] = np.cumsum([len(p) for p in pos])
    total = int(offs[-1])
    step_dtype = np.int32 if t1 < 2**31 else np.int64
    raw = np.empty(total, dtype=step_dtype)  # window-relative natural steps, < 0 for what a re-plan's base deferred
    length = np.empty(total, dtype=np.uint32)
    is_long = np.zeros(total, dtype=bool)
    edge = np.zeros(total, dtype=bool)
    drawn = np.zeros(n_src, dtype=np.float64)  # tokens of each source in the window
    if nat is None and ptr is None:
        raise ValueError("assign_steps needs the natural steps `nat` or the membership pointers `ptr`")
    starts: list[np.ndarray] = []  # per source, where in its positions a new epoch begins (_epoch_starts)
    freed = 0  # bytes of dropped counts not yet given back
    for s, p in enumerate(pos):
        st = streams[s]
        o = int(offs[s])
        col: np.ndarray | None = None
        if nat is None and ptr is not None and len(p):
            # a range's natural steps straight from the steps that draw it (the column's binary searches, bit for
            # bit); else (positions some step does not draw: not met from natural_ranges) from its whole column
            whole = isinstance(p, range) and ptr.run_steps_into(s, p.start, p.stop, raw[o : o + len(p)], -t0)
            col = None if whole else ptr.column(s)  # one source's at a time
        for i0 in range(0, len(p), CHUNK):
            i1 = min(len(p), i0 + CHUNK)
            q: np.ndarray | None = None
            if isinstance(p, range):  # consecutive positions: differences of the counts, no gathers
                lo_p, hi_p = p.start + i0, p.start + i1 + 1
                length[o + i0 : o + i1] = np.diff(st.cum[lo_p:hi_p])
                if st.cum_long is not None:
                    is_long[o + i0 : o + i1] = np.diff(st.cum_long[lo_p:hi_p]) > 0
            else:
                q = _arr(p[i0:i1], np.int64)
                length[o + i0 : o + i1] = st.cum[q + 1] - st.cum[q]
                if st.cum_long is not None:
                    is_long[o + i0 : o + i1] = (st.cum_long[q + 1] - st.cum_long[q]) > 0
            if nat is None and col is not None:
                raw[o + i0 : o + i1] = _natural_steps(col, p, i0, i1, q) - t0
            elif nat is not None:
                raw[o + i0 : o + i1] = np.asarray(nat[s][i0:i1]) - t0
        drawn[s] = float(length[o : o + len(p)].sum(dtype=np.int64))
        starts.append(_epoch_starts(p, st))
        _near_epoch_start(starts[-1], raw[o : o + len(p)], k + 1, edge[o : o + len(p)])
        if drop_counts:  # each source's counts go once its lengths are read: never all of them beside raw/length
            freed += sum(c.nbytes for c in (st.cum, st.cum_short, st.cum_long) if c is not None)
            streams[s] = st.without_counts()
        del st  # (a name left bound to the last stream would hold its counts through the whole pass)
        if freed >= TRIM_BYTES or (freed and s == n_src - 1):
            # many sources' counts are small heap blocks glibc keeps once freed, while raw/length fill in: given
            # back as they go (300 sources at 10M samples: 80 MB of counts beside the pass's columns otherwise)
            trim_arenas()
            freed = 0
    if release_ptr and ptr is not None:
        ptr.release()
        trim_arenas()
    clipped = total and (int(raw.min()) < 0 or int(raw.max()) > n - 1)
    nt = np.clip(raw, 0, n - 1) if clipped else raw
    sl = slots[t0:t1].astype(np.int64)
    dpt = dp[t0:t1].astype(np.int64)
    tall = length > HEAVY_SHARE * seq
    # a source whose epoch is shorter than a few windows of steps repeats documents within reach of a move:
    # its segments stay where membership drew them (they still take their room in the step)
    epochs = np.array([st.epoch_tokens for st in streams], dtype=np.float64)
    short_epoch = epochs * n < PIN_WINDOWS * (k + 1) * drawn  # its epoch lasts fewer steps than that
    # and segments drawn within K + 1 steps of their source's epoch start stay too: no move crosses an epoch
    pinned = edge
    if n:
        for j in np.flatnonzero(short_epoch).tolist():
            pinned[offs[j] : offs[j + 1]] = True
        pinned &= ~is_long
    else:
        pinned[:] = False
    del edge
    n_long = _step_sums(nt, n, [is_long]) + _step_sums(nt, n, [pinned, tall])
    cap_h = np.maximum(sl - n_long, 0)  # sequences left for the moving short segments
    pinned_light = _step_sums(nt, n, [pinned], [tall], length)
    short_tok = _step_sums(nt, n, [], [is_long], length).astype(np.float64)
    moving = ~is_long & ~pinned  # heavy when tall, light otherwise
    del is_long, pinned
    order = _Order(pos, raw, offs, n)
    # the heavy segments' indices (int32 where they fit: 4 bytes a heavy segment less through the lights' peak)
    idx_dtype = np.int32 if total < 2**31 else np.int64
    hi_idx = np.concatenate(
        [c[tall[c] & moving[c]].astype(idx_dtype) for c in order.chunks()] or [np.zeros(0, dtype=idx_dtype)]
    )
    c = np.cumsum(np.bincount(nt[hi_idx], minlength=n))
    a = (c + dpt // 2) // dpt * dpt
    # no heavy segment later than K steps after its natural step (also those a re-plan's base deferred)
    lo = np.searchsorted(raw[hi_idx], (np.arange(n) - k).astype(raw.dtype), side="right")
    hi = c[np.minimum(np.arange(n) + k, n - 1)]
    a = np.clip(a, lo, hi)
    hc = np.zeros(len(hi_idx) + 1, dtype=np.int64)
    np.cumsum(length[hi_idx], out=hc[1:])
    slack = tolerance * (planned_before + np.cumsum(short_tok))
    h_nat = hc[c]
    a = np.clip(
        a, np.searchsorted(hc, h_nat - slack, side="left"), np.searchsorted(hc, h_nat + slack, side="right") - 1
    )
    del hc, h_nat  # (8 bytes a heavy segment, not needed through the lights' peak)
    a = np.clip(a, lo, hi)
    # at most as many heavy segments in step t as sequences the pinned light tokens leave
    h_cap = np.maximum(cap_h - (pinned_light + seq - 1) // seq, 0)
    capc = np.cumsum(h_cap)
    a = capc + np.minimum.accumulate(np.minimum(a - capc, 0))
    a = np.maximum(a, lo)
    if final and n:
        # the steps after t can take only so many: what they cannot is placed by t (nothing past the last step)
        a = np.maximum(a, c[-1] - (capc[-1] - capc))
        a[-1] = c[-1]
    h_step = np.searchsorted(a, np.arange(len(hi_idx)), side="right").astype(step_dtype)  # steps <= n
    h_nat_tok = np.bincount(nt[hi_idx], weights=length[hi_idx], minlength=n).astype(np.int64)
    h_asg_tok = np.bincount(np.minimum(h_step, n - 1), weights=length[hi_idx], minlength=n).astype(np.int64)
    # the heavy pass's arrays of steps go before the lights' peak (at dp 4 a step holds about 60 segments, so a
    # dozen 8-byte arrays of steps are over a byte a segment)
    del n_long, short_tok, sl, dpt, lo, hi, a, c, slack, h_cap, capc, epochs, short_epoch, drawn

    light = moving & ~tall
    del moving, tall
    n_light = int(light.sum())
    l_len = _Cum.buffer(n_light)  # the lights' lengths in natural order, written straight into _Cum's blocks
    l_nat = np.zeros(n, dtype=np.int64)
    at = 0
    for ch in order.chunks():
        li = ch[light[ch]]
        ln = length[li]
        l_len[at : at + len(li)] = ln
        l_nat += np.bincount(nt[li], weights=ln, minlength=n).astype(np.int64)
        at += len(li)
    del length
    lc = _Cum(l_len, n_light)  # cumulative light tokens in natural order (owns l_len: no copy)
    del l_len
    room = np.cumsum(l_nat + h_nat_tok - h_asg_tok)
    cnt = np.maximum.accumulate(np.maximum(lc.searchsorted(room, "right") - 1, 0))
    if final and n:
        cnt[-1] = n_light
    light_room = cap_h * seq - h_asg_tok - pinned_light
    _fit_lights_ref(cnt, lc, light_room)
    if final and n:
        _fit_end(cnt, lc, light_room)
    del lc
    out = nt.copy()  # long-lane segments and those of short-epoch sources keep their natural step
    out[hi_idx] = h_step  # (made only now: the per-segment steps are not held while the lights are poured)
    del hi_idx, h_step
    at = 0
    cnt0 = np.concatenate([np.zeros(1, dtype=np.int64), cnt.astype(np.int64, copy=False)])
    for ch in order.chunks():  # light j goes to searchsorted(cnt, j, "right"): j is consecutive here
        li = ch[light[ch]]
        if len(li):
            out[li] = _steps_of_run(cnt0, at, at + len(li))
        at += len(li)
    del cnt0
    del light, raw, nt, order
    np.minimum(out, n - 1, out=out)
    out += t0  # what no step took (a prefix window) is left at its end

    # each source's steps are sorted into its own slice of `out` (the result's steps are views of it: no second
    # array of all steps beside it while the positions are laid out)
    res_pos, res_step = [], []
    for s, p in enumerate(pos):
        r_step = out[offs[s] : offs[s + 1]]
        st_k = _epoch_order(r_step, starts[s])  # r_step itself, or a corrected copy
        p_dtype = _pos_dtype(p.stop if isinstance(p, range) else (int(np.max(p)) + 1 if len(p) else 0))
        r_pos = np.empty(len(st_k), dtype=p_dtype)
        for i0, i1 in _sorted_pieces(st_k):  # positions are increasing: stream order within a step
            piece = st_k[i0:i1]
            srt = stable_order(piece, int(piece.min()), int(piece.max()) + 1) if i1 > i0 else np.zeros(0, np.intp)
            if isinstance(p, range):
                r_pos[i0:i1] = srt
                r_pos[i0:i1] += p.start + i0
            else:
                r_pos[i0:i1] = np.asarray(p[i0:i1])[srt]
            r_step[i0:i1] = piece[srt]  # (piece[srt] is a new array: writing over piece's own slice is safe)
            del srt
        res_pos.append(r_pos)
        res_step.append(r_step)
    return StepAssignment(res_pos, res_step)


def _step_sums(
    nt: np.ndarray,
    n: int,
    keep: Sequence[np.ndarray],
    drop: Sequence[np.ndarray] = (),
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """(n,) int64 per step of `nt`: the count (or the sum of integer `weights`) of the segments where every
    `keep` mask is set and no `drop` mask is, a chunk at a time (exactly a float bincount's integer sums)."""
    out = np.zeros(n, dtype=np.int64)
    for a in range(0, len(nt), CHUNK):
        b = a + CHUNK
        m = np.ones(min(len(nt), b) - a, dtype=bool)
        for x in keep:
            m &= x[a:b]
        for x in drop:
            m &= ~x[a:b]
        w = None if weights is None else weights[a:b][m]
        out += np.bincount(nt[a:b][m], weights=w, minlength=n).astype(np.int64)
    return out


def _fit_lights_ref(cnt: np.ndarray, lc: _Cum, room: np.ndarray) -> None:
    """Push the last light segments of a step whose short tokens exceed its slots on to the next step (in place).

    Visits only steps that overflow and the steps after a push (a light segment is at most half a sequence,
    so an overflow is rare and short-lived); the last step keeps what it has (the balancer carries it)."""
    prev = np.concatenate([[0], cnt[:-1]])
    bad = np.flatnonzero(lc[cnt] - lc[prev] > room)
    if len(bad):  # compiled (_lookahead_kernel.fit_lights): a few NumPy calls an overflowing step otherwise
        fit_lights(cnt, lc.pre, lc.pad, len(lc.len) + 1, room, bad)


@njit
def natural_chunk(raw: np.ndarray, offs: np.ndarray, cuts: np.ndarray, c: int, lo: int, width: int) -> np.ndarray:
    """(The reference's; src reads the slices in order since session 26.) chunk_indices(offs, cuts, c) in natural
    order (step, then source, then position): its stable sort by
    raw[i] - lo in [0, width), by one counting sort (each source's slice is already in step order)."""
    count = np.zeros(width + 1, dtype=np.int64)
    n = 0
    for s in range(cuts.shape[0]):
        for i in range(offs[s] + cuts[s, c], offs[s] + cuts[s, c + 1]):
            count[raw[i] - lo + 1] += 1
            n += 1
    for k in range(width):
        count[k + 1] += count[k]
    out = np.empty(n, dtype=np.int64)
    for s in range(cuts.shape[0]):
        for i in range(offs[s] + cuts[s, c], offs[s] + cuts[s, c + 1]):
            k = raw[i] - lo
            out[count[k]] = i
            count[k] += 1
    return out
