"""Leftovers: the segments no slot could take whole when their LPT turn came, placed one step at a time.

Whole if room appeared, else text is split over the slots with most room (rare: a few per cent of steps
at small dp); an image sample is never split: text is moved out of a slot to make room, and if no slot
can (every slot full of image samples) it is deferred to the next step, where it goes first.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._cost import segment_cost
from loomdata.planning._packing import Lanes
from loomdata.planning.balance._state import Slots, place_whole
from loomdata.schemas.spec import CostSpec

__all__ = ["place_leftovers"]


def _evict_for(
    need: int,
    length: np.ndarray,
    cost: np.ndarray,
    splittable: np.ndarray,
    st: Slots,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
) -> list[int] | None:
    """Make room for an unsplittable item in the roomiest short slot that can free enough by moving text out.

    Returns the text segments moved out (to be placed again), or None when no slot can make room.
    """
    dp, mb = st.room.shape
    movable = (p_rank >= 0) & splittable
    slot_of = p_rank[movable] * mb + p_mb[movable]
    freeable = np.bincount(slot_of, weights=length[movable], minlength=dp * mb).reshape(dp, mb) + st.room
    room = np.where((st.lane == 0) & (freeable >= need), st.room, -1)
    if room.max() < 0:
        return None
    r, m = divmod(int(np.argmax(room)), mb)
    members = np.flatnonzero((p_rank == r) & (p_mb == m) & splittable)
    members = members[np.argsort(-length[members], kind="stable")]
    freed = int(st.room[r, m]) + np.cumsum(length[members])
    k = int(np.searchsorted(freed, need)) + 1
    out = members[:k]
    st.cost[r, m] -= cost[out].sum()
    st.rank_cost[r] -= cost[out].sum()
    st.room[r, m] += int(length[out].sum())
    p_rank[out] = -1
    p_mb[out] = -1
    return [int(x) for x in out]


def place_leftovers(
    left: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    splittable: np.ndarray,
    st: Slots,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    lanes: Lanes,
    cost_spec: CostSpec,
) -> tuple[np.ndarray, ...]:
    """Place segments no slot could take whole when their turn came: whole if room appeared, else split.

    An image sample is never split: text segments are moved out of a slot to make room for it and
    placed again (whole, or split over the slots with most room); when no slot can make room (every
    slot already full of image samples) it is deferred to the next step, as is text for which the step
    has no room left at all (possible only after the previous step deferred some). Returns the split
    pieces (item, offset delta, length, rank, micro-batch) and the deferred (item, offset delta, length).
    """
    pieces: list[tuple[int, int, int, int, int]] = []
    deferred: list[tuple[int, int, int]] = []
    mb = st.cost.shape[1]
    queue = [int(i) for i in left[np.argsort(splittable[left], kind="stable")]]  # image samples first
    while queue:
        i = queue.pop(0)
        if place_whole(i, length, cost, st, p_rank, p_mb):
            continue
        need = int(length[i])
        if not splittable[i]:
            moved = _evict_for(need, length, cost, splittable, st, p_rank, p_mb)
            if moved is None:
                deferred.append((i, 0, need))
            else:
                queue.extend(moved)
                place_whole(i, length, cost, st, p_rank, p_mb)
            continue
        flat = np.argsort(-st.room.ravel(), kind="stable")
        done = 0
        for s in flat:
            r, m = divmod(int(s), mb)
            take = min(int(st.room[r, m]), need - done)
            if take <= 0:
                break
            c = float(segment_cost(np.array([take]), None, cost_spec, lanes.short_cp)[0])
            st.cost[r, m] += c
            st.room[r, m] -= take
            st.rank_cost[r] += c
            pieces.append((i, done, take, r, m))
            done += take
            if done == need:
                break
        if done < need:
            deferred.append((i, done, need - done))
    a = np.array(pieces, dtype=np.int64).reshape(-1, 5)
    return a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], np.array(deferred, dtype=np.int64).reshape(-1, 3)
