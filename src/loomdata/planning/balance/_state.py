"""The balancer's per-step slot state and the placements every phase shares (commit, place whole, long lane)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning._packing import Lanes, next_fit
from loomdata.schemas.errors import PlanError

__all__ = [
    "Assignment",
    "Dealt",
    "Slots",
    "commit",
    "members",
    "place_long",
    "place_whole",
    "step_max",
]


@dataclass(frozen=True, slots=True)
class Assignment:
    """Placed pieces of a step's items, in manifest order (rank, micro-batch, placement order)."""

    item: np.ndarray  # int64 index into the step's items
    delta: np.ndarray  # int64 tokens into the item where the piece starts (0 unless split)
    length: np.ndarray  # int64 tokens of the piece
    rank: np.ndarray  # int64
    micro_batch: np.ndarray  # int64
    lane: np.ndarray  # uint8
    rank_cost: np.ndarray  # float64 [dp]
    slot_cost: np.ndarray  # float64 [dp, micro_batches]
    # int64 [n, 3] (item, offset delta, tokens) the step had no room for; the next step takes them first
    deferred: np.ndarray


@dataclass(slots=True)
class Slots:
    """Mutable slot state of one step (often views of a block's (steps, dp, micro_batches) arrays)."""

    cost: np.ndarray  # [dp, mb]
    room: np.ndarray  # [dp, mb] free tokens (0 for long slots)
    lane: np.ndarray  # [dp, mb]
    rank_cost: np.ndarray  # [dp]


@dataclass(slots=True)
class Dealt:
    """A step after long-lane placement and the LPT rounds: slot state, placements and the dealing order."""

    st: Slots
    p_rank: np.ndarray  # int64 rank of each item, -1 while unplaced
    p_mb: np.ndarray  # int64 micro-batch of each item, -1 while unplaced
    order: np.ndarray  # short items in dealing order
    long_idx: np.ndarray  # long-lane items
    length: np.ndarray  # int64


def members(x: np.ndarray, n: int) -> np.ndarray:
    """np.unique(x) of indices x in [0, n), by a mask (NumPy 2's hashing unique takes ~0.4 ms on small arrays)."""
    seen = np.zeros(n, dtype=bool)
    seen[x] = True
    return np.flatnonzero(seen)


def place_long(
    idx: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    st: Slots,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    lanes: Lanes,
    total_cost: float,
) -> None:
    """Pack long-lane segments into long sequences (next-fit decreasing) and give each sequence a whole
    free slot: in rounds, the largest sequences to the least loaded ranks that still have a free slot."""
    cap = int(lanes.long_seq_len or 0)
    by_len = np.argsort(-length[idx], kind="stable")
    bins = np.empty(len(idx), dtype=np.int64)
    bins[by_len] = next_fit(length[idx][by_len], cap)
    dp, mb = st.cost.shape
    # a long sequence heavier than half a rank's fair share is unpacked: one document per sequence
    # (membership left a slot for every long segment, and padding costs nothing)
    heavy_cap = max(total_cost / dp / 2, float(cost[idx].max()))
    heavy = np.bincount(bins, weights=cost[idx])[bins] > heavy_cap
    if heavy.any():
        bins[heavy] = bins.max() + 1 + np.arange(int(heavy.sum()))
        _, bins = np.unique(bins, return_inverse=True)
    n_bins = int(bins.max()) + 1
    bin_cost = np.bincount(bins, weights=cost[idx], minlength=n_bins)
    if n_bins > dp * mb:
        raise PlanError(f"a step needs {n_bins} long sequences but has only {dp * mb} slots; raise micro_batches")
    bin_rank = np.empty(n_bins, dtype=np.int64)
    bin_mb = np.empty(n_bins, dtype=np.int64)
    todo = np.argsort(-bin_cost, kind="stable")
    while len(todo):
        free = (st.lane == 0) & (st.room == lanes.seq_len)
        open_ranks = np.flatnonzero(free.any(axis=1))
        ranks = open_ranks[np.argsort(st.rank_cost[open_ranks], kind="stable")][: len(todo)]
        now, todo = todo[: len(ranks)], todo[len(ranks) :]
        m = free[ranks].argmax(axis=1)
        st.lane[ranks, m] = 1
        st.room[ranks, m] = 0
        st.cost[ranks, m] += bin_cost[now]
        st.rank_cost[ranks] += bin_cost[now]
        bin_rank[now] = ranks
        bin_mb[now] = m
    p_rank[idx] = bin_rank[bins]
    p_mb[idx] = bin_mb[bins]


def commit(
    st: Slots,
    items: np.ndarray,
    ranks: np.ndarray,
    mbs: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
) -> None:
    """Record placements of `items` (each (rank, micro-batch) pair at most once): costs, room, and where."""
    st.cost[ranks, mbs] += cost
    st.room[ranks, mbs] -= length
    st.rank_cost[ranks] += cost
    p_rank[items] = ranks
    p_mb[items] = mbs


def place_whole(i: int, length: np.ndarray, cost: np.ndarray, st: Slots, p_rank: np.ndarray, p_mb: np.ndarray) -> bool:
    """Put item i whole into the least loaded rank that has a slot with room (its least loaded such slot)."""
    need = int(length[i])
    fits = st.room >= need
    has = fits.any(axis=1)
    if not has.any():
        return False
    r = int(np.argmin(np.where(has, st.rank_cost, np.inf)))
    m = int(np.argmin(np.where(fits[r], st.cost[r], np.inf)))
    commit(st, np.array([i]), np.array([r]), np.array([m]), np.array([need]), cost[[i]], p_rank, p_mb)
    return True


def step_max(values: np.ndarray, step: np.ndarray, n_steps: int) -> np.ndarray:
    """Per step, the largest of `values` (grouped by `step`, ascending) and 0 (np.maximum.at on zeros, without
    its slow unbuffered loop: one reduceat over the steps that have values)."""
    top = np.zeros(n_steps)
    if len(values) == 0:
        return top
    starts = np.searchsorted(step, np.arange(n_steps))
    has = starts < np.append(starts[1:], len(step))
    top[has] = np.maximum(0.0, np.maximum.reduceat(values, starts[has]))
    return top
