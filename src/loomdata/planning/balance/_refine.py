"""The balancer's local search for a block of steps at once, after their LPT rounds and leftovers.

Per step and round it moves or swaps one short segment between the most and the least loaded rank,
choosing among (at most MAX_CANDIDATES evenly spaced) segments of those two ranks the pair whose cost
difference is nearest half the gap (moving a to lo: delta c_a; swapping a and b: c_a - c_b; the best
delta is gap/2), while that lowers the maximum (at most SWAP_ROUNDS rounds; a step stops once its
ranks differ by less than TOLERANCE of the maximum). Every round does that for all steps of the block
still refining: each step's candidates are laid out in a padded (steps, |a|, 1 + |b|) grid whose
valid entries keep their order, so the first best entry is the one a step alone would pick.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.planning.balance._state import Dealt, step_max
from loomdata.planning.balance._wide import WideState, wide_search

SWAP_ROUNDS = 16
TOLERANCE = 1e-3  # stop refining once the most and least loaded ranks differ by less than this fraction
MAX_CANDIDATES = 512  # segments per rank considered by one refinement round

__all__ = ["refine_flat", "refine_many"]


def _grid(members: np.ndarray, step: np.ndarray, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Subsampled members of each step in a padded (n_steps, width) grid (-1 = none) and their counts."""
    count = np.bincount(step, minlength=n_steps)
    first = np.zeros(n_steps + 1, dtype=np.int64)
    np.cumsum(count, out=first[1:])
    at = np.arange(len(members)) - first[step]  # position within its step's members
    stride = -(-count // MAX_CANDIDATES)  # every stride-th once there are too many
    stride[count <= MAX_CANDIDATES] = 1
    keep = at % stride[step] == 0
    members, step, at = members[keep], step[keep], at[keep] // stride[step[keep]]
    n = np.bincount(step, minlength=n_steps)
    grid = np.full((n_steps, int(n.max(initial=0))), -1, dtype=np.int64)
    grid[step, at] = members
    return grid, n


def refine_many(
    dealt: Sequence[Dealt], costs: Sequence[np.ndarray], steps: Sequence[int], lanes_of: Sequence[np.ndarray]
) -> None:
    """Local search on the given steps of `dealt` (cost and lane arrays of each), all at once."""
    if not steps:
        return
    dp = dealt[steps[0]].st.cost.shape[0]
    if dp < 2:
        return
    ds = [dealt[s] for s in steps]
    ns = np.array([len(d.length) for d in ds], dtype=np.int64)
    off = np.zeros(len(ds) + 1, dtype=np.int64)
    np.cumsum(ns, out=off[1:])
    g_cost = np.concatenate([costs[s] for s in steps] + [np.zeros(1)])
    g_len = np.concatenate([d.length for d in ds] + [np.zeros(1, dtype=np.int64)])
    p_rank = np.concatenate([d.p_rank for d in ds])
    p_mb = np.concatenate([d.p_mb for d in ds])
    movable = (p_rank >= 0) & np.concatenate([lanes_of[s] != 1 for s in steps])
    step_of = np.repeat(np.arange(len(ds)), ns)
    cost3 = np.stack([d.st.cost for d in ds])
    room3 = np.stack([d.st.room for d in ds])
    lane3 = np.stack([d.st.lane for d in ds])
    rc = np.stack([d.st.rank_cost for d in ds])
    refine_flat(cost3, room3, lane3, rc, p_rank, p_mb, g_cost, g_len, movable, step_of)
    for k, d in enumerate(ds):
        d.st.cost[...] = cost3[k]
        d.st.room[...] = room3[k]
        d.st.rank_cost[...] = rc[k]
        d.p_rank[...] = p_rank[off[k] : off[k + 1]]
        d.p_mb[...] = p_mb[off[k] : off[k + 1]]


def refine_flat(
    cost3: np.ndarray,
    room3: np.ndarray,
    lane3: np.ndarray,
    rc: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    g_cost: np.ndarray,
    g_len: np.ndarray,
    movable: np.ndarray,
    step_of: np.ndarray,
) -> None:
    """refine_many on a block's flat state ((steps, dp, mb) slots, per-item placement, item costs and lengths
    with a dummy 0 appended, which items may move, each item's step), updated in place."""
    n_steps, dp = rc.shape
    if dp < 2 or n_steps == 0:
        return
    dummy = len(g_cost) - 1
    # (step, rank) of every movable item as one key (non-movable: a key no round asks for), so a round finds
    # the members of each step's most and least loaded rank with one gather over the block's items
    n_keys = n_steps * dp
    key = np.where(movable, step_of * dp + p_rank, n_keys)
    act = np.arange(n_steps)
    for _ in range(SWAP_ROUNDS):
        if len(act) == 0:
            break
        hi = rc[act].argmax(axis=1)
        lo = rc[act].argmin(axis=1)
        gap = rc[act, hi] - rc[act, lo]
        go = ~(gap <= TOLERANCE * rc[act, hi])
        act, hi, lo, gap = act[go], hi[go], lo[go], gap[go]
        if len(act) == 0:
            break
        na = len(act)
        slot = np.full(n_steps, -1, dtype=np.int64)
        slot[act] = np.arange(na)
        tag = np.zeros(n_keys + 1, dtype=np.int8)
        tag[act * dp + hi] = 1
        tag[act * dp + lo] = 2
        t_item = tag[key]
        ia = np.flatnonzero(t_item == 1)
        ib = np.flatnonzero(t_item == 2)
        a, n_a = _grid(ia, slot[step_of[ia]], na)
        b, _ = _grid(ib, slot[step_of[ib]], na)
        if a.shape[1] == 0:  # no step has a movable segment on its most loaded rank
            break
        has_a = n_a > 0
        a_ok = a >= 0
        a_i = np.where(a_ok, a, dummy)
        b_i = np.where(b >= 0, b, dummy)
        ca = g_cost[a_i]
        cb = np.concatenate([np.zeros((na, 1)), g_cost[b_i]], axis=1)
        la = g_len[a_i]
        lb = np.concatenate([np.zeros((na, 1), dtype=np.int64), g_len[b_i]], axis=1)
        ma = np.where(a_ok, p_mb[np.maximum(a, 0)], 0)
        lo_room = room3[act, lo]  # (na, mb)
        lo_lane = lane3[act, lo]
        roomiest = np.where(lo_lane == 0, lo_room, -1).argmax(axis=1)
        mb_b = np.concatenate([roomiest[:, None], np.where(b >= 0, p_mb[np.maximum(b, 0)], 0)], axis=1)
        rows = np.arange(na)[:, None]
        # an invalid candidate (padding, or b in a long-lane slot) gets room -1, which no length (>= 0) fits:
        # the room tests then also say which pairs exist (fewer passes over the (na, |a|, 1 + |b|) grid)
        b_ok = np.concatenate([np.ones((na, 1), dtype=bool), b >= 0], axis=1) & (lo_lane[rows, mb_b] == 0)
        room_lo = np.where(b_ok, lo_room[rows, mb_b] + lb, -1)
        room_hi = np.where(a_ok, room3[act[:, None], hi[:, None], ma] + la, -1)
        delta = ca[:, :, None] - cb[:, None, :]
        bad = delta <= 0
        bad |= delta >= gap[:, None, None]
        bad |= la[:, :, None] > room_lo[:, None, :]
        bad |= lb[:, None, :] > room_hi[:, :, None]
        score = delta  # reused in place: delta is recomputed below for the chosen pairs only
        score -= gap[:, None, None] / 2
        np.abs(score, out=score)
        np.copyto(score, np.inf, where=bad)
        best = score.reshape(na, -1).argmin(axis=1)
        any_ok = score.reshape(na, -1)[np.arange(na), best] < np.inf
        go = has_a & any_ok
        i, j = np.divmod(best, score.shape[2])
        r = np.flatnonzero(go)
        s_, h_, l_, i_, j_ = act[r], hi[r], lo[r], i[r], j[r]
        item_a = a[r, i_]
        ma_i = ma[r, i_]
        mbj = mb_b[r, j_]
        c_a, l_a = ca[r, i_], la[r, i_]
        cost3[s_, h_, ma_i] -= c_a
        room3[s_, h_, ma_i] += l_a
        cost3[s_, l_, mbj] += c_a
        room3[s_, l_, mbj] -= l_a
        p_rank[item_a], p_mb[item_a] = l_, mbj
        key[item_a] = s_ * dp + l_
        sw = j_ > 0
        if sw.any():
            rs = r[sw]
            item_b = b[rs, j_[sw] - 1]
            c_b, l_b = cb[rs, j_[sw]], lb[rs, j_[sw]]
            cost3[s_[sw], l_[sw], mbj[sw]] -= c_b
            room3[s_[sw], l_[sw], mbj[sw]] += l_b
            cost3[s_[sw], h_[sw], ma_i[sw]] += c_b
            room3[s_[sw], h_[sw], ma_i[sw]] -= l_b
            p_rank[item_b], p_mb[item_b] = h_[sw], ma_i[sw]
            key[item_b] = s_[sw] * dp + h_[sw]
        dl = ca[r, i_] - cb[r, j_]
        rc[s_, h_] -= dl
        rc[s_, l_] += dl
        act = s_
    top = step_max(g_cost[:-1][p_rank >= 0], step_of[p_rank >= 0], n_steps)
    lb = np.maximum(rc.sum(axis=1) / dp, top)
    wide_search(WideState(cost3, room3, rc, p_rank, p_mb, key, g_cost, g_len, step_of, lb), dp)
