"""LPT rounds for a block of steps at once: deal each step's short segments, largest first, in rounds.

In a round the i-th largest goes to the i-th least loaded rank, into that rank's least loaded
micro-batch with room. A round serves only the ranks sequential LPT would serve before the least
loaded rank gets a second segment (load within the round's largest cost of the minimum), so ranks made
heavy by long sequences or a big segment sit out until the others catch up; with even loads a round is
dp wide. A segment whose rank has no slot with room goes at once to the least loaded rank that has one
(state.place_whole_flat). Items carried into a step from the previous one are dealt first.

Steps are independent once their items are known, so their rounds run in lockstep: the block's slot
state is one (steps, dp, micro_batches) array, each step's state a view of it, and one round is the same
NumPy calls over every step still dealing (at small dp a step is ~15 rounds of a dozen calls on
dp-sized arrays, where NumPy's fixed cost per call would dominate). A block may be one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loomdata.planning._packing import Lanes
from loomdata.planning.balance._state import Dealt, Slots, place_long, place_whole_flat

__all__ = ["FlatDeal", "deal_flat", "deal_many"]


@dataclass(slots=True)
class FlatDeal:
    """A block's dealt state as flat arrays: items of every step one after the other (`off`), each step's
    short items in dealing order (`order`, global indices, `cut`) and long items (`long_idx`, `long_cut`);
    `view(i)` is step i's Dealt over views of these arrays (what the per-step phases take)."""

    cost3: np.ndarray  # (steps, dp, mb)
    room3: np.ndarray
    lane3: np.ndarray
    rank_cost: np.ndarray  # (steps, dp)
    p_rank: np.ndarray  # int64 per item, -1 while unplaced
    p_mb: np.ndarray
    length: np.ndarray  # int64 per item
    order: np.ndarray  # short items in dealing order, step after step (global indices)
    cut: np.ndarray  # (steps + 1) where each step's short items start in `order`
    off: np.ndarray  # (steps + 1) where each step's items start
    long_idx: np.ndarray  # long-lane items (global, ascending)
    long_cut: np.ndarray  # (steps + 1)

    def view(self, i: int) -> Dealt:
        """Step i's Dealt: views of the block's arrays, so what a phase places there is in the block's state."""
        a, b = int(self.off[i]), int(self.off[i + 1])
        st = Slots(self.cost3[i], self.room3[i], self.lane3[i], self.rank_cost[i])
        order = self.order[self.cut[i] : self.cut[i + 1]] - a
        long_idx = self.long_idx[self.long_cut[i] : self.long_cut[i + 1]] - a
        return Dealt(st, self.p_rank[a:b], self.p_mb[a:b], order, long_idx, self.length[a:b])


def deal_many(
    steps: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    *,
    dp: int,
    micro_batches: int,
    lanes: Lanes,
    carried: Sequence[int] | None = None,
) -> list[Dealt]:
    """Prepare and deal (LPT rounds) every step of `steps` ((length, cost, lane) each); the first
    `carried[i]` items of step i were carried in from the step before and are dealt first."""
    off = np.zeros(len(steps) + 1, dtype=np.int64)
    np.cumsum([len(s[0]) for s in steps], out=off[1:])
    fd = deal_flat(
        np.concatenate([s[0] for s in steps]),
        np.concatenate([s[1] for s in steps]),
        np.concatenate([s[2] for s in steps]),
        off,
        dp=dp,
        micro_batches=micro_batches,
        lanes=lanes,
        carried=carried,
    )
    return [fd.view(i) for i in range(len(steps))]


def deal_flat(
    length: np.ndarray,
    all_cost: np.ndarray,
    all_lane: np.ndarray,
    off: np.ndarray,
    *,
    dp: int,
    micro_batches: int,
    lanes: Lanes,
    carried: Sequence[int] | None = None,
) -> FlatDeal:
    """deal_many on a block's items laid out flat (step i's items are off[i]..off[i+1]-1): no per-step work
    except for steps with long-lane items or whose rank was full in a round."""
    b = len(off) - 1
    ns = np.diff(off)
    cost3 = np.zeros((b, dp, micro_batches))
    room3 = np.full((b, dp, micro_batches), lanes.seq_len, dtype=np.int64)
    lane3 = np.zeros((b, dp, micro_batches), dtype=np.uint8)
    rank_cost = np.zeros((b, dp))
    p_rank = np.full(int(off[-1]), -1, dtype=np.int64)
    p_mb = np.full(int(off[-1]), -1, dtype=np.int64)
    length = length.astype(np.int64)
    # each step's dealing order (short items: carried ones first, then largest cost first, ties in item
    # order), for all steps at once
    is_long = all_lane == 1
    short = (~is_long).nonzero()[0]
    step_of = np.repeat(np.arange(b), ns)[short]
    cut = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(np.bincount(step_of, minlength=b), out=cut[1:])
    by = short[_by_cost(all_cost[short], step_of, cut)]
    n_carried = np.zeros(b, dtype=np.int64) if carried is None else np.asarray(carried, dtype=np.int64)
    for c_i in np.flatnonzero(n_carried > 0).tolist():
        own = np.sort(by[cut[c_i] : cut[c_i + 1]])  # a step with carried items: those first, then largest cost
        fresh = own - off[c_i] >= n_carried[c_i]
        by[cut[c_i] : cut[c_i + 1]] = own[np.lexsort((-all_cost[own], fresh))]
    long_idx = is_long.nonzero()[0]
    long_cut = np.searchsorted(long_idx, off)
    fd = FlatDeal(cost3, room3, lane3, rank_cost, p_rank, p_mb, length, by, cut, off, long_idx, long_cut)
    for i in np.flatnonzero(np.diff(long_cut)).tolist():  # steps with long-lane items: their long sequences first
        d, a = fd.view(i), int(off[i])
        c = all_cost[a : int(off[i + 1])]
        place_long(d.long_idx, d.length, c, d.st, d.p_rank, d.p_mb, lanes, float(c.sum()))
    # the block's short items in dealing order, step after step: global item index, cost, length
    n_deal = np.diff(cut)
    start = cut
    g_item = np.concatenate([by, np.zeros(1, dtype=np.int64)])
    g_cost = np.concatenate([all_cost[by], np.zeros(1)])
    g_len = np.concatenate([length[by], np.zeros(1, dtype=np.int64)])
    lane_j = np.arange(dp)
    # (steps * dp, micro_batches) views: a (step, rank) pair is one row, so a round indexes one axis
    cost2 = cost3.reshape(b * dp, micro_batches)
    room2 = room3.reshape(b * dp, micro_batches)
    rc_flat = rank_cost.reshape(b * dp)
    act = np.flatnonzero(n_deal > 0)  # the steps still dealing, and of each: its first row, next item, items left
    act_row, at, left = act * dp, start[act], n_deal[act]
    while len(act):
        # each step's ranks least loaded first, and how many of them the round serves (k): those whose load is
        # within the round's largest cost of the minimum, i.e. searchsorted(loads, loads[0] + c0, "right")
        if len(act) == 1:  # one step dealing (a block of one, or the block's last): 1-d, slices, no gathers
            s0, a0 = int(act[0]), int(at[0])
            rc1 = rank_cost[s0]
            rk = rc1.argsort(kind="stable")
            loads1 = rc1[rk]
            k0 = min(int(left[0]), max(1, int(loads1.searchsorted(loads1[0] + g_cost[a0], side="right"))))
            k = np.array([k0])
            rk = rk[:k0]
            row = rk + s0 * dp
            ln, c, item = g_len[a0 : a0 + k0], g_cost[a0 : a0 + k0], g_item[a0 : a0 + k0]
        else:
            rc = rank_cost if len(act) == b else rank_cost[act]
            ranks = rc.argsort(axis=1, kind="stable")
            rows = ranks + act_row[:, None]
            loads = rc_flat[rows]
            within = (loads <= (loads[:, :1] + g_cost[at][:, None])).sum(axis=1)
            k = np.minimum(left, np.maximum(within, 1))  # within <= dp
            # the round's entries, step after step: each step's k next items to its k least loaded ranks
            w = int(k.max())
            valid = lane_j[None, :w] < k[:, None]
            row, rk = rows[:, :w][valid], ranks[:, :w][valid]
            gi = np.repeat(at - (np.cumsum(k) - k), k) + np.arange(len(row))
            ln, c, item = g_len[gi], g_cost[gi], g_item[gi]
        sc = np.where(room2[row] < ln[:, None], np.inf, cost2[row])
        m = sc.argmin(axis=1)
        ok = sc[np.arange(len(m)), m] < np.inf
        every = bool(ok.all())
        good = item
        if not every:
            row, m, c, ln, rk, good = row[ok], m[ok], c[ok], ln[ok], rk[ok], item[ok]
        cost2[row, m] += c
        room2[row, m] -= ln
        rc_flat[row] += c
        p_rank[good] = rk
        p_mb[good] = m
        if not every:  # their rank was full: other ranks take them, step by step
            nok = ~ok
            owner = np.repeat(act, k)[nok]
            place_whole_flat(owner, item[nok], length, all_cost, (cost3, room3, lane3, rank_cost), p_rank, p_mb)
        at += k
        left -= k
        if not left.all():
            keep = left > 0
            act, act_row, at, left = act[keep], act_row[keep], at[keep], left[keep]
    return fd


def _by_cost(cost: np.ndarray, step: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """Positions of items (grouped by `step`, ascending; step i's are cut[i]..cut[i+1]-1) ordered by step, then
    largest cost first, ties in position order: np.lexsort((-cost, step)), as row-wise sorts of a padded
    (steps, widest step) grid when the steps are alike in size (several times faster for small steps)."""
    n, b = len(cost), len(cut) - 1
    cnt = np.diff(cut)
    width = int(cnt.max(initial=0))
    if n == 0 or b * width > 2 * n + 1024:
        return np.lexsort((-cost, step))
    at = np.arange(n) - cut[step]
    grid = np.full((b, width), np.inf)
    grid[step, at] = -cost
    o = np.argsort(grid, axis=1, kind="stable") + cut[:-1, None]
    return o[np.arange(width)[None, :] < cnt[:, None]]
