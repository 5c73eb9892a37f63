"""Look-ahead membership: move heavy segments between nearby steps so every step holds a multiple of dp of them.

Why. A short-lane segment longer than half a sequence ("heavy": a book or paper piece) fills a sequence
on its own. A step holding h heavy segments over dp ranks gives h mod dp ranks one more of them than the
others, and no assignment within the step can even that out (max/LB ~ (q+1)/q with few slots a rank).
Choosing which step a heavy segment goes to can.

How (planning.lookahead = K > 0; K = 0 keeps membership as drawn, byte-identical plans). Over all segments of the
planned steps at once: a few compiled passes over the segments (_lookahead_kernel: one classifies them and sums
what each step holds, one places the heavy segments' and one the lights' lengths in natural order, one writes
every segment's step), NumPy over the steps and the heavy segments between them:
- every stream position p of source k has its natural step n(p) (from the membership pointers);
- heavy: a short-lane segment longer than HEAVY_SHARE of a sequence (at most one fits a sequence);
- heavy segments of all sources in natural order (natural step, then source, then stream position);
  C(t) = natural cumulative heavy count through step t; the assigned cumulative count is
  A(t) = dp_t * round(C(t) / dp_t), clipped to C(t-K) <= A(t) <= C(t+K) (no heavy segment moves more than K
  steps), to a heavy-token shift of at most `tolerance` (planning.lookahead_tolerance) of the tokens planned so
  far (so the cumulative mixture stays near its target on every prefix; where a clip bites a step holds a
  non-multiple)
  and to at most slots_t - long_t heavy segments in step t; the last step takes all that remain;
- light segments (all other short-lane ones) keep their natural global order and are poured into the steps'
  remaining token room: the cumulative light tokens through t are the natural ones plus the heavy tokens
  the look-ahead took out of steps <= t (one searchsorted), so every step's total stays the natural one
  within a segment; a step whose short tokens would exceed its slots pushes its last lights on;
- long-lane segments stay in their natural step, and so do (counted in the steps' room) segments drawn within
  K+1 steps of their source's epoch start and all of a source whose epoch lasts under PIN_WINDOWS*(K+1) steps:
  no move crosses an epoch (a straggler left behind the next epoch's first step comes back to it);
- the last step takes only what fits: heavy and light segments the steps after t cannot take are placed by t.
A re-plan (see _resume) passes the positions its base left, those the base deferred with natural steps
before t0 (still moved at most K from them) and the base's short tokens (`planned_before`, for the tolerance).
make_plan keeps membership as drawn for mixes with image samples (unsplittable: the balancer needs the
steps' spare room).
The result is an assigned step per stream position; a step's segments of one source are no longer one
contiguous range, so StepItems gathers them through `StepAssignment` (same column layout).
Memory (bounded per segment, no int64 array over all segments): a fresh plan's positions are ranges and their
natural steps come from the pointers chunk by chunk; the pass keeps int32 steps, uint32 lengths and two
one-byte flags per segment (long lane; then the kind, written over the pins), the natural order is not stored
(each source's slice is in natural order: a pass reads the slices a chunk of steps at a time and places each
segment by its rank among the step's, no permutation of all segments), the lights' cumulative tokens are block
sums (_Cum, ~4 bytes a light, the lengths written once into its buffer), the assigned steps are written over the
natural ones; each stream's counts are dropped once that source's lengths are read (`drop_counts`), before the
next source's are. The result keeps uint32 positions and int32 steps (8 bytes a segment). Every position
drawn for the planned steps gets exactly one step (the property tests check all positions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from loomdata.planning._allocator import trim_arenas
from loomdata.planning._lookahead_kernel import (
    HEAVY,
    LIGHT,
    add_step_counts,
    classify,
    collect,
    fit_lights,
    light_counts,
    overflowing,
    run_steps,
    scatter_natural,
    segments_of,
    write_natural,
    write_steps,
)
from loomdata.planning._mixture import Stream
from loomdata.planning._packing import Lanes
from loomdata.planning._pointers import Pointers
from loomdata.schemas.spec import LOOKAHEAD_TOLERANCE

HEAVY_SHARE = 0.85
"""A short-lane segment is heavy when longer than this share of seq_len (measured on bench-long at 4K and 8K,
dp 8 and 64 x 2 micro-batches: 1/2 leaves steps whose every slot holds two heavy pieces of mixed lengths,
mean max/LB 1.024; 3/4 gives 1.006, 0.85 1.004, 0.9 1.007, full pieces only 1.024)."""
PIN_WINDOWS = 4
"""A source whose epoch lasts fewer than PIN_WINDOWS * (K + 1) steps (at its mean tokens a step) is not moved:
its documents would come back within the reach of a move (an epoch's tokens are all planned before they repeat)."""

__all__ = ["StepAssignment", "assign_steps", "natural_positions", "natural_ranges", "segments_at", "stable_order"]


@dataclass(frozen=True, slots=True)
class StepAssignment:
    """Per source, the stream positions of the planned steps sorted by assigned step (stream order within a
    step) and those steps: step t's segments of source k are pos[k][searchsorted(step[k], [t, t+1])].
    Stored compactly (uint32 positions where a stream has fewer than 2^32 segments, int32 steps)."""

    pos: list[np.ndarray]  # uint32/int64 stream positions
    step: list[np.ndarray]  # int32 assigned steps, non-decreasing

    def counts(self, steps: int, first: int = 0) -> np.ndarray:
        """(steps,) int64 segments assigned to each step first..first+steps-1, all sources together."""
        out = np.zeros(steps, dtype=np.int64)
        for st in self.step:  # one compiled pass over each source's steps (no search per step and source)
            add_step_counts(st, first, out)
        return out

    def source_counts(self, k: int, first: int, steps: int) -> np.ndarray:
        """(steps,) int64 segments of source k assigned to each step first..first+steps-1: one compiled pass over
        its steps (_lookahead_kernel.add_step_counts; a bincount would make an int64 copy of all of them)."""
        out = np.zeros(steps, dtype=np.int64)
        add_step_counts(self.step[k], first, out)
        return out

    def range(self, k: int, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, steps) of source k assigned to steps t0..t1-1, step-major then stream order."""
        st = self.step[k]  # needles of its own dtype: NumPy would search an int64 copy of all of it otherwise
        a, b = np.searchsorted(st, np.array([t0, t1], dtype=st.dtype))
        return self.pos[k][a:b], st[a:b]

    def agrees(self, other: StepAssignment, stop: int) -> bool:
        """Whether `other` assigns every source the same positions to the same steps as this one in every step
        before `stop` (a look-ahead over a prefix of the steps against the whole's: a range of steps balanced on
        either is then the same bytes)."""
        if len(self.pos) != len(other.pos):
            return False
        for k in range(len(self.pos)):
            p1, s1 = self.range(k, 0, stop)  # (steps are never negative)
            p2, s2 = other.range(k, 0, stop)
            if not (np.array_equal(s1, s2) and np.array_equal(p1, p2)):
                return False
        return True


TRIM_BYTES = 1 << 26
"""Bytes of streams' counts the look-ahead drops before it gives the allocator's free memory back (glibc keeps
freed heap blocks: those of many small streams would stay resident beside the pass's own columns)."""
CHUNK = 1 << 18
"""Segments handled at once where a pass over all drawn segments needs per-segment temporaries (a few
dozen bytes each: about 10 MB at a time)."""


def _pos_dtype(n: int) -> type[np.unsignedinteger] | type[np.signedinteger]:
    return np.uint32 if n < 2**32 else np.int64


def natural_positions(ptr: Pointers, t0: int, t1: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per source, the stream positions drawn for steps t0..t1-1 (uint32 where they fit) and the natural
    step of each (int32), computed a chunk at a time (no int64 array over all positions)."""
    pos, nat = [], []
    col_dtype = np.int32 if ptr.shape[0] < 2**31 else np.int64
    first, stop = ptr.row(t0), ptr.row(t1)
    for k in range(ptr.shape[1]):
        a, b = int(first[k]), int(stop[k])
        p = np.arange(a, b, dtype=_pos_dtype(b))
        nt = np.empty(b - a, dtype=col_dtype)
        col = ptr.column(k)
        for i in range(0, b - a, CHUNK):
            j = min(b - a, i + CHUNK)
            nt[i:j] = np.searchsorted(col, p[i:j], side="right") - 1
        pos.append(p)
        nat.append(nt)
    return pos, nat


def natural_ranges(ptr: Pointers, t0: int, t1: int) -> list[range]:
    """Per source, the stream positions drawn for steps t0..t1-1 as a range (natural steps come from `ptr`
    inside assign_steps: nothing is stored per position)."""
    first, stop = ptr.row(t0), ptr.row(t1)
    return [range(int(a), int(b)) for a, b in zip(first.tolist(), stop.tolist(), strict=True)]


Positions = np.ndarray | range
"""One source's stream positions: an array, or a range (a fresh plan's natural positions)."""
Allocate = Callable[[int, Any], np.ndarray]
"""Makes an uninitialised 1-D array of `n` items of a dtype (np.empty's role: assign_steps's `alloc`)."""


def _empty(n: int, dtype: Any) -> np.ndarray:
    return np.empty(n, dtype=dtype)


def _arr(p: Positions, dtype: type[np.integer] | None = None) -> np.ndarray:
    """The positions as an array (a range is materialised: only where an array is unavoidable)."""
    if isinstance(p, range):
        return np.arange(p.start, p.stop, dtype=dtype or _pos_dtype(p.stop))
    return np.asarray(p) if dtype is None else np.asarray(p, dtype=dtype)


def _search(p: Positions, q: np.ndarray) -> np.ndarray:
    """searchsorted(p, q, side="left") over increasing positions (arithmetic for a range)."""
    if isinstance(p, range):
        return np.clip(np.asarray(q, dtype=np.int64) - p.start, 0, len(p))
    return np.searchsorted(p, q, side="left")


def segments_at(
    st: Stream, pos: np.ndarray, lengths: np.ndarray, lanes: Lanes
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(doc, offset, length, lane) of the stream positions `pos` (any order), as Stream.segments gives them: one
    compiled pass (_lookahead_kernel.segments_of; a gather is called once a source and block, so with many
    sources a dozen NumPy calls each cost more than the gathering)."""
    threshold = -1 if lanes.threshold is None else int(lanes.threshold)
    return segments_of(st.doc, pos, lengths, st.split_pos, st.split_off, st.split_len, threshold)


class _Order:
    """The drawn segments of all sources (concatenated source after source) in natural order: natural step,
    then source, then stream position. Where every source's positions increase and natural steps do not
    decrease (as drawn), each source's slice is in natural order already: a pass reads the slices a chunk of
    steps at a time and places each segment by its rank (scatter_natural, write_natural: no permutation of all
    segments); otherwise one lexsort of all of them, handed out a chunk of global indices at a time."""

    def __init__(self, pos: Sequence[Positions], raw: np.ndarray, offs: np.ndarray, lo_step: int, hi_step: int) -> None:
        """`lo_step`..`hi_step` - 1: the range of the natural steps `raw`."""
        self.raw, self.offs = raw, np.ascontiguousarray(offs, dtype=np.int64)
        self.lo_step, self.hi_step = lo_step, hi_step
        sorted_ = all(
            _nondecreasing(raw[offs[s] : offs[s + 1]]) and (isinstance(p, range) or _increasing(np.asarray(p)))
            for s, p in enumerate(pos)
        )
        self.full: np.ndarray | None = None
        if not sorted_:
            src = np.repeat(np.arange(len(pos), dtype=np.int64), np.diff(offs))
            flat_pos = np.concatenate([_arr(p, np.int64) for p in pos])
            self.full = np.lexsort((flat_pos, src, raw))
        per_step = max(1, len(raw) // max(hi_step - lo_step, 1))
        self.width = max(1, CHUNK // per_step)
        self.edges = np.arange(lo_step, hi_step + self.width, self.width, dtype=np.int64)
        # where every chunk of steps starts in each source's slice: one search a source, not one a chunk and source
        self.cuts = (
            np.stack(
                [
                    np.searchsorted(raw[offs[s] : offs[s + 1]], self.edges.astype(raw.dtype))
                    for s in range(len(offs) - 1)
                ]
            ).astype(np.int64)
            if self.full is None and len(offs) > 1
            else np.zeros((len(offs) - 1, 1), dtype=np.int64)
        )

    def chunks(self) -> Iterator[np.ndarray]:
        """Global indices in natural order, chunk after chunk (the lexsort path: positions not in stream order)."""
        full = self.full if self.full is not None else np.zeros(0, dtype=np.int64)
        for a in range(0, len(full), CHUNK):
            yield full[a : a + CHUNK]

    def gather(self, kind: np.ndarray, want: int, per_step: np.ndarray, vals: np.ndarray, dst: np.ndarray) -> None:
        """dst[j] = vals[i] for the j-th segment i of kind `want` in natural order (`per_step`: how many of them
        each natural step lo_step.. holds)."""
        if self.full is not None:
            at = 0
            for ch in self.chunks():
                at = collect(ch, kind, want, vals, dst, at)
            return
        nxt = _exclusive(per_step)
        scatter_natural(self.raw, self.offs, self.cuts, kind, want, nxt, self.lo_step, vals, dst)

    def write(
        self,
        kind: np.ndarray,
        nt: np.ndarray,
        out: np.ndarray,
        h_step: np.ndarray,
        h_per_step: np.ndarray,
        l_per_step: np.ndarray,
        cnt0: np.ndarray,
        last: int,
        t0: int,
    ) -> None:
        """The assigned steps into `out` (may be `raw`): heavy j (natural order) to h_step[j], light j to the last
        step t with cnt0[t] <= j, the others nt; capped at `last`, offset by t0 (write_natural/write_steps)."""
        if self.full is not None:
            hj, lj, tl = 0, 0, -1
            for ch in self.chunks():
                hj, lj, tl = write_steps(ch, kind, nt, out, h_step, cnt0, hj, lj, tl, last, t0)
            return
        hn, ln = _exclusive(h_per_step), _exclusive(l_per_step)
        write_natural(
            self.raw, self.offs, self.cuts, self.edges, kind, nt, out, h_step, hn, ln, cnt0, self.lo_step, last, t0
        )


def _exclusive(counts: np.ndarray) -> np.ndarray:
    """(len(counts) + 1,) int64: 0, then the cumulative counts (where each count's run starts, and the total)."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def stable_order(key: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """np.argsort(key, kind="stable") of integer keys in [lo, hi): NumPy's radix sort of 16-bit keys where the
    range fits (3x faster than its merge sort on a chunk's runs of steps here), the same order."""
    if hi - lo <= 1 << 16:
        return np.argsort((key - lo).astype(np.uint16), kind="stable")
    return np.argsort(key, kind="stable")


def _nondecreasing(a: np.ndarray) -> bool:
    return all(bool((a[i + 1 : j + 1] >= a[i:j]).all()) for i, j in _pairs(len(a)))


def _increasing(a: np.ndarray) -> bool:
    return all(bool((a[i + 1 : j + 1] > a[i:j]).all()) for i, j in _pairs(len(a)))


def _pairs(n: int) -> list[tuple[int, int]]:
    """Chunks [i, j) of the n - 1 neighbour pairs (i, i+1) of an array of n entries."""
    return [(i, min(n - 1, i + CHUNK)) for i in range(0, max(n - 1, 0), CHUNK)]


def assign_steps(
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
    alloc: Allocate | None = None,
) -> StepAssignment:
    """Assigned steps (t0..t1-1) of the positions `pos` of every source, natural steps `nat` (counted clipped
    into t0..t1-1; one before t0, which a re-plan's base deferred, still moves at most K steps from it).
    `slots`/`dp` are per step (indexed by absolute step); streams must still hold their counts.
    `final`: t1-1 is the plan's last step, which takes every heavy segment left (else the window is a
    prefix of a longer plan). `planned_before`: short-lane tokens planned before t0 (a re-plan's base steps),
    part of the prefix the mixture tolerance is a share of. `nat` None: the natural steps of the positions
    from the membership pointers `ptr` (a fresh plan; `pos` may then be ranges, natural_ranges).
    `release_ptr`: `ptr.release()` once the natural steps are read (its chunks not held through the pass's peak:
    for a caller that balances from the assignment alone).
    `drop_counts`: once source k's per-segment lengths are read, `streams[k]` is replaced by its
    `without_counts()` (frees the caller's cumulative counts source by source, when the caller holds no other
    reference). `tolerance`: the most heavy tokens moved, as a share of the tokens planned so far
    (the spec's `planning.lookahead_tolerance`). `alloc`: makes the result's arrays (the steps of all sources, each
    source's positions; planning._distributed writes them into its shared folder's files, so the whole look-ahead
    is not copied there after it ends); default np.empty.

    Memory: a few bytes a drawn segment (int32 steps, uint32 lengths, one byte of flags, the lights' lengths
    and int64 cumulative tokens in natural order); per-segment temporaries are made a chunk at a time."""
    n = t1 - t0
    seq = lanes.seq_len
    n_src = len(pos)
    offs = np.zeros(n_src + 1, dtype=np.int64)
    offs[1:] = np.cumsum([len(p) for p in pos])
    total = int(offs[-1])
    step_dtype = np.int32 if t1 < 2**31 else np.int64
    make = _empty if alloc is None else alloc
    raw = make(total, step_dtype)  # window-relative natural steps, < 0 for what a re-plan's base deferred
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
    lo_step, hi_step = (int(raw.min()), int(raw.max()) + 1) if total else (0, 0)
    clipped = total and (lo_step < 0 or hi_step > n)
    nt = np.clip(raw, 0, n - 1) if clipped else raw
    sl = slots[t0:t1].astype(np.int64)
    dpt = dp[t0:t1].astype(np.int64)
    # a source whose epoch is shorter than a few windows of steps repeats documents within reach of a move:
    # its segments stay where membership drew them (they still take their room in the step)
    epochs = np.array([st.epoch_tokens for st in streams], dtype=np.float64)
    short_epoch = epochs * n < PIN_WINDOWS * (k + 1) * drawn  # its epoch lasts fewer steps than that
    # and segments drawn within K + 1 steps of their source's epoch start stay too (`edge`): no move crosses an
    # epoch. One compiled pass: each segment's kind (HEAVY, LIGHT or staying, written over the `edge` flags) and
    # the per-step sums the heavy and light passes need
    if not n:
        edge[:] = False
        short_epoch[:] = False
    kind = edge.view(np.uint8)
    del edge
    n_long, pinned_light, short_i, h_cnt, h_nat_tok, l_nat, h_raw, l_raw = classify(
        raw, nt, length, is_long, kind, offs, short_epoch, HEAVY_SHARE * seq, n, lo_step, hi_step - lo_step
    )
    del is_long
    n_heavy, n_light = int(h_raw.sum()), int(l_raw.sum())
    cap_h = np.maximum(sl - n_long, 0)  # sequences left for the moving short segments
    short_tok = short_i.astype(np.float64)
    del short_i
    order = _Order(pos, raw, offs, lo_step, hi_step)
    # the heavy segments' lengths in natural order (one compiled pass over the sources' slices)
    h_len = np.empty(n_heavy, dtype=np.uint32)
    order.gather(kind, HEAVY, h_raw, length, h_len)
    c = np.cumsum(h_cnt)
    del h_cnt
    a = (c + dpt // 2) // dpt * dpt
    # no heavy segment later than K steps after its natural step (also those a re-plan's base deferred): lo[t]
    # heavy segments have a natural step <= t - K (searchsorted over their natural steps in natural order)
    h_le = np.cumsum(h_raw)
    v = np.arange(n, dtype=np.int64) - k - lo_step
    lo = np.where(v < 0, 0, h_le[np.clip(v, 0, len(h_le) - 1)] if len(h_le) else 0)
    del h_le, v
    hi = c[np.minimum(np.arange(n) + k, n - 1)]
    a = np.clip(a, lo, hi)
    hc = np.zeros(n_heavy + 1, dtype=np.int64)
    np.cumsum(h_len, out=hc[1:])
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
    if len(a) and bool((a[1:] >= a[:-1]).all()):  # (as a rule): one merged walk, not a search a heavy segment
        h_step = run_steps(np.concatenate([[-1], a]), 0, n_heavy).astype(step_dtype)  # steps <= n
    else:
        h_step = np.searchsorted(a, np.arange(n_heavy), side="right").astype(step_dtype)
    h_asg_tok = np.bincount(np.minimum(h_step, n - 1), weights=h_len, minlength=n).astype(np.int64)
    # the heavy pass's arrays of steps go before the lights' peak (at dp 4 a step holds about 60 segments, so a
    # dozen 8-byte arrays of steps are over a byte a segment)
    del n_long, short_tok, sl, dpt, lo, hi, a, c, slack, h_cap, capc, epochs, short_epoch, drawn, h_len

    l_len = _Cum.buffer(n_light)  # the lights' lengths in natural order, written straight into _Cum's blocks
    order.gather(kind, LIGHT, l_raw, length, l_len)  # (one compiled pass over the sources' slices)
    del length
    lc = _Cum(l_len, n_light)  # cumulative light tokens in natural order (owns l_len: no copy)
    del l_len
    room = np.cumsum(l_nat + h_nat_tok - h_asg_tok)
    cnt = light_counts(lc.pre, lc.pad, n_light + 1, room)
    if final and n:
        cnt[-1] = n_light
    light_room = cap_h * seq - h_asg_tok - pinned_light
    _fit_lights(cnt, lc, light_room)
    if final and n:
        _fit_end(cnt, lc, light_room)
    del lc
    # every segment's assigned step, written over `raw` (each segment is read before it is written; no second
    # array of all steps): heavy ones from h_step, lights from cnt, the others their natural step; what no step
    # took (a prefix window) is left at its end
    out = raw
    cnt0 = np.concatenate([np.zeros(1, dtype=np.int64), cnt.astype(np.int64, copy=False)])
    if total:
        order.write(kind, nt, out, h_step, h_raw, l_raw, cnt0, n - 1, t0)
    del cnt0, h_step, kind, raw, nt, order, h_raw, l_raw

    # each source's steps are sorted into its own slice of `out` (the result's steps are views of it: no second
    # array of all steps beside it while the positions are laid out)
    res_pos, res_step = [], []
    for s, p in enumerate(pos):
        r_step = out[offs[s] : offs[s + 1]]
        st_k = _epoch_order(r_step, starts[s])  # r_step itself, or a corrected copy
        p_dtype = _pos_dtype(p.stop if isinstance(p, range) else (int(np.max(p)) + 1 if len(p) else 0))
        r_pos = make(len(st_k), p_dtype)
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


def _natural_steps(col: np.ndarray, p: Positions, i0: int, i1: int, q: np.ndarray | None) -> np.ndarray:
    """The natural step of positions q = p[i0:i1] of one source (the step t with col[t] <= q < col[t+1], col its
    membership pointers: searchsorted(col, q, "right") - 1); linear for a range (_steps_of_run; q unused)."""
    if isinstance(p, range):
        return _steps_of_run(col, p.start + i0, p.start + i1) if i1 > i0 else np.zeros(0, dtype=np.int64)
    if q is None:
        raise ValueError("the positions q of p[i0:i1] are needed where p is not a range")
    return np.searchsorted(col, q, side="right") - 1


def _steps_of_run(col: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """searchsorted(col, arange(lo, hi), "right") - 1 for a non-decreasing `col` with col[0] <= lo: one binary
    search, then a merged walk over the values and the steps they span (_lookahead_kernel.run_steps, compiled;
    no binary search per value)."""
    return run_steps(col, lo, hi)


def _sorted_pieces(key: np.ndarray) -> list[tuple[int, int]]:
    """Pieces [a, b) of `key` that a stable sort orders apart: at each cut every key before is <= every key
    after (checked at chunk boundaries), so sorting piece by piece is the one stable sort of all (without
    an 8-byte permutation of all of them)."""
    n = len(key)
    bounds = [*range(0, n, CHUNK), n]
    if n <= CHUNK:
        return [(0, n)]
    suffix_min = [0] * len(bounds)
    lo = np.iinfo(np.int64).max
    for i in range(len(bounds) - 2, -1, -1):
        lo = min(lo, int(key[bounds[i] : bounds[i + 1]].min()))
        suffix_min[i] = lo
    out, start, hi = [], 0, np.iinfo(np.int64).min
    for i in range(1, len(bounds) - 1):
        hi = max(hi, int(key[bounds[i - 1] : bounds[i]].max()))
        if hi <= suffix_min[i]:
            out.append((start, bounds[i]))
            start = bounds[i]
    out.append((start, n))
    return out


def _epoch_starts(p: Positions, st: Stream) -> np.ndarray:
    """Indices i into the positions `p` (increasing) where a new epoch of the stream begins (p[i-1] is in an
    earlier epoch than p[i]), from the epochs' first stream positions (no per-position epoch array)."""
    if len(p) < 2 or st.epoch_tokens <= 0:
        return np.zeros(0, dtype=np.int64)
    last = int(st.cum[int(p[-1])]) // st.epoch_tokens
    first = int(st.cum[int(p[0])]) // st.epoch_tokens
    if last == first:
        return np.zeros(0, dtype=np.int64)
    # the first stream position of epoch e: cum[q] >= e * epoch_tokens
    q = np.searchsorted(st.cum, np.arange(first + 1, last + 1, dtype=np.int64) * st.epoch_tokens, side="left")
    return np.unique(_search(p, q))


def _near_epoch_start(at: np.ndarray, nat: np.ndarray, reach: int, out: np.ndarray) -> None:
    """Set `out` where each position (increasing, natural steps `nat`) of one source is drawn within `reach`
    steps of a step where the source starts a new epoch (`at`: where in the positions epochs begin)."""
    if len(at) == 0:
        return
    starts = nat[at]  # natural steps of each new epoch's first position
    for a in range(0, len(nat), CHUNK):
        nt = nat[a : a + CHUNK]
        i = np.searchsorted(starts, nt)
        after = np.abs(starts[np.minimum(i, len(starts) - 1)] - nt)
        before = np.abs(starts[np.maximum(i - 1, 0)] - nt)
        out[a : a + CHUNK] = np.minimum(after, before) <= reach


def _epoch_order(step: np.ndarray, at: np.ndarray) -> np.ndarray:
    """`step` of one source's positions (increasing; a new epoch begins at each index of `at`) with no segment
    after a segment of a later epoch: one the look-ahead left behind the next epoch's first step comes back to
    it (few: the segments moved across the boundary), so every epoch's tokens are all planned before the next
    repeats one."""
    if len(at) == 0:
        return step
    later = np.minimum.accumulate(step[::-1])[::-1]  # the earliest step from each position on
    out = step.copy()
    bounds = [0, *at.tolist()]
    for e in range(len(bounds) - 1):  # positions of epoch e are capped by the earliest step of the next ones
        np.minimum(out[bounds[e] : bounds[e + 1]], later[bounds[e + 1]], out=out[bounds[e] : bounds[e + 1]])
    return out


class _Cum:
    """The cumulative sums c[0..L] (c[0] = 0) of L uint32 lengths, stored as the lengths and every 64th sum
    (4.1 bytes an entry instead of 8): c[i] and searchsorted(c, v) read one block of 64 lengths each. The
    lengths are written by the caller into `buffer(L)` and kept as they are (no second copy at its peak)."""

    B = 64
    SUM_BLOCKS = CHUNK
    """Blocks summed at a time (each sum's int64 temporaries stay small)."""

    @classmethod
    def buffer(cls, n: int) -> np.ndarray:
        """A zeroed uint32 buffer of n lengths padded to whole blocks: fill its first n and hand it to _Cum."""
        return np.zeros((n // cls.B + 1) * cls.B, dtype=np.uint32)

    def __init__(self, pad: np.ndarray, n: int) -> None:
        """Over the first n lengths of `pad` (from `buffer(n)`, zero beyond n), which it keeps (no copy)."""
        if len(pad) != (n // self.B + 1) * self.B:
            raise ValueError(f"_Cum over {n} lengths wants a buffer of {(n // self.B + 1) * self.B}, got {len(pad)}")
        blocks = pad.reshape(-1, self.B)
        self.pre = np.zeros(len(blocks), dtype=np.int64)  # pre[j] = c[64 j]
        full = n // self.B
        for a in range(0, full, self.SUM_BLOCKS):  # whole blocks' sums a chunk at a time (no int64 copy of all)
            b = min(full, a + self.SUM_BLOCKS)
            np.sum(blocks[a:b], axis=1, dtype=np.int64, out=self.pre[a + 1 : b + 1])
        np.cumsum(self.pre, out=self.pre)
        self.pad = blocks
        self.len = pad[:n]

    def _rows(self, j: np.ndarray) -> np.ndarray:
        """(len(j), 64) c values at block j's entries: c[64 j + r] for r < 64."""
        rows = np.cumsum(self.pad[j], axis=1, dtype=np.int64)
        out = np.empty_like(rows)
        out[:, 0] = 0
        out[:, 1:] = rows[:, :-1]
        out += self.pre[j][:, None]
        return out

    def __getitem__(self, i: int | np.ndarray) -> Any:
        """c[i] for an index or an array of them (0 <= i <= L)."""
        if isinstance(i, (int, np.integer)):
            b, r = divmod(int(i), self.B)
            return int(self.pre[b]) + int(self.len[b * self.B : b * self.B + r].sum(dtype=np.int64))
        idx = np.asarray(i, dtype=np.int64)
        out = np.empty(len(idx), dtype=np.int64)
        for a in range(0, len(idx), 4096):
            q = idx[a : a + 4096]
            j = q // self.B
            out[a : a + 4096] = self._rows(j)[np.arange(len(q)), q - j * self.B]
        return out

    def searchsorted(self, v: np.ndarray, side: Literal["left", "right"]) -> np.ndarray:
        """np.searchsorted(c, v, side) for an array of values (c is non-decreasing)."""
        v = np.asarray(v)
        n_c = len(self.len) + 1
        out = np.empty(len(v), dtype=np.int64)
        for a in range(0, len(v), 4096):
            x = v[a : a + 4096]
            nb = np.searchsorted(self.pre, x, side=side)  # block starts below (left) or at most (right) x
            jb = np.maximum(nb - 1, 0)
            rows = self._rows(jb)
            valid = jb[:, None] * self.B + np.arange(self.B) < n_c  # entries that exist (c has L+1)
            hit = (rows < x[:, None]) if side == "left" else (rows <= x[:, None])
            out[a : a + 4096] = np.where(nb == 0, 0, jb * self.B + (hit & valid).sum(axis=1))
        return out


def _fit_end(cnt: np.ndarray, lc: _Cum, room: np.ndarray) -> None:
    """Pull the first light segments of a plan's last step back into the step before while its short tokens
    exceed its slots, and so on backwards (in place): nothing is left to carry past the last step."""
    t = len(cnt) - 1
    while t > 0 and lc[cnt[t]] - lc[cnt[t - 1]] > room[t]:
        j = int(lc.searchsorted(np.array([lc[int(cnt[t])] - max(int(room[t]), 0)]), "left")[0])
        cnt[t - 1] = min(max(j, int(cnt[t - 1])), int(cnt[t]))
        t -= 1


def _fit_lights(cnt: np.ndarray, lc: _Cum, room: np.ndarray) -> None:
    """Push the last light segments of a step whose short tokens exceed its slots on to the next step (in place).

    Visits only steps that overflow and the steps after a push (a light segment is at most half a sequence,
    so an overflow is rare and short-lived); the last step keeps what it has (the balancer carries it)."""
    bad = overflowing(cnt, lc.pre, lc.pad, room)
    if len(bad):  # compiled (_lookahead_kernel.fit_lights): a few NumPy calls an overflowing step otherwise
        fit_lights(cnt, lc.pre, lc.pad, len(lc.len) + 1, room, bad)
