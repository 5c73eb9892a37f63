"""Compiled leftovers of text-only steps (_leftovers' common case), every leftover step of a block in one call.

Where no item of a block has image tokens, every leftover is splittable and no eviction happens: each step's
leftovers, in dealing order, go whole into the least loaded rank with room (state.place_whole, the deal
kernel's _place_whole), else split over the slots with most room (stable order of room, largest first), a
piece's cost `(attention * L * L + linear * L) / cp` as CostSpec.of prices it; what finds no room is deferred.
The same decisions and float operations as place_leftovers step by step (which stays the path for blocks
with image samples), without a dozen NumPy calls per item. The steps run in order and the call ends after
the first step that defers (the block ends there: balance_span).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit
from loomdata.planning.balance._deal_kernel import _place_whole

__all__ = ["text_leftovers"]


@njit
def _grown(a: np.ndarray, n: int) -> np.ndarray:
    """`a` with room for at least n rows (doubling; the first rows kept)."""
    if n <= len(a):
        return a
    out = np.empty((max(n, 2 * len(a)), a.shape[1]), dtype=a.dtype)
    out[: len(a)] = a
    return out


@njit
def text_leftovers(
    cost3: np.ndarray,
    room3: np.ndarray,
    rank_cost: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    order: np.ndarray,
    cut: np.ndarray,
    steps: np.ndarray,
    attention: float,
    linear: float,
    cp: float,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Place the leftovers (items of `order[cut[s]:cut[s+1]]` still unplaced, global indices) of each step s of
    `steps` (ascending) into the block's (steps, dp, mb) slot state. Returns the split pieces (step, item,
    offset delta, length, rank, micro-batch) and the deferred rests (step, item, offset delta, tokens), each in
    placement order, and how many of `steps` were done (all, or up to and with the first that defers)."""
    mb = cost3.shape[2]
    pieces = np.empty((64, 6), dtype=np.int64)
    deferred = np.empty((4, 4), dtype=np.int64)
    n_p, n_d = 0, 0
    for k in range(len(steps)):
        s = steps[k]
        for j in range(cut[s], cut[s + 1]):
            i = order[j]
            if p_rank[i] >= 0:
                continue
            if _place_whole(s, i, length, cost, cost3, room3, rank_cost, p_rank, p_mb):
                continue
            need = length[i]
            flat = np.argsort(-room3[s].ravel(), kind="mergesort")  # slots by room, largest first, stable
            done = 0
            for q in range(len(flat)):
                r, m = flat[q] // mb, flat[q] % mb
                take = min(room3[s, r, m], need - done)
                if take <= 0:
                    break
                x = float(take)
                c = (attention * x * x + linear * x) / cp
                cost3[s, r, m] += c
                room3[s, r, m] -= take
                rank_cost[s, r] += c
                pieces = _grown(pieces, n_p + 1)
                pieces[n_p, 0] = s
                pieces[n_p, 1] = i
                pieces[n_p, 2] = done
                pieces[n_p, 3] = take
                pieces[n_p, 4] = r
                pieces[n_p, 5] = m
                n_p += 1
                done += take
                if done == need:
                    break
            if done < need:
                deferred = _grown(deferred, n_d + 1)
                deferred[n_d, 0] = s
                deferred[n_d, 1] = i
                deferred[n_d, 2] = done
                deferred[n_d, 3] = need - done
                n_d += 1
        if n_d:
            return pieces[:n_p].copy(), deferred[:n_d].copy(), k + 1
    return pieces[:n_p].copy(), deferred[:n_d].copy(), len(steps)
