"""The block balancer (loomdata.planning.balance) against the per-step oracle (loomtest.balance_oracle).

Random chains of small steps (text and unsplittable image samples, dp 1..40, 1..4 micro-batches, long
lane on or off) are balanced by both. The oracle is the per-step code before the wide local search
(planning.balance._wide); the wide search runs after dealing, leftovers and the pairwise rounds and
never raises a step's maximum, so: every step's segments, costs, deferrals and carry are the oracle's
bytes, its most loaded rank costs at most the oracle's, every segment's tokens are placed exactly once
(or deferred), and no sequence holds more than its capacity. Tiny steps are also checked against the
exact optimum (loomtest.exact_balance).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomdata.planning._cost import segment_cost
from loomdata.planning._packing import Lanes
from loomdata.planning._segments import Segments
from loomdata.planning.balance import BalanceConfig, balance_block
from loomdata.schemas.errors import PlanError
from loomdata.schemas.spec import CostSpec
from loomtest import balance_oracle as oracle
from loomtest.exact_balance import exact_max


def _step(rng: np.random.Generator, lanes: Lanes, dp: int, mb: int, image_share: float, cost: CostSpec) -> Segments:
    """A step's segments as membership draws them: short tokens within fill of the short slots, long
    segments at most half the slots, image samples whole and within a short sequence."""
    slots = dp * mb
    n_long = int(rng.integers(0, slots // 2 + 1)) if lanes.has_long else 0
    budget = int(0.96 * (slots - n_long) * lanes.seq_len)
    n = max(1, 3 * budget // lanes.seq_len + 2)
    is_img = rng.random(n) < image_share
    # image samples are long (a third of a sequence or more), so image-heavy steps defer some
    ln = np.where(is_img, rng.integers(lanes.seq_len // 3, lanes.seq_len + 1, n), rng.integers(1, lanes.seq_len + 1, n))
    ln[0] = min(ln[0], budget)  # a step draws at least one document (membership checks that)
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


@st.composite
def chains(draw: st.DrawFn) -> dict[str, Any]:
    seq_len = draw(st.sampled_from([32, 64, 128]))
    long_cp = draw(st.sampled_from([0, 1, 2, 4]))  # 0: no long lane
    lanes = (
        Lanes(seq_len=seq_len)
        if long_cp == 0
        else Lanes(seq_len=seq_len, long_seq_len=4 * seq_len, long_cp=long_cp, threshold=seq_len)
    )
    return {
        "lanes": lanes,
        "dp": draw(st.integers(1, 40)),
        "mb": draw(st.integers(1, 4)),
        "steps": draw(st.integers(1, 6)),
        "first": draw(st.integers(0, 50)),
        "image_share": draw(st.sampled_from([0.0, 0.3, 0.9, 1.0])),
        "carry_in": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "cost": draw(st.sampled_from([CostSpec(), CostSpec(attention=1.0, linear=50.0, encoder=3.0)])),
    }


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.asarray(a).tobytes() == np.asarray(b).astype(np.asarray(a).dtype).tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=chains())
def test_block_balancer_matches_the_per_step_oracle(case: dict[str, Any]) -> None:
    lanes, dp, mb, cost_spec = case["lanes"], case["dp"], case["mb"], case["cost"]
    rng = np.random.default_rng(case["seed"])
    segs = [_step(rng, lanes, dp, mb, case["image_share"], cost_spec) for _ in range(case["steps"])]
    drawn = [(s, segment_cost(s.length, s.image_tokens, cost_spec, lanes.cp(s.lane))) for s in segs]
    cols = [((s.source, s.sample, s.offset, s.length, s.lane, s.image_tokens), c) for s, c in drawn]
    steps = range(case["first"], case["first"] + case["steps"])
    kw = {"dp": dp, "micro_batches": mb, "lanes": lanes, "cost_spec": cost_spec, "seed": 5}
    carry = None
    if case["carry_in"]:  # what a previous block (or a re-plan's base) deferred into the first step
        c = _step(rng, lanes, dp, mb, 1.0, cost_spec).take(slice(0, max(1, dp * mb // 3)))
        carry = c.take(c.lane == 0)
    w_carry = (
        None
        if carry is None
        else (carry.source, carry.sample, carry.offset, carry.length, carry.lane, carry.image_tokens)
    )
    try:
        want = oracle.balance_chain(steps.start, cols, w_carry, **kw)
    except PlanError:
        with pytest.raises(PlanError):
            list(balance_block(steps, drawn, carry, BalanceConfig(**kw)))
        return
    got = list(balance_block(steps, drawn, carry, BalanceConfig(**kw)))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert all(
            _same(a, b)
            for a, b in zip(
                w.cols,
                (g.segs.source, g.segs.sample, g.segs.offset, g.segs.length, g.segs.lane, g.segs.image_tokens),
                strict=True,
            )
        )
        assert _same(w.cost, g.cost)
        assert _same(w.asg.deferred, g.asg.deferred)
        assert g.asg.rank_cost.max() <= w.asg.rank_cost.max() * (1 + 1e-12) + 1e-9
        _check_placement(g, lanes, dp, mb)
        assert _same(w.in_step, np.ones(len(g.cost), bool) if g.in_step is None else g.in_step)
        assert (w.carry is None) == (g.carry is None)
        if w.carry is not None and g.carry is not None:
            gc = (g.carry.source, g.carry.sample, g.carry.offset, g.carry.length, g.carry.lane, g.carry.image_tokens)
            assert all(_same(a, b) for a, b in zip(w.carry, gc, strict=True))


def _check_placement(g: Any, lanes: Lanes, dp: int, mb: int) -> None:
    """Every in-step segment's tokens placed once (less what it defers), slots within capacity, costs consistent."""
    a = g.asg
    n = len(g.cost)
    placed = np.bincount(a.item, weights=a.length, minlength=n)
    deferred = np.bincount(a.deferred[:, 0], weights=a.deferred[:, 2], minlength=n) if len(a.deferred) else 0
    assert np.array_equal(placed + deferred, g.segs.length.astype(np.float64))
    slot = a.rank * mb + a.micro_batch
    tokens = np.bincount(slot, weights=a.length, minlength=dp * mb)
    long_slot = np.bincount(slot, weights=a.lane == 1, minlength=dp * mb) > 0
    assert (tokens <= np.where(long_slot, int(lanes.long_seq_len or 0), lanes.seq_len)).all()
    assert not (long_slot & (np.bincount(slot, weights=a.lane == 0, minlength=dp * mb) > 0)).any()
    assert np.allclose(a.slot_cost.sum(axis=1), a.rank_cost)


def _tiny(seed: int) -> tuple[float, float] | None:
    """(planner max, exact optimum) of one seeded tiny step, or None when it splits or defers."""
    rng = np.random.default_rng(seed)
    dp, mb, n, seq_len = int(rng.integers(2, 4)), int(rng.integers(1, 3)), int(rng.integers(2, 11)), 64
    ln = rng.integers(1, seq_len + 1, n)
    ln = ln[np.cumsum(ln) <= int(0.95 * dp * mb * seq_len)]
    if len(ln) == 0:
        return None
    cs = CostSpec(attention=1.0, linear=50.0)
    c = segment_cost(ln, None, cs, 1)
    z = np.zeros(len(ln), np.uint32)
    segs = Segments(
        z.astype(np.uint16), np.arange(len(ln), dtype=np.uint64), z, ln.astype(np.uint32), z.astype(np.uint8), z
    )
    cfg = BalanceConfig(dp=dp, micro_batches=mb, lanes=Lanes(seq_len=seq_len), cost_spec=cs, seed=0)
    got = next(iter(balance_block(range(1), [(segs, c)], None, cfg))).asg
    if len(got.item) != len(ln) or len(got.deferred):
        return None  # split pieces: the enumeration covers whole segments only
    return float(got.rank_cost.max()), exact_max(ln, c, dp=dp, micro_batches=mb, seq_len=seq_len)


def test_tiny_steps_against_the_exact_optimum() -> None:
    """300 seeded tiny steps (dp 2-3, 1-2 micro-batches, <= 10 segments): never below the optimum (the
    enumeration is right), at it within 0.1% in at least 95% of them (measured: 288 of 300; before the wide
    search 282), worst 3.5% on these seeds. A local search, it can miss where capacity binds and two
    coordinated changes are needed: a random search found a step (seed 28110 of an earlier generator) 19%
    above the optimum, so this bounds the typical case, not every case."""
    pairs = [p for p in map(_tiny, range(300)) if p is not None]
    ratio = np.array([g / o for g, o in pairs])
    assert len(ratio) >= 250
    assert (ratio >= 1 - 1e-12).all()
    assert (ratio <= 1.001).mean() >= 0.95
    assert ratio.max() <= 1.05
