"""The balancer's LPT rounds (see _balance) for a block of independent steps at once.

At small dp a step is ~15 rounds of a dozen NumPy calls on dp-sized arrays, so the fixed cost per call
dominates. Steps that carry nothing in are independent, so their rounds run in lockstep: the slot
state of the block is one (steps, dp, micro_batches) array, each step's state a view of it, and one
round is the same NumPy calls over every step still dealing. Per step it computes exactly what
_balance._lpt_rounds computes (same order, same comparisons, the same float additions in the same
order), so the plans are the same bytes; a step whose round has items no slot of their rank can take
hands them to _balance._place_whole_many, as a single step does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.planning._balance import Dealt, _place_whole_many, _Slots, prepare_step
from loomdata.planning._packing import Lanes

__all__ = ["deal_many"]


def deal_many(
    steps: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], *, dp: int, micro_batches: int, lanes: Lanes
) -> list[Dealt]:
    """Prepare and deal (LPT rounds) every step of `steps` ((length, cost, lane) each, nothing carried in)."""
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
    # each step's dealing order (short items, largest cost first, ties in item order), for all steps at once
    all_cost = np.concatenate([s[1] for s in steps])
    short = (np.concatenate([s[2] for s in steps]) != 1).nonzero()[0]
    step_of = np.repeat(np.arange(b), ns)[short]
    by = short[np.lexsort((-all_cost[short], step_of))]
    cut = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(np.bincount(step_of, minlength=b), out=cut[1:])
    dealt = [
        prepare_step(
            length,
            cost,
            lane,
            dp=dp,
            micro_batches=micro_batches,
            lanes=lanes,
            views=(
                _Slots(cost3[i], room3[i], lane3[i], rank_cost[i]),
                p_rank[off[i] : off[i + 1]],
                p_mb[off[i] : off[i + 1]],
            ),
            order=by[cut[i] : cut[i + 1]] - off[i],
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
        valid = lane_j[None, :] < k[:, None]
        gi = np.where(valid, at[:, None] + lane_j[None, :], len(g_item) - 1)
        ln, c, item = g_len[gi], g_cost[gi], g_item[gi]
        rows = np.broadcast_to(act[:, None], ranks.shape)
        sc = cost3[rows, ranks]
        sc[room3[rows, ranks] < ln[:, :, None]] = np.inf
        m = sc.argmin(axis=2)
        ok = sc.min(axis=2) < np.inf
        put = valid & ok
        r_, k_, m_ = rows[put], ranks[put], m[put]
        cost3[r_, k_, m_] += c[put]
        room3[r_, k_, m_] -= ln[put]
        rank_cost[r_, k_] += c[put]
        p_rank[item[put]] = k_
        p_mb[item[put]] = m_
        pos[act] += k
        failed = valid & ~ok
        for i in np.flatnonzero(failed.any(axis=1)):  # their rank was full: other ranks take them (rare)
            s = int(act[i])
            d = dealt[s]
            _place_whole_many(item[i][failed[i]] - off[s], d.length, steps[s][1], d.st, d.p_rank, d.p_mb)
    return dealt
