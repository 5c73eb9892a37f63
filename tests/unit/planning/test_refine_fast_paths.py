"""The local search's branch-free scans and one-pass set-up against the search as it was (loomtest.refine_ref,
main 4207467's kernels verbatim): the same placements, slot costs and room, rank costs, bit for bit.

Two sources of blocks: (1) real blocks from balance_block (random chains of text and unsplittable image steps,
dp 2..64, 1..4 micro-batches, long lane on or off, carried-in items, a cost with a linear term), whose
refine_flat inputs are copied as balance_span hands them over and searched by both; (2) synthetic dealt blocks
with costs of two values only (ties everywhere: the first best pair must win in both), unplaced and unmovable
items and long-lane slots, dp 2..64, and heavy ranks with more segments than the candidate caps. Also the
one-pass set-up (search_setup) against np.where, np.searchsorted and step_max, empty steps included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from loomdata.planning._cost import segment_cost
from loomdata.planning._packing import Lanes
from loomdata.planning._segments import Segments
from loomdata.planning.balance import BalanceConfig, _block, balance_block
from loomdata.planning.balance._refine import refine_flat
from loomdata.planning.balance._refine_kernel import search_setup
from loomdata.planning.balance._state import step_max
from loomdata.schemas.errors import PlanError
from loomdata.schemas.spec import CostSpec
from loomtest.refine_ref import refine_flat_ref

_Args = tuple[np.ndarray, ...]


def _both(args: _Args) -> tuple[_Args, _Args]:
    """refine_flat and the reference on copies of the same arguments: (current, reference) states after."""
    got = tuple(a.copy() for a in args)
    want = tuple(a.copy() for a in args)
    refine_flat(*got)
    refine_flat_ref(*want)
    return got, want


def _assert_same(got: _Args, want: _Args) -> None:
    names = ("cost3", "room3", "lane3", "rc", "p_rank", "p_mb", "g_cost", "g_len", "movable", "step_of")
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.tobytes() == w.tobytes(), f"{name} differs from the reference search"


def _step(rng: np.random.Generator, lanes: Lanes, dp: int, mb: int, image_share: float) -> Segments:
    """A step's segments as membership draws them (test_balance_oracle's shape): short text within 96% of the
    short slots, unsplittable image samples, long-lane segments in up to half the slots."""
    slots = dp * mb
    n_long = int(rng.integers(0, slots // 2 + 1)) if lanes.has_long else 0
    budget = int(0.96 * (slots - n_long) * lanes.seq_len)
    n = max(1, 3 * budget // lanes.seq_len + 2)
    is_img = rng.random(n) < image_share
    ln = np.where(is_img, rng.integers(lanes.seq_len // 3, lanes.seq_len + 1, n), rng.integers(1, lanes.seq_len + 1, n))
    ln[0] = min(ln[0], budget)
    keep = np.cumsum(ln) <= budget
    ln = ln[keep]
    img = np.where(is_img[keep], rng.integers(1, 50, n)[keep], 0)
    long_len = rng.integers(lanes.seq_len + 1, int(lanes.long_seq_len or 0) + 1, n_long)
    length = np.concatenate([ln, long_len]).astype(np.int64)
    order = rng.permutation(len(length))
    lane = np.concatenate([np.zeros(len(ln), np.uint8), np.ones(n_long, np.uint8)])[order]
    return Segments(
        rng.integers(0, 3, len(length)).astype(np.uint16),
        rng.integers(0, 1 << 40, len(length)).astype(np.uint64),
        rng.integers(0, 1000, len(length)).astype(np.uint32),
        length[order],
        lane,
        np.concatenate([img, np.zeros(n_long, np.int64)]).astype(np.uint32)[order],
    )


@pytest.mark.parametrize("seed", range(24))
def test_balance_blocks_search_as_the_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    dp = int(rng.choice([2, 3, 4, 5, 8, 17, 64]))
    mb = int(rng.integers(1, 5))
    seq_len = int(rng.choice([32, 64, 128]))
    long_cp = int(rng.choice([0, 1, 2]))
    lanes = (
        Lanes(seq_len=seq_len)
        if long_cp == 0
        else Lanes(seq_len=seq_len, long_seq_len=4 * seq_len, long_cp=long_cp, threshold=seq_len)
    )
    spec = CostSpec() if seed % 2 else CostSpec(attention=1.0, linear=50.0)
    image_share = float(rng.choice([0.0, 0.3, 0.9]))
    segs = [_step(rng, lanes, dp, mb, image_share) for _ in range(int(rng.integers(1, 7)))]
    drawn = [(s, segment_cost(s.length, s.image_tokens, spec, lanes.cp(s.lane))) for s in segs]
    carry = None
    if seed % 3 == 0:  # items a previous block deferred into the first step
        c = _step(rng, lanes, dp, mb, 1.0).take(slice(0, max(1, dp * mb // 3)))
        carry = c.take(c.lane == 0)
    searched: list[int] = []
    real: Callable[..., None] = _block.refine_flat

    def both(*args: Any) -> None:
        """The block's search by the reference first (on copies), then by the real one: the same bytes after."""
        want = tuple(np.array(a, copy=True) for a in args)
        placed = args[4].copy()
        refine_flat_ref(*want)
        real(*args)
        _assert_same(tuple(args), want)
        searched.append(int((args[4] != placed).sum()))  # items the search moved

    monkeypatch.setattr(_block, "refine_flat", both)
    cfg = BalanceConfig(dp=dp, micro_batches=mb, lanes=lanes, cost_spec=spec, seed=5)
    try:
        list(balance_block(range(3, 3 + len(segs)), drawn, carry, cfg))
    except PlanError:  # a chain the balancer refuses (as the reference would): nothing to compare
        pytest.skip("chain refused")
    assert searched  # every block went through both searches


def _dealt_block(rng: np.random.Generator, dp: int, mb: int, n: int, steps: int, heavy: float) -> _Args:
    """A flat block of dealt steps (refine_flat's arguments): costs of two values (ties), a `heavy` share of the
    items on rank 0, 5% unplaced, 3% unmovable (long), 10% long-lane slots; one step is left empty."""
    seq_len = 1 << 20
    ns = [n - s % 3 if s != 1 else 0 for s in range(steps)]
    total = sum(ns)
    length = rng.integers(1, 20, total).astype(np.int64) * 100
    cost = length.astype(np.float64) * rng.choice([1.0, 1.5], total)
    step_of = np.repeat(np.arange(steps), ns)
    p_rank = rng.integers(0, dp, total)
    p_rank[rng.random(total) < heavy] = 0
    p_mb = rng.integers(0, mb, total)
    p_rank[rng.random(total) < 0.05] = -1
    p_mb[p_rank < 0] = -1
    movable = (p_rank >= 0) & (rng.random(total) >= 0.03)
    lane3 = (rng.random((steps, dp, mb)) < 0.1).astype(np.uint8)
    cost3 = np.zeros((steps, dp, mb))
    room3 = np.full((steps, dp, mb), seq_len, dtype=np.int64)
    placed = p_rank >= 0
    np.add.at(cost3, (step_of[placed], p_rank[placed], p_mb[placed]), cost[placed])
    np.subtract.at(room3, (step_of[placed], p_rank[placed], p_mb[placed]), length[placed])
    room3[lane3 == 1] = 0
    g_cost, g_len = np.concatenate([cost, [0.0]]), np.concatenate([length, [0]])
    return cost3, room3, lane3, cost3.sum(axis=2), p_rank, p_mb, g_cost, g_len, movable, step_of


@pytest.mark.parametrize(
    ("dp", "mb", "n", "steps", "heavy"),
    [
        (2, 1, 5, 4, 0.0),
        (2, 2, 2500, 3, 0.05),
        (3, 2, 3000, 3, 0.4),
        (4, 4, 61, 40, 0.1),
        (4, 4, 61, 40, 0.6),
        (9, 3, 200, 12, 0.3),
        (17, 2, 400, 6, 0.2),
        (64, 2, 900, 4, 0.02),
        (64, 4, 3000, 3, 0.3),
    ],
)
def test_tied_blocks_search_as_the_reference(dp: int, mb: int, n: int, steps: int, heavy: float) -> None:
    rng = np.random.default_rng(dp * 7919 + n + steps)
    args = _dealt_block(rng, dp, mb, n, steps, heavy)
    got, want = _both(args)
    _assert_same(got, want)
    assert (got[4] != args[4]).any()  # the searches moved items: not a comparison of untouched states


def test_search_setup_is_the_numpy_set_up() -> None:
    rng = np.random.default_rng(3)
    dp, steps = 5, 30
    ns = rng.integers(0, 9, steps)
    ns[[0, 7, steps - 1]] = 0  # empty steps, first and last included
    n = int(ns.sum())
    step_of = np.repeat(np.arange(steps), ns)
    p_rank = rng.integers(-1, dp, n)
    p_rank[step_of == 4] = -1  # a step with nothing placed: its top is 0
    movable = (p_rank >= 0) & (rng.random(n) < 0.8)
    g_cost = np.concatenate([rng.choice([0.5, 2.0, 3.25], n), [0.0]])
    key, off, top = search_setup(movable, step_of, p_rank, g_cost, steps, dp)
    assert key.tobytes() == np.where(movable, step_of * dp + p_rank, steps * dp).astype(np.int64).tobytes()
    assert off.tobytes() == np.searchsorted(step_of, np.arange(steps + 1)).astype(np.int64).tobytes()
    want_top = step_max(g_cost[:-1][p_rank >= 0], step_of[p_rank >= 0], steps)
    assert top.tobytes() == want_top.tobytes() and top[4] == 0.0 and top.max() > 0


def _special_block(rng: np.random.Generator, dp: int, mb: int) -> _Args:
    """A dealt block whose costs hold NaN, inf, 0.0 and -0.0 among random ones, most items on a quarter of the
    ranks (many moves and swaps: rank lists grow by a round's item on either side), empty steps and unplaced
    or unmovable items, as refine_flat takes it (rank costs summed item by item, a dummy 0 appended)."""
    b = 4
    ns = rng.integers(0, 3 * dp * mb + 2, b)
    ns[1] = 0
    n = int(ns.sum())
    step_of = np.repeat(np.arange(b), ns)
    seq = 4096
    length = rng.integers(0, seq // 8 + 1, n).astype(np.int64)
    cost = rng.random(n)
    special = rng.integers(0, max(n, 1), 6)[: min(n, 6)]  # a few: the ranks without one still search
    cost[special] = np.array([np.nan, np.inf, 0.0, -0.0, np.inf, np.nan])[: len(special)]
    p_rank = rng.integers(0, max(1, dp // 4), n).astype(np.int64)
    p_mb = rng.integers(0, mb, n).astype(np.int64)
    p_rank[rng.random(n) < 0.03] = -1
    p_mb[p_rank < 0] = -1
    cost3 = np.zeros((b, dp, mb))
    used = np.zeros((b, dp, mb), dtype=np.int64)
    rc = np.zeros((b, dp))
    for i in np.flatnonzero(p_rank >= 0).tolist():
        cost3[step_of[i], p_rank[i], p_mb[i]] += cost[i]
        used[step_of[i], p_rank[i], p_mb[i]] += length[i]
        rc[step_of[i], p_rank[i]] += cost[i]
    room3 = max(seq, int(used.max(initial=0))) - used
    lane3 = np.zeros((b, dp, mb), dtype=np.uint8)
    movable = (p_rank >= 0) & (rng.random(n) > 0.05)
    g_cost, g_len = np.concatenate([cost, [0.0]]), np.concatenate([length, [0]])
    return cost3, room3, lane3, rc, p_rank, p_mb, g_cost, g_len, movable, step_of


@pytest.mark.parametrize(("dp", "mb"), [(2, 1), (4, 2), (33, 1), (64, 4), (1024, 1)])
def test_special_costs_search_as_the_reference(dp: int, mb: int) -> None:
    """NaN, inf and signed zero costs (branch-free scores: an infeasible pair scores inf where the reference
    skipped it; a NaN score never wins in either), skewed loads at dp 2 to 1024: the reference's bits."""
    rng = np.random.default_rng(dp * 31 + mb)
    moved = 0
    for _ in range(6):
        args = _special_block(rng, dp, mb)
        got, want = _both(args)
        _assert_same(got, want)
        moved += int((got[4] != args[4]).sum())
    assert moved > 0
