"""The balancer's wide local search: after the pairwise rounds (_refine), look past the lightest rank.

A round works on units: a step's most loaded rank h with its partner ranks (all other ranks at small
dp; at large dp the WIDE_PARTNERS least and next most loaded, or, when many ranks are over the
threshold, several units per step on disjoint ranks, so that a round fixes many ranks at once). A unit
moves one of h's short segments a to a partner's roomiest micro-batch, swaps it for one segment b of a
partner, or (only where neither helps) trades it for the j <= EXCHANGE_MAX cheapest segments of one
partner micro-batch: one long document for several short ones, where the lightest rank is full. It
takes the candidate that leaves the pair (h, partner) with the smallest maximum, if that is below h's
load (a move that brings h under the threshold is taken without looking at swaps), so a step's maximum
never rises. A step stops when its maximum is within WIDE_TOLERANCE of its lower bound
max(total / dp, largest segment) (then within 0.1% of its optimum), when no unit improves, when
WIDE_STALL rounds lowered its maximum by less than WIDE_MIN_GAIN, or after WIDE_ROUNDS rounds. All
units run compiled (_wide_kernel), step after step, unit after unit (a step's units share no rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning.balance._wide_kernel import wide_rounds

__all__ = ["WideState", "wide_search"]

WIDE_ROUNDS = 24
WIDE_TOLERANCE = 1e-3  # a step within this fraction of its lower bound is done (then within 0.1% of its optimum)
WIDE_MIN_GAIN = 2e-5  # a round lowering a step's maximum by less than this fraction is no real gain
WIDE_STALL = 4  # a step stops after this many rounds without a real gain
WIDE_PARTNERS = 4  # partner ranks at each end of the load order for a lone unit (all ranks at dp <= 2x this + 1)
WIDE_CANDIDATES = 16  # segments of the most loaded rank considered per round
PARTNER_CANDIDATES = 64  # segments of the partner ranks considered per round (swaps)
MULTI_PARTNERS = 2  # partner ranks of each unit when a step runs several units in a round
MULTI_CANDIDATES = 16  # segments of those partners considered per round (swaps)
EXCHANGE_MAX = 6  # at most this many cheapest segments of one partner micro-batch for one of h's


@dataclass(slots=True)
class WideState:
    """A block's flattened search state, shared with _refine (views, updated in place)."""

    cost3: np.ndarray  # (steps, dp, mb) slot cost
    room3: np.ndarray  # (steps, dp, mb) free tokens (0 in long slots)
    rc: np.ndarray  # (steps, dp) rank cost
    p_rank: np.ndarray  # rank of every item of the block (-1: unplaced)
    p_mb: np.ndarray
    key: np.ndarray  # step * dp + rank of every movable item, steps * dp for the others
    g_cost: np.ndarray  # item costs, plus a dummy 0 at the end
    g_len: np.ndarray  # item lengths, plus a dummy 0 at the end
    step_of: np.ndarray  # step of every item
    lb: np.ndarray  # (steps,) lower bound


def wide_search(w: WideState, dp: int, off: np.ndarray | None = None) -> None:
    """Run the wide search on every step of the block (see the module docstring), updating `w` in place: the
    compiled rounds (_wide_kernel), step after step (`off`: where each step's items start, when the caller has
    it; else found from w.step_of)."""
    n_steps = w.cost3.shape[0]
    if dp < 2 or n_steps == 0:
        return
    ints = np.array(
        [
            WIDE_ROUNDS,
            WIDE_STALL,
            WIDE_PARTNERS,
            WIDE_CANDIDATES,
            PARTNER_CANDIDATES,
            MULTI_PARTNERS,
            MULTI_CANDIDATES,
            EXCHANGE_MAX,
        ],
        dtype=np.int64,
    )
    wide_rounds(
        w.cost3,
        w.room3,
        w.rc,
        w.p_rank,
        w.p_mb,
        w.key,
        np.ascontiguousarray(w.g_cost, dtype=np.float64),
        np.ascontiguousarray(w.g_len, dtype=np.int64),
        np.searchsorted(w.step_of, np.arange(n_steps + 1)) if off is None else off,
        np.ascontiguousarray(w.lb, dtype=np.float64),
        ints,
        np.array([WIDE_TOLERANCE, WIDE_MIN_GAIN]),
    )
