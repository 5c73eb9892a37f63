"""The balancer's local search for a block of steps at once, after their LPT rounds and leftovers.

Per step and round it moves or swaps one short segment between the most and the least loaded rank,
choosing among (at most MAX_CANDIDATES evenly spaced) segments of those two ranks the pair whose cost
difference is nearest half the gap (moving a to lo: delta c_a; swapping a and b: c_a - c_b; the best
delta is gap/2), while that lowers the maximum (at most SWAP_ROUNDS rounds; a step stops once its
ranks differ by less than TOLERANCE of the maximum). The rounds run compiled (_refine_kernel.refine_rounds),
step after step over the block's flat state, trying pairs in (a, b) order: the first best pair is taken.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.planning.balance._refine_kernel import refine_rounds, search_setup
from loomdata.planning.balance._state import Dealt
from loomdata.planning.balance._wide import WideState, wide_search

SWAP_ROUNDS = 16
TOLERANCE = 1e-3  # stop refining once the most and least loaded ranks differ by less than this fraction
MAX_CANDIDATES = 512  # segments per rank considered by one refinement round

__all__ = ["refine_flat", "refine_many"]


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
    # (step, rank) of every movable item as one key (non-movable: a key no round asks for); the compiled rounds
    # (_refine_kernel) then refine each step's items (contiguous: step_of ascending) in turn
    g_cost = np.ascontiguousarray(g_cost, dtype=np.float64)
    key, off, top = search_setup(movable, step_of, p_rank, g_cost, n_steps, dp)  # one pass; also the wide search's
    refine_rounds(
        cost3,
        room3,
        lane3,
        rc,
        p_rank,
        p_mb,
        g_cost,
        g_len.astype(np.int64, copy=False),
        key,
        off,
        SWAP_ROUNDS,
        TOLERANCE,
        MAX_CANDIDATES,
    )
    lb = np.maximum(rc.sum(axis=1) / dp, top)
    wide_search(WideState(cost3, room3, rc, p_rank, p_mb, key, g_cost, g_len, step_of, lb), dp, off)
