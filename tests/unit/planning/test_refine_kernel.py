"""The compiled pairwise local search (refine_rounds, ranks' item lists kept as items move) makes the NumPy
oracle's moves and swaps, bit for bit, step after step of a block: few and many items a rank (more than
MAX_CANDIDATES: every stride-th is a candidate), long-lane slots, unplaced and long items that never move."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning.balance._refine import MAX_CANDIDATES, SWAP_ROUNDS, TOLERANCE
from loomdata.planning.balance._refine_kernel import _list_move, _rank_lists, refine_rounds
from loomtest import balance_oracle as oracle


def _step(rng: np.random.Generator, dp: int, mb: int, n: int, heavy: float) -> tuple[np.ndarray, ...]:
    """A dealt step: (length, cost, p_rank, p_mb, is_long, slot cost, room, lane, rank cost); costs of a few
    values (ties: the first best pair in list order wins), a `heavy` share of the items on rank 0."""
    seq_len = 1 << 20
    length = rng.integers(1, 20, n).astype(np.int64) * 100
    cost = length.astype(np.float64) * rng.choice([1.0, 1.5], n)
    p_rank = rng.integers(0, dp, n)
    p_rank[rng.random(n) < heavy] = 0
    p_mb = rng.integers(0, mb, n)
    p_rank[rng.random(n) < 0.05] = -1  # unplaced (deferred) items stay where they are
    p_mb[p_rank < 0] = -1
    is_long = rng.random(n) < 0.03
    lane = (rng.random((dp, mb)) < 0.1).astype(np.uint8)
    slot_cost = np.zeros((dp, mb))
    room = np.full((dp, mb), seq_len, dtype=np.int64)
    placed = p_rank >= 0
    np.add.at(slot_cost, (p_rank[placed], p_mb[placed]), cost[placed])
    np.subtract.at(room, (p_rank[placed], p_mb[placed]), length[placed])
    room[lane == 1] = 0
    return length, cost, p_rank, p_mb, is_long, slot_cost, room, lane, slot_cost.sum(axis=1)


@pytest.mark.parametrize(
    ("dp", "mb", "n", "steps", "heavy"),
    [(2, 1, 5, 3, 0.0), (4, 4, 61, 20, 0.1), (64, 2, 900, 4, 0.02), (3, 2, 3000, 2, 0.4), (2, 2, 2500, 3, 0.05)],
)
def test_refine_rounds_make_the_oracles_moves(dp: int, mb: int, n: int, steps: int, heavy: float) -> None:
    rng = np.random.default_rng(dp * 1000 + n)
    block = [_step(rng, dp, mb, n - s % 2, heavy) for s in range(steps)]
    ns = np.array([len(b[0]) for b in block])
    off = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    step_of = np.repeat(np.arange(steps), ns)
    length = np.concatenate([b[0] for b in block])
    cost = np.concatenate([b[1] for b in block])
    p_rank = np.concatenate([b[2] for b in block])
    p_mb = np.concatenate([b[3] for b in block])
    movable = (p_rank >= 0) & ~np.concatenate([b[4] for b in block])
    cost3 = np.stack([b[5] for b in block])
    room3 = np.stack([b[6] for b in block])
    lane3 = np.stack([b[7] for b in block])
    rc = np.stack([b[8] for b in block])
    key = np.where(movable, step_of * dp + p_rank, steps * dp)
    g_cost, g_len = np.concatenate([cost, [0.0]]), np.concatenate([length, [0]])
    refine_rounds(cost3, room3, lane3, rc, p_rank, p_mb, g_cost, g_len, key, off, SWAP_ROUNDS, TOLERANCE, 512)
    moved = 0
    for s, (ln, c, pr, pm, is_long, sc, room, lane, r) in enumerate(block):
        st = oracle._Slots(sc, room, lane, r)
        before = pr.copy()
        oracle._refine(ln, c, st, pr, pm, is_long)
        a, b = off[s], off[s + 1]
        moved += int((pr != before).sum())
        assert np.array_equal(p_rank[a:b], pr) and np.array_equal(p_mb[a:b], pm)
        assert cost3[s].tobytes() == st.cost.tobytes() and room3[s].tobytes() == st.room.tobytes()
        assert rc[s].tobytes() == st.rank_cost.tobytes()
        assert np.array_equal(key[a:b], np.where(movable[a:b], s * dp + pr, steps * dp))
    assert moved > 0  # the search did move items: the comparison is not of untouched states
    assert MAX_CANDIDATES == 512  # the oracle's bound (its _MAX_CANDIDATES)


@pytest.mark.parametrize("stride", [0, 260 + 40])  # packed after a count; one pass, a whole step's room a rank
def test_rank_lists_stay_each_ranks_items_ascending_as_items_move(stride: int) -> None:
    """A step's rank lists against sets: built from the keys, then after moves back and forth (a rank takes at
    most one item a round, so `rounds` spare places a rank suffice)."""
    rng = np.random.default_rng(11)
    dp, rounds, base = 5, 40, 3 * 5
    key = np.where(rng.random(300) < 0.9, base + rng.integers(0, dp, 300), 99)
    at, cnt = np.empty(dp, dtype=np.int64), np.empty(dp, dtype=np.int64)
    buf = np.full(dp * stride if stride else 300 + dp * rounds, -1, dtype=np.int64)
    _rank_lists(key, 20, 280, base, dp, rounds, at, cnt, buf, stride)
    model = [set(np.flatnonzero(key == base + r).tolist()) & set(range(20, 280)) for r in range(dp)]
    for _ in range(rounds):
        src, dst = rng.choice(dp, 2, replace=False)
        if not model[src]:
            continue
        item = int(rng.choice(sorted(model[src])))
        _list_move(item, int(src), int(dst), at, cnt, buf)
        model[src].remove(item)
        model[dst].add(item)
        for r in range(dp):
            assert buf[at[r] : at[r] + cnt[r]].tolist() == sorted(model[r])
