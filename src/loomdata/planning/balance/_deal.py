"""LPT rounds for a block of steps at once: deal each step's short segments, largest first, in rounds.

In a round the i-th largest goes to the i-th least loaded rank, into that rank's least loaded
micro-batch with room. A round serves only the ranks sequential LPT would serve before the least
loaded rank gets a second segment (load within the round's largest cost of the minimum), so ranks made
heavy by long sequences or a big segment sit out until the others catch up; with even loads a round is
dp wide. A segment whose rank has no slot with room goes at once to the least loaded rank that has one
(state.place_whole_many). Items carried into a step from the previous one are dealt first.

Steps are independent once their items are known, so their rounds run in lockstep: the block's slot
state is one (steps, dp, micro_batches) array, each step's state a view of it, and one round is the same
NumPy calls over every step still dealing (at small dp a step is ~15 rounds of a dozen calls on
dp-sized arrays, where NumPy's fixed cost per call would dominate). A block may be one step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.planning._packing import Lanes
from loomdata.planning.balance._state import Dealt, Slots, place_whole_many, prepare

__all__ = ["deal_many"]


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
    b = len(steps)
    ns = np.array([len(s[0]) for s in steps], dtype=np.int64)
    off = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ns, out=off[1:])
    cost3 = np.zeros((b, dp, micro_batches))
    room3 = np.full((b, dp, micro_batches), lanes.seq_len, dtype=np.int64)
    lane3 = np.zeros((b, dp, micro_batches), dtype=np.uint8)
    rank_cost = np.zeros((b, dp))
    p_rank = np.full(int(off[-1]), -1, dtype=np.int64)
    p_mb = np.full(int(off[-1]), -1, dtype=np.int64)
    # each step's dealing order (short items: carried ones first, then largest cost first, ties in item
    # order), for all steps at once
    all_cost = np.concatenate([s[1] for s in steps])
    short = (np.concatenate([s[2] for s in steps]) != 1).nonzero()[0]
    step_of = np.repeat(np.arange(b), ns)[short]
    if carried is not None and any(carried):
        fresh = short - off[step_of] >= np.asarray(carried, dtype=np.int64)[step_of]
        by = short[np.lexsort((-all_cost[short], fresh, step_of))]
    else:
        by = short[np.lexsort((-all_cost[short], step_of))]
    cut = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(np.bincount(step_of, minlength=b), out=cut[1:])
    dealt = [
        prepare(
            length,
            cost,
            lane,
            Slots(cost3[i], room3[i], lane3[i], rank_cost[i]),
            p_rank[off[i] : off[i + 1]],
            p_mb[off[i] : off[i + 1]],
            by[cut[i] : cut[i + 1]] - off[i],
            lanes,
        )
        for i, (length, cost, lane) in enumerate(steps)
    ]
    # the block's short items in dealing order, step after step: global item index, cost, length
    n_deal = np.array([len(d.order) for d in dealt], dtype=np.int64)
    start = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(n_deal, out=start[1:])
    g_item = np.concatenate([d.order + off[i] for i, d in enumerate(dealt)] + [np.zeros(1, dtype=np.int64)])
    g_cost = np.concatenate([steps[i][1][d.order] for i, d in enumerate(dealt)] + [np.zeros(1)])
    g_len = np.concatenate([d.length[d.order] for d in dealt] + [np.zeros(1, dtype=np.int64)])
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
        sc = cost2[row]
        sc[room2[row] < ln[:, None]] = np.inf
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
            if len(act) == 1:
                _place_failed(dealt[s0], item[nok] - off[s0], steps[s0][1])
            else:
                owner, failed = np.repeat(act, k)[nok], item[nok]
                for s in owner[np.flatnonzero(np.diff(owner, prepend=-1))]:
                    _place_failed(dealt[s], failed[owner == s] - off[s], steps[s][1])
        at += k
        left -= k
        if not left.all():
            keep = left > 0
            act, act_row, at, left = act[keep], act_row[keep], at[keep], left[keep]
    return dealt


def _place_failed(d: Dealt, items: np.ndarray, cost: np.ndarray) -> None:
    """Items of step `d` whose rank had no slot with room this round: the least loaded ranks with room take them."""
    place_whole_many(items, d.length, cost, d.st, d.p_rank, d.p_mb)
