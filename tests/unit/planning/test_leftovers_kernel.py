"""The compiled text leftovers (balance._leftovers_kernel) against place_leftovers step by step, as the oracle.

Random blocks of text steps are dealt (the real LPT rounds), then each copy of the dealt state gets its
leftovers placed: by place_leftovers one leftover step after the other (stopping after the first step that
defers, as balance_span does), and by text_leftovers in one call. The slot state, placements, split pieces
and deferred rests must be the same bytes, over dp 1..64, 1..4 micro-batches, over-full steps (deferrals),
steps with no leftovers, a linear cost term and a cp size.
"""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._packing import Lanes
from loomdata.planning.balance._deal import deal_flat
from loomdata.planning.balance._leftovers import place_leftovers
from loomdata.planning.balance._leftovers_kernel import text_leftovers
from loomdata.planning.balance._state import members
from loomdata.schemas.spec import CostSpec


def _block(rng: np.random.Generator, steps: int, dp: int, mb: int, seq_len: int, fill: float) -> np.ndarray:
    """Lengths of `steps` steps' text segments (about fill x the steps' capacity each), and their offsets."""
    parts, off = [], [0]
    for _ in range(steps):
        budget = int(fill * dp * mb * seq_len)
        ln = rng.integers(1, seq_len + 1, 3 * budget // seq_len + 2)
        ln = ln[np.cumsum(ln) <= max(budget, int(ln[0]))]
        parts.append(ln)
        off.append(off[-1] + len(ln))
    return np.concatenate(parts).astype(np.int64), np.asarray(off, dtype=np.int64)


def _dealt(length: np.ndarray, cost: np.ndarray, off: np.ndarray, dp: int, mb: int, lanes: Lanes):  # type: ignore[no-untyped-def]
    return deal_flat(length, cost, np.zeros(len(length), np.uint8), off, dp=dp, micro_batches=mb, lanes=lanes)


def _oracle(fd, cost, lanes, spec, left_steps):  # type: ignore[no-untyped-def]
    """place_leftovers step by step: pieces (step, item, delta, length, rank, mb), rests (step, item, delta, tokens)."""
    pieces, rests, done = [], [], 0
    for i in left_steps.tolist():
        d = fd.view(i)
        a, b = int(fd.off[i]), int(fd.off[i + 1])
        left = d.order[d.p_rank[d.order] < 0]
        e = place_leftovers(left, d.length, cost[a:b], np.ones(b - a, bool), d.st, d.p_rank, d.p_mb, lanes, spec)
        pieces += [(i, int(e[0][k]) + a, *(int(x[k]) for x in e[1:5])) for k in range(len(e[0]))]
        rests += [(i, int(r[0]) + a, int(r[1]), int(r[2])) for r in e[5]]
        done += 1
        if len(e[5]):
            break
    return np.array(pieces, np.int64).reshape(-1, 6), np.array(rests, np.int64).reshape(-1, 4), done


@pytest.mark.parametrize("seed", range(40))
def test_text_leftovers_match_place_leftovers(seed: int) -> None:
    rng = np.random.default_rng(seed)
    dp = int(rng.choice([1, 2, 3, 4, 8, 17, 64]))
    mb = int(rng.integers(1, 5))
    seq_len = int(rng.choice([16, 64, 256]))
    lanes = Lanes(seq_len=seq_len, short_cp=int(rng.choice([1, 2])))
    spec = CostSpec() if seed % 2 else CostSpec(attention=1.0, linear=37.5)
    fill = float(rng.choice([0.9, 0.96, 1.0, 1.05]))  # over 1: a step holds more than its slots (deferrals)
    length, off = _block(rng, int(rng.integers(1, 30)), dp, mb, seq_len, fill)
    cost = spec.of(length, None, lanes.short_cp)
    fd_a, fd_b = _dealt(length, cost, off, dp, mb, lanes), _dealt(length, cost, off, dp, mb, lanes)
    nb = len(off) - 1
    order_step = np.repeat(np.arange(nb), np.diff(fd_a.cut))
    left_steps = members(order_step[fd_a.p_rank[fd_a.order] < 0], nb)
    want = _oracle(fd_a, cost, lanes, spec, left_steps)
    got = text_leftovers(
        fd_b.cost3,
        fd_b.room3,
        fd_b.rank_cost,
        fd_b.p_rank,
        fd_b.p_mb,
        fd_b.length,
        cost,
        fd_b.order,
        fd_b.cut,
        left_steps,
        float(spec.attention),
        float(spec.linear),
        float(lanes.short_cp),
    )
    assert got[2] == want[2]
    for w, g in zip(want[:2], got[:2], strict=True):
        assert g.shape == w.shape and g.tobytes() == w.tobytes()
    for name in ("cost3", "room3", "rank_cost", "p_rank", "p_mb"):
        assert getattr(fd_b, name).tobytes() == getattr(fd_a, name).tobytes(), name


def test_text_leftovers_edge_cases() -> None:
    """No leftover steps: nothing placed; a step with no room at all: its leftovers deferred whole, and the
    call stops there (later leftover steps untouched)."""
    lanes, spec = Lanes(seq_len=8), CostSpec()
    length = np.array([8, 8, 8, 5, 8, 8, 3], dtype=np.int64)  # step 0: 3 x 8 into 2 slots; step 1: 5, 8, 8, 3
    off = np.array([0, 3, 7], dtype=np.int64)
    cost = spec.of(length, None, 1)
    fd = _dealt(length, cost, off, 1, 2, lanes)
    args = (fd.cost3, fd.room3, fd.rank_cost, fd.p_rank, fd.p_mb, fd.length, cost, fd.order, fd.cut)
    pieces, rests, done = text_leftovers(*args, np.zeros(0, np.int64), 1.0, 0.0, 1.0)
    assert (pieces.shape, rests.shape, done) == ((0, 6), (0, 4), 0)
    room_before = fd.room3.copy()
    pieces, rests, done = text_leftovers(*args, np.array([0, 1], np.int64), 1.0, 0.0, 1.0)
    assert done == 1 and len(pieces) == 0
    assert rests.tolist() == [[0, 2, 0, 8]]  # step 0's third 8-token segment: no room left, deferred whole
    assert fd.room3[1].tolist() == room_before[1].tolist()  # step 1 not touched
