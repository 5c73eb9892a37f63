"""Look-ahead membership: move heavy segments between nearby steps so every step holds a multiple of dp of them.

Why. A short-lane segment longer than half a sequence ("heavy": a book or paper piece) fills a sequence
on its own. A step holding h heavy segments over dp ranks gives h mod dp ranks one more of them than the
others, and no assignment within the step can even that out (max/LB ~ (q+1)/q with few slots a rank).
Choosing which step a heavy segment goes to can.

How (planning.lookahead = K > 0; K = 0 keeps membership as drawn, byte-identical plans). All of it is
NumPy over all segments of the planned steps at once, a short loop only over steps a repair must visit:
- every stream position p of source k has its natural step n(p) (from the membership pointers);
- heavy: a short-lane segment longer than HEAVY_SHARE of a sequence (at most one fits a sequence);
- heavy segments of all sources in natural order (natural step, then source, then stream position);
  C(t) = natural cumulative heavy count through step t; the assigned cumulative count is
  A(t) = dp_t * round(C(t) / dp_t), clipped to C(t-K) <= A(t) <= C(t+K) (no heavy segment moves more than K
  steps), to a heavy-token shift of at most MIXTURE_TOLERANCE of the tokens planned so far (so the
  cumulative mixture stays near its target on every prefix; where a clip bites a step holds a non-multiple)
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
contiguous range, so StepItems gathers them through `StepAssignment` (same column layout). Every position
drawn for the planned steps gets exactly one step (the property tests check all positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loomdata.planning._mixture import Stream
from loomdata.planning._packing import Lanes

HEAVY_SHARE = 0.85
"""A short-lane segment is heavy when longer than this share of seq_len (measured on bench-long at 4K and 8K,
dp 8 and 64 x 2 micro-batches: 1/2 leaves steps whose every slot holds two heavy pieces of mixed lengths,
mean max/LB 1.024; 3/4 gives 1.006, 0.85 1.004, 0.9 1.007, full pieces only 1.024)."""
MIXTURE_TOLERANCE = 0.0075
"""Most heavy tokens the look-ahead may move ahead of or behind their natural steps, as a share of the
tokens planned so far (bounds the deviation of cumulative source shares it adds, on every prefix)."""

PIN_WINDOWS = 4
"""A source whose epoch lasts fewer than PIN_WINDOWS * (K + 1) steps (at its mean tokens a step) is not moved:
its documents would come back within the reach of a move (an epoch's tokens are all planned before they repeat)."""

__all__ = ["StepAssignment", "assign_steps", "natural_positions", "segments_at"]


@dataclass(frozen=True, slots=True)
class StepAssignment:
    """Per source, the stream positions of the planned steps sorted by assigned step (stream order within a
    step) and those steps: step t's segments of source k are pos[k][searchsorted(step[k], [t, t+1])]."""

    pos: list[np.ndarray]  # int64 stream positions
    step: list[np.ndarray]  # int64 assigned steps, non-decreasing

    def counts(self, steps: int) -> np.ndarray:
        """(steps,) int64 segments assigned to each step, all sources together."""
        out = np.zeros(steps, dtype=np.int64)
        for st in self.step:
            out += np.bincount(st, minlength=steps)[:steps]
        return out

    def range(self, k: int, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, steps) of source k assigned to steps t0..t1-1, step-major then stream order."""
        a, b = np.searchsorted(self.step[k], [t0, t1])
        return self.pos[k][a:b], self.step[k][a:b]


def natural_positions(ptr: np.ndarray, t0: int, t1: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per source, the stream positions drawn for steps t0..t1-1 and the natural step of each."""
    pos, nat = [], []
    for k in range(ptr.shape[1]):
        p = np.arange(int(ptr[t0, k]), int(ptr[t1, k]), dtype=np.int64)
        pos.append(p)
        nat.append(np.searchsorted(ptr[:, k], p, side="right").astype(np.int64) - 1)
    return pos, nat


def segments_at(
    st: Stream, pos: np.ndarray, lengths: np.ndarray, lanes: Lanes
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(doc, offset, length, lane) of the stream positions `pos` (any order), as Stream.segments gives them."""
    doc = st.doc[pos]
    dl = lengths[doc]
    length = dl.astype(np.uint32, copy=True)
    offset = np.zeros(len(doc), dtype=np.uint32)
    if len(st.split_pos) and len(pos):
        i = np.minimum(np.searchsorted(st.split_pos, pos), len(st.split_pos) - 1)
        hit = st.split_pos[i] == pos
        offset[hit] = st.split_off[i[hit]]
        length[hit] = st.split_len[i[hit]]
    return doc, offset, length, lanes.lane_of(dl)


def assign_steps(
    pos: Sequence[np.ndarray],
    nat: Sequence[np.ndarray],
    streams: Sequence[Stream],
    lanes: Lanes,
    slots: np.ndarray,
    dp: np.ndarray,
    k: int,
    t0: int,
    t1: int,
    *,
    final: bool = True,
    planned_before: int = 0,
) -> StepAssignment:
    """Assigned steps (t0..t1-1) of the positions `pos` of every source, natural steps `nat` (counted clipped
    into t0..t1-1; one before t0, which a re-plan's base deferred, still moves at most K steps from it).
    `slots`/`dp` are per step (indexed by absolute step); streams must still hold their counts.
    `final`: t1-1 is the plan's last step, which takes every heavy segment left (else the window is a
    prefix of a longer plan). `planned_before`: short-lane tokens planned before t0 (a re-plan's base steps),
    part of the prefix the mixture tolerance is a share of."""
    n = t1 - t0
    seq = lanes.seq_len
    src_parts, nat_parts, len_parts, long_parts, edge_parts = [], [], [], [], []
    for s, (p, nt) in enumerate(zip(pos, nat, strict=True)):
        st = streams[s]
        src_parts.append(np.full(len(p), s, dtype=np.int64))
        nat_parts.append(np.asarray(nt, dtype=np.int64) - t0)
        len_parts.append(st.cum[p + 1] - st.cum[p])
        long_parts.append(
            np.zeros(len(p), dtype=bool) if st.cum_long is None else (st.cum_long[p + 1] - st.cum_long[p]) > 0
        )
        edge_parts.append(_near_epoch_start(np.asarray(p, dtype=np.int64), nat_parts[-1], st, k + 1))
    src = np.concatenate(src_parts)
    raw = np.concatenate(nat_parts)  # window-relative natural steps, < 0 for what a re-plan's base deferred
    nt = np.clip(raw, 0, n - 1)
    length = np.concatenate(len_parts)
    is_long = np.concatenate(long_parts)
    flat_pos = np.concatenate([np.asarray(p, dtype=np.int64) for p in pos])
    out = nt.copy()  # long-lane segments and those of short-epoch sources keep their natural step
    sl = slots[t0:t1].astype(np.int64)
    dpt = dp[t0:t1].astype(np.int64)
    tall = length > HEAVY_SHARE * seq
    # a source whose epoch is shorter than a few windows of steps repeats documents within reach of a move:
    # its segments stay where membership drew them (they still take their room in the step)
    drawn = np.bincount(src, weights=length, minlength=len(streams))  # tokens of each source in the window
    epochs = np.array([st.epoch_tokens for st in streams], dtype=np.float64)
    short_epoch = epochs * n < PIN_WINDOWS * (k + 1) * drawn  # its epoch lasts fewer steps than that
    # and segments drawn within K + 1 steps of their source's epoch start stay too: no move crosses an epoch
    pinned = ~is_long & (short_epoch[src] | np.concatenate(edge_parts)) if n else np.zeros(0, dtype=bool)
    n_long = np.bincount(nt[is_long], minlength=n) + np.bincount(nt[pinned & tall], minlength=n)
    cap_h = np.maximum(sl - n_long, 0)  # sequences left for the moving short segments
    pinned_light = np.bincount(nt[pinned & ~tall], weights=length[pinned & ~tall], minlength=n).astype(np.int64)

    heavy = ~is_long & ~pinned & tall
    hi_idx = np.flatnonzero(heavy)
    hi_idx = hi_idx[np.lexsort((flat_pos[hi_idx], src[hi_idx], raw[hi_idx]))]
    c = np.cumsum(np.bincount(nt[hi_idx], minlength=n))
    a = (c + dpt // 2) // dpt * dpt
    # no heavy segment later than K steps after its natural step (also those a re-plan's base deferred)
    lo = np.searchsorted(raw[hi_idx], np.arange(n) - k, side="right")
    hi = c[np.minimum(np.arange(n) + k, n - 1)]
    a = np.clip(a, lo, hi)
    hc = np.zeros(len(hi_idx) + 1, dtype=np.int64)
    np.cumsum(length[hi_idx], out=hc[1:])
    slack = MIXTURE_TOLERANCE * (
        planned_before + np.cumsum(np.bincount(nt[~is_long], weights=length[~is_long], minlength=n))
    )
    h_nat = hc[c]
    a = np.clip(
        a, np.searchsorted(hc, h_nat - slack, side="left"), np.searchsorted(hc, h_nat + slack, side="right") - 1
    )
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
    h_step = np.searchsorted(a, np.arange(len(hi_idx)), side="right")
    out[hi_idx] = h_step
    h_nat_tok = np.bincount(nt[hi_idx], weights=length[hi_idx], minlength=n).astype(np.int64)
    h_asg_tok = np.bincount(np.minimum(h_step, n - 1), weights=length[hi_idx], minlength=n).astype(np.int64)

    li_idx = np.flatnonzero(~heavy & ~is_long & ~pinned)
    li_idx = li_idx[np.lexsort((flat_pos[li_idx], src[li_idx], raw[li_idx]))]
    l_len = length[li_idx]
    lc = np.zeros(len(li_idx) + 1, dtype=np.int64)
    np.cumsum(l_len, out=lc[1:])
    l_nat = np.bincount(nt[li_idx], weights=l_len, minlength=n).astype(np.int64)
    room = np.cumsum(l_nat + h_nat_tok - h_asg_tok)
    cnt = np.maximum.accumulate(np.maximum(np.searchsorted(lc, room, side="right") - 1, 0))
    if final and n:
        cnt[-1] = len(li_idx)
    light_room = cap_h * seq - h_asg_tok - pinned_light
    _fit_lights(cnt, lc, light_room)
    if final and n:
        _fit_end(cnt, lc, light_room)
    out[li_idx] = np.searchsorted(cnt, np.arange(len(li_idx)), side="right")
    out = np.minimum(out, n - 1) + t0  # what no step took (a prefix window) is left at its end

    res_pos, res_step = [], []
    at = 0
    for s, p in enumerate(pos):
        st_k = _epoch_order(out[at : at + len(p)], np.asarray(p, dtype=np.int64), streams[s])
        order = np.argsort(st_k, kind="stable")  # positions are increasing: stream order within a step
        res_pos.append(np.asarray(p, dtype=np.int64)[order])
        res_step.append(st_k[order])
        at += len(p)
    return StepAssignment(res_pos, res_step)


def _near_epoch_start(pos: np.ndarray, nat: np.ndarray, st: Stream, reach: int) -> np.ndarray:
    """Whether each position (increasing, natural steps `nat`) of one source is drawn within `reach` steps of
    a step where the source starts a new epoch."""
    if len(pos) == 0 or st.epoch_tokens <= 0:
        return np.zeros(len(pos), dtype=bool)
    epoch = st.cum[pos] // st.epoch_tokens
    starts = nat[np.flatnonzero(np.diff(epoch) > 0) + 1]  # natural steps of each new epoch's first position
    if len(starts) == 0:
        return np.zeros(len(pos), dtype=bool)
    i = np.searchsorted(starts, nat)
    after = np.abs(starts[np.minimum(i, len(starts) - 1)] - nat)
    before = np.abs(starts[np.maximum(i - 1, 0)] - nat)
    return np.minimum(after, before) <= reach


def _epoch_order(step: np.ndarray, pos: np.ndarray, st: Stream) -> np.ndarray:
    """`step` of one source's positions `pos` (increasing) with no segment after a segment of a later epoch:
    one the look-ahead left behind the next epoch's first step comes back to it (few: the segments moved
    across the boundary), so every epoch's tokens are all planned before the next repeats one."""
    if len(pos) == 0 or st.epoch_tokens <= 0:
        return step
    epoch = st.cum[pos] // st.epoch_tokens  # non-decreasing: positions are in stream order
    if epoch[0] == epoch[-1]:
        return step
    after = np.searchsorted(epoch, epoch, side="right")  # where the next epoch starts
    later = np.minimum.accumulate(step[::-1])[::-1]  # the earliest step from each position on
    cap = np.where(after < len(step), later[np.minimum(after, len(step) - 1)], step)
    return np.minimum(step, cap)


def _fit_end(cnt: np.ndarray, lc: np.ndarray, room: np.ndarray) -> None:
    """Pull the first light segments of a plan's last step back into the step before while its short tokens
    exceed its slots, and so on backwards (in place): nothing is left to carry past the last step."""
    t = len(cnt) - 1
    while t > 0 and lc[cnt[t]] - lc[cnt[t - 1]] > room[t]:
        j = int(np.searchsorted(lc, lc[cnt[t]] - max(int(room[t]), 0), side="left"))
        cnt[t - 1] = min(max(j, int(cnt[t - 1])), int(cnt[t]))
        t -= 1


def _fit_lights(cnt: np.ndarray, lc: np.ndarray, room: np.ndarray) -> None:
    """Push the last light segments of a step whose short tokens exceed its slots on to the next step (in place).

    Visits only steps that overflow and the steps after a push (a light segment is at most half a sequence,
    so an overflow is rare and short-lived); the last step keeps what it has (the balancer carries it)."""
    n = len(cnt)
    prev = np.concatenate([[0], cnt[:-1]])
    bad = np.flatnonzero(lc[cnt] - lc[prev] > room)
    i = 0
    while i < len(bad):
        t = int(bad[i])
        dirty = True
        while dirty and t < n - 1:
            before = int(cnt[t - 1]) if t else 0
            limit = lc[before] + max(int(room[t]), 0)
            fit = int(np.searchsorted(lc, limit, side="right")) - 1
            cnt[t] = max(min(int(cnt[t]), fit), before)
            t += 1
            if cnt[t] < cnt[t - 1]:
                cnt[t] = cnt[t - 1]
            dirty = lc[cnt[t]] - lc[cnt[t - 1]] > room[t]
        i = int(np.searchsorted(bad, t, side="right"))
