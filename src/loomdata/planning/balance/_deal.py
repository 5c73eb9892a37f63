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
    pos = np.zeros(b, dtype=np.int64)
    lane_j = np.arange(dp)
    # (steps * dp, micro_batches) views: a (step, rank) pair is one row, so a round indexes one axis
    cost2 = cost3.reshape(b * dp, micro_batches)
    room2 = room3.reshape(b * dp, micro_batches)
    rc_flat = rank_cost.reshape(b * dp)
    while True:
        act = np.flatnonzero(pos < n_deal)
        if len(act) == 0:
            break
        rc = rank_cost[act]
        ranks = rc.argsort(axis=1, kind="stable")
        loads = np.take_along_axis(rc, ranks, axis=1)
        at = start[act] + pos[act]
        # searchsorted(loads, loads[0] + c0, side="right") on each sorted row: how many loads are <= it
        within = (loads <= (loads[:, 0] + g_cost[at])[:, None]).sum(axis=1)
        k = np.minimum(np.minimum(dp, n_deal[act] - pos[act]), np.maximum(1, within))
        # the round's entries, step after step, each step's k least loaded ranks in order (flat: no padding)
        w = int(k.max())
        valid = lane_j[None, :w] < k[:, None]
        rk = ranks[:, :w][valid]
        first = np.cumsum(k) - k
        j = np.arange(len(rk)) - np.repeat(first, k)  # position within its step's round
        gi = np.repeat(at, k) + j
        ln, c, item = g_len[gi], g_cost[gi], g_item[gi]
        row = np.repeat(act * dp, k) + rk
        sc = cost2[row]
        sc[room2[row] < ln[:, None]] = np.inf
        m = sc.argmin(axis=1)
        ok = sc[np.arange(len(m)), m] < np.inf
        if ok.all():
            r_, m_, c_, it, ln_ok, rk_ok = row, m, c, item, ln, rk
        else:
            r_, m_, c_, it, ln_ok, rk_ok = row[ok], m[ok], c[ok], item[ok], ln[ok], rk[ok]
        cost2[r_, m_] += c_
        room2[r_, m_] -= ln_ok
        rc_flat[r_] += c_
        p_rank[it] = rk_ok
        p_mb[it] = m_
        pos[act] += k
        if not ok.all():  # their rank was full: other ranks take them (rare)
            bad = np.flatnonzero(~ok)
            for i in np.unique(np.repeat(np.arange(len(act)), k)[bad]):
                s = int(act[i])
                d = dealt[s]
                mine = bad[(bad >= first[i]) & (bad < first[i] + k[i])]
                place_whole_many(item[mine] - off[s], d.length, steps[s][1], d.st, d.p_rank, d.p_mb)
    return dealt
