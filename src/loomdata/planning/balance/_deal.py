"""LPT rounds for a block of steps at once: deal each step's short segments, largest first, in rounds.

In a round the i-th largest goes to the i-th least loaded rank, into that rank's least loaded
micro-batch with room. A round serves only the ranks sequential LPT would serve before the least
loaded rank gets a second segment (load within the round's largest cost of the minimum), so ranks made
heavy by long sequences or a big segment sit out until the others catch up; with even loads a round is
dp wide. A segment whose rank has no slot with room goes at once to the least loaded rank that has one
(_deal_kernel.place_whole_step). Items carried into a step from the previous one are dealt first.

Steps are independent once their items are known: the block's slot state is one (steps, dp, micro_batches)
array, each step's state a view of it, and the rounds run compiled (_deal_kernel.deal_rounds), one step after
the other (the NumPy rounds they replace ran in lockstep over the block's steps, with the same results: a
step's rounds touch only its own slots). The dealing order is compiled too (_deal_kernel.by_length_order:
two counting passes on lengths and steps, each step checked against its costs, sorted on them where the
lengths do not order them); the long lane stays NumPy. A block may be one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loomdata.planning._packing import Lanes
from loomdata.planning.balance._deal_kernel import by_length_order, deal_rounds
from loomdata.planning.balance._state import Dealt, Slots, place_long

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
    c64 = np.ascontiguousarray(all_cost, dtype=np.float64)
    # each step's dealing order (short items: carried ones first, then largest cost first, ties in item
    # order), for all steps at once
    is_long = all_lane == 1
    if is_long.any() or int(off[0]) != 0:
        short = (~is_long).nonzero()[0]
        step_of = np.repeat(np.arange(b), ns)[short]
        cut = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(np.bincount(step_of, minlength=b), out=cut[1:])
        by = short[by_length_order(c64[short], length[short], cut)]
    else:  # no long-lane items (the common case): every item is short, each step's from off on
        cut = np.array(off, dtype=np.int64)
        by = by_length_order(c64, length, cut)
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
    # the block's short items in dealing order, step after step (global item indices; the kernel reads their
    # cost and length there), dealt in LPT rounds step after step by the compiled kernel
    deal_rounds(
        cost3,
        room3,
        rank_cost,
        p_rank,
        p_mb,
        by,
        cut[:-1],
        np.diff(cut),
        length,
        c64,
    )
    return fd
