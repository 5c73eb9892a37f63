"""The wide local search (planning.balance._wide) on hand-made steps the pairwise search cannot improve."""

from __future__ import annotations

import numpy as np

from loomdata.planning.balance._wide import WideState, wide_search


def _state(ranks: list[list[int]], seq_len: int) -> WideState:
    """One step, one micro-batch per rank, cost = length**2; rank r holds the segments ranks[r]."""
    dp = len(ranks)
    length = np.array([x for r in ranks for x in r], dtype=np.int64)
    rank = np.array([k for k, r in enumerate(ranks) for _ in r], dtype=np.int64)
    cost = length.astype(np.float64) ** 2
    rc = np.bincount(rank, weights=cost, minlength=dp)
    room = seq_len - np.bincount(rank, weights=length, minlength=dp).astype(np.int64)
    return WideState(
        cost3=rc.reshape(1, dp, 1).copy(),
        room3=room.reshape(1, dp, 1).copy(),
        rc=rc.reshape(1, dp).copy(),
        p_rank=rank.copy(),
        p_mb=np.zeros(len(length), dtype=np.int64),
        key=rank.copy(),
        g_cost=np.append(cost, 0.0),
        g_len=np.append(length, 0),
        step_of=np.zeros(len(length), dtype=np.int64),
        lb=np.array([max(cost.sum() / dp, cost.max())]),
    )


def _check(w: WideState, seq_len: int) -> None:
    """Placements, slot costs, room and rank costs agree and no slot overflows."""
    dp = w.rc.shape[1]
    cost = np.bincount(w.p_rank, weights=w.g_cost[:-1], minlength=dp)
    tokens = np.bincount(w.p_rank, weights=w.g_len[:-1], minlength=dp)
    assert np.allclose(cost, w.rc[0]) and np.allclose(cost, w.cost3[0, :, 0])
    assert np.array_equal(seq_len - tokens, w.room3[0, :, 0]) and (tokens <= seq_len).all()
    assert np.array_equal(w.key, w.p_rank)


def test_a_full_lightest_rank_no_longer_blocks_the_heaviest() -> None:
    # rank 0 is heaviest; the lightest (rank 1) is full of small segments, so heaviest-lightest moves and
    # swaps are blocked by room; rank 2 has room, and rank 1's small segments can replace rank 0's 30
    w = _state([[50, 30], [10] * 10, [45, 20]], seq_len=100)
    before = w.rc.max()
    wide_search(w, 3)
    _check(w, 100)
    assert before == 3400 and w.rc.max() <= 2500 * 1.01  # within 1% of LB (the 50 alone costs 2500)


def test_several_small_segments_replace_one_when_every_other_rank_is_full() -> None:
    # every rank is full: no move fits; rank 0 trades its 20 for small segments of rank 2 (an exchange)
    w = _state([[60, 20], [50, 30], [10] * 8], seq_len=80)
    wide_search(w, 3)
    _check(w, 80)
    # the optimum: 180 other tokens cannot fit two ranks of 80, so the 60 shares with >= 20 tokens: 60+10+10
    assert w.rc.max() == 60**2 + 2 * 10**2
