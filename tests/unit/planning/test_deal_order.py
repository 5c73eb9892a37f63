"""The dealing order found on lengths (_deal_kernel.by_length_order) is the order sorted on costs, bit for bit.

by_length_order orders a block by step, then longest first, and checks each step against its costs; a step
where a longer item does not cost strictly more, or equal lengths cost differently, is sorted on its costs.
Its result must be np.lexsort((-cost, step)) (by_cost_order's) for every cost model: text in the short lane
(cost strictly increasing in the length), attention = linear = 0 (every cost 0: equal costs of different
lengths), images (the cost not a function of the length), several cp sizes, NaN, wide length spans. And a whole
deal (deal_flat: long lanes, carried items, full ranks) must give the same bytes as with by_cost_order.
"""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._cost import segment_cost
from loomdata.planning._jit import stable_argsort
from loomdata.planning._packing import Lanes
from loomdata.planning.balance import _deal
from loomdata.planning.balance._deal import deal_flat
from loomdata.planning.balance._deal_kernel import (
    LENGTH_SPAN_MIN,
    _best_slot,
    _order_loads,
    _place_few,
    _steps_order,
    by_cost_order,
    by_length_order,
    deal_rounds,
    place_whole_step,
)
from loomdata.schemas.spec import CostSpec

SPECS = {
    "text": CostSpec(),
    "attention_only": CostSpec(attention=1.0, linear=0.0),
    "linear_only": CostSpec(attention=0.0, linear=1.0),
    "zero": CostSpec(attention=0.0, linear=0.0),
    "images": CostSpec(encoder=0.1875, encoder_linear=1152.0, encoder_window=16),
}


def _steps(rng: np.random.Generator, b: int, most: int) -> tuple[np.ndarray, np.ndarray]:
    ns = rng.integers(0, most, b)
    cut = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    return cut, np.repeat(np.arange(b), ns)


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("cp", ["one", "two", "mixed"])
@pytest.mark.parametrize("seed", range(4))
def test_length_order_is_the_lexsort_on_costs(kind: str, cp: str, seed: int) -> None:
    """Lengths from a few values (many ties) or from 1..seq_len, steps of 0..129 items, every cost model."""
    rng = np.random.default_rng(seed)
    cut, step = _steps(rng, int(rng.integers(1, 80)), 130)
    n = len(step)
    hi = 6 if seed % 2 else 4096
    length = rng.integers(1, hi + 1, n).astype(np.int64)
    images = rng.integers(0, 3, n) * (length // 4) if kind == "images" else None
    cp_size: int | np.ndarray = {"one": 1, "two": 2, "mixed": rng.choice(np.array([1, 2, 4]), n)}[cp]
    cost = segment_cost(length, images, SPECS[kind], cp_size)
    want = np.lexsort((-cost, step))
    assert np.array_equal(by_length_order(cost, length, cut), want)
    assert np.array_equal(by_cost_order(cost, cut), want)


def test_equal_costs_of_different_lengths_keep_position_order() -> None:
    """A zero cost model: every item ties, so each step stays in position order, not longest first."""
    length = np.array([3, 9, 1, 9, 4, 2, 7], dtype=np.int64)
    cut = np.array([0, 4, 7], dtype=np.int64)
    cost = segment_cost(length, None, SPECS["zero"])
    assert np.array_equal(by_length_order(cost, length, cut), np.arange(7))


def test_a_cost_against_its_length_sends_only_its_step_to_the_cost_sort() -> None:
    """Step 1 has a shorter item that costs more (an image): it is sorted on costs; steps 0 and 2 by length."""
    length = np.array([5, 8, 8, 2, 6, 1, 6, 3, 9, 9], dtype=np.int64)
    cost = length.astype(np.float64) ** 2
    cost[5] = 1000.0  # step 1's length-1 item
    cut = np.array([0, 3, 7, 10], dtype=np.int64)
    got = by_length_order(cost, length, cut)
    assert np.array_equal(got, np.lexsort((-cost, np.repeat(np.arange(3), np.diff(cut)))))
    assert got[3:7].tolist() == [5, 4, 6, 3]


@pytest.mark.parametrize("where", [0, 1, 7, 19])
def test_nan_costs_give_what_the_cost_sort_gives(where: int) -> None:
    rng = np.random.default_rng(where)
    cut, _ = _steps(rng, 6, 20)
    n = int(cut[-1])
    length = rng.integers(1, 50, n).astype(np.int64)
    cost = segment_cost(length, None, SPECS["text"])
    cost[where % n] = np.nan
    cost[(where * 7 + 3) % n] = np.nan
    got = by_length_order(cost, length, cut)
    assert np.array_equal(got, by_cost_order(cost, cut))
    assert np.array_equal(got, _steps_order(cost, cut))


@pytest.mark.parametrize("n", [1, 5, LENGTH_SPAN_MIN + 3, 3000])
def test_a_span_wider_than_the_block_is_left_to_the_cost_sort(n: int) -> None:
    """Lengths spanning more values than the block has items (and LENGTH_SPAN_MIN): the same order all the same."""
    rng = np.random.default_rng(n)
    length = rng.integers(1, 2**40, n).astype(np.int64)
    length[0] = 2**41
    cost = length.astype(np.float64)
    cut = np.array([0, n // 2, n], dtype=np.int64)
    want = np.lexsort((-cost, np.repeat(np.arange(2), np.diff(cut))))
    assert np.array_equal(by_length_order(cost, length, cut), want)


def test_an_empty_block_and_empty_steps() -> None:
    empty = np.empty(0, dtype=np.int64)
    assert len(by_length_order(np.empty(0), empty, np.zeros(4, dtype=np.int64))) == 0
    length = np.array([2, 3], dtype=np.int64)
    cut = np.array([0, 0, 2, 2], dtype=np.int64)
    assert by_length_order(length * 1.0, length, cut).tolist() == [1, 0]


def _cost_sorted(cost: np.ndarray, length: np.ndarray, cut: np.ndarray) -> np.ndarray:
    return by_cost_order(cost, cut)  # the order deal_flat took before by_length_order


@pytest.mark.parametrize("seed", range(12))
def test_a_whole_deal_is_the_same_bytes_as_with_the_cost_sort(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """deal_flat on random blocks (text, images, long-lane items, carried items, over-full steps): the same
    slot state, placements and order as deal_flat ordering on costs."""
    rng = np.random.default_rng(seed)
    dp, mb, seq_len = int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 5)), int(rng.choice([64, 4096]))
    long = seed % 3 == 0
    lanes = Lanes(seq_len=seq_len, short_cp=1, long_seq_len=4 * seq_len if long else None, long_cp=2, threshold=None)
    cut, _ = _steps(rng, int(rng.integers(1, 40)), int(dp * mb * 3))
    n = int(cut[-1])
    length = rng.integers(1, seq_len + 1, n).astype(np.int64)
    lane = (rng.random(n) < 0.05).astype(np.uint8) if long else np.zeros(n, np.uint8)
    length[lane == 1] *= 3
    images = rng.integers(0, 2, n) * (length // 2) if seed % 4 == 1 else None
    cost = segment_cost(length, images, CostSpec(encoder=0.5) if images is not None else CostSpec(), lanes.cp(lane))
    carried = [int(min(3, cut[1]))] + [0] * (len(cut) - 2) if seed % 2 else None

    def deal() -> _deal.FlatDeal:
        return deal_flat(length, cost, lane, cut, dp=dp, micro_batches=mb, lanes=lanes, carried=carried)

    new = deal()
    monkeypatch.setattr(_deal, "by_length_order", _cost_sorted)
    old = deal()
    for f in ("cost3", "room3", "lane3", "rank_cost", "p_rank", "p_mb", "order", "cut", "long_idx"):
        a, b = getattr(new, f), getattr(old, f)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f


def _rounds_reference(cost3, room3, rank_cost, p_rank, p_mb, by, cut, length, cost):  # type: ignore[no-untyped-def]
    """The LPT rounds as their docstring says, in Python: each round the least loaded ranks (stable_argsort) within
    the round's largest cost of the minimum take the next items, each into its least loaded micro-batch with
    room; items whose rank had none go to place_whole_step."""
    for s in range(len(cut) - 1):
        at, end = int(cut[s]), int(cut[s + 1])
        while at < end:
            rk = stable_argsort(rank_cost[s])  # np.argsort(kind="stable") but for NaN where dp <= 32
            within = int((rank_cost[s] <= rank_cost[s, rk[0]] + cost[by[at]]).sum())
            k = min(end - at, max(within, 1))
            failed = []
            for e in range(k):
                r, it = int(rk[e]), int(by[at + e])
                m = _best_slot(cost3[s, r], room3[s, r], int(length[it]))
                if m < 0:
                    failed.append(it)
                else:
                    cost3[s, r, m] += cost[it]
                    room3[s, r, m] -= length[it]
                    rank_cost[s, r] += cost[it]
                    p_rank[it], p_mb[it] = r, m
            if failed:
                items = np.array(failed, dtype=np.int64)
                place_whole_step(s, items, length, cost, cost3, room3, rank_cost, p_rank, p_mb)
            at += k


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("dp", [0, 33, 64])
def test_deal_rounds_match_the_rounds_in_python(seed: int, dp: int) -> None:
    """Random blocks at dp 1..64 (the rank sort's insertion and merge sorts, which order NaN loads apart), full
    ranks, tied and NaN costs."""
    rng = np.random.default_rng(seed)
    dp, mb = dp or int(rng.choice([1, 2, 3, 4, 8, 32])), int(rng.integers(1, 5))
    seq_len = 64
    cut, _ = _steps(rng, int(rng.integers(1, 12)), dp * mb * 3)
    n = int(cut[-1])
    length = rng.integers(1, seq_len + 1, n).astype(np.int64)
    cost = segment_cost(length, None, CostSpec()) if seed % 3 else rng.integers(0, 3, n).astype(np.float64)
    if seed % 4 == 3 and n:
        cost[rng.integers(0, n, n // 10 + 2)] = np.nan  # dealt last, a round each: NaN loads to sort
    by = by_cost_order(cost, cut)
    b = len(cut) - 1
    states = [
        [
            np.zeros((b, dp, mb)),
            np.full((b, dp, mb), seq_len, np.int64),
            np.zeros((b, dp)),
            np.full(n, -1),
            np.full(n, -1),
        ]
        for _ in range(2)
    ]
    deal_rounds(*states[0], by, cut[:-1], np.diff(cut), length, cost)
    _rounds_reference(*states[1], by, cut, length, cost)
    for a, w in zip(states[0], states[1], strict=True):
        assert a.tobytes() == w.tobytes()
    assert (states[0][3] >= 0).any() or n == 0


@pytest.mark.parametrize("kind", ["uniform", "ties", "nan", "signed_zero_outlier", "inf", "tiny_span", "all_nan"])
@pytest.mark.parametrize("seed", range(6))
def test_rank_loads_order_is_the_stable_argsort(kind: str, seed: int) -> None:
    """_order_loads (buckets, then an insertion pass; np.argsort where the range is not finite or the buckets
    bunch) gives np.argsort(kind="stable")'s order: ascending, NaN last, ties (-0.0 with 0.0, NaN with NaN) by
    rank."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(33, 1100))
    x = rng.random(n) * 1e4
    if kind == "ties":
        x = rng.integers(0, 4, n).astype(np.float64)
    elif kind == "nan":
        x[rng.integers(0, n, 7)] = np.nan
    elif kind == "signed_zero_outlier":  # one huge load: every other rank in the first bucket
        x[rng.integers(0, n, 5)] = -0.0
        x[rng.integers(0, n, 5)] = 0.0
        x[int(rng.integers(0, n))] = 1e300
    elif kind == "inf":
        x[rng.integers(0, n, 3)] = np.inf
        x[int(rng.integers(0, n))] = -np.inf
    elif kind == "tiny_span":  # (n - 1) / span overflows
        x = np.zeros(n)
        x[rng.integers(0, n, 3)] = 1e-320
    elif kind == "all_nan":
        x = np.full(n, np.nan)
    out = np.empty(n, dtype=np.int64)
    _order_loads(x, out, np.empty(n, dtype=np.int64), np.empty(n + 2, dtype=np.int64))
    assert out.tolist() == np.argsort(x, kind="stable").tolist()


@pytest.mark.parametrize("seed", range(40))
def test_few_failed_items_are_placed_as_place_whole_step_places_them(seed: int) -> None:
    """_place_few (a round's <= 32 failed items, no allocations) leaves the same slot state and placements as
    place_whole_step: part-full ranks (some with no room), tied, infinite and NaN loads and costs, dp 1..64."""
    rng = np.random.default_rng(seed)
    dp = int(rng.choice([1, 2, 3, 4, 7, 8, 32, 33, 64] if seed % 10 != 9 else [33, 64]))
    mb, b, seq_len = int(rng.integers(1, 5)), 3, 64
    n = int(rng.integers(1, min(dp, 32) + 1))
    length = rng.integers(1, seq_len + 1, n).astype(np.int64)
    cost = rng.integers(0, 4, n).astype(np.float64) if seed % 2 else rng.random(n)
    room = rng.integers(0, seq_len + 1, (b, dp, mb)).astype(np.int64)
    room[:, rng.random(dp) < 0.3] = 0  # whole ranks without room
    cost3 = rng.integers(0, 3, (b, dp, mb)).astype(np.float64)
    rank_cost = cost3.sum(axis=2)
    if seed % 5 == 4:
        rank_cost[1, rng.integers(0, dp, 2)] = np.inf
        rank_cost[1, rng.integers(0, dp, 2)] = np.nan
        rank_cost[1, 0] = np.nan  # a NaN load before the least (the merge sort's order: NaN last)
        room[1, 0] = seq_len
        cost[rng.integers(0, n, 2)] = np.nan
    items = rng.permutation(n).astype(np.int64)
    states = [[cost3.copy(), room.copy(), rank_cost.copy(), np.full(n, -1), np.full(n, -1)] for _ in range(2)]
    place_whole_step(1, items.copy(), length, cost, *states[0])
    scratch = [np.empty(dp), np.empty(dp), np.empty(dp, dtype=np.int64), np.empty(dp, dtype=bool)]
    _place_few(1, items.copy(), length, cost, *states[1], *scratch)
    for a, w in zip(states[1], states[0], strict=True):
        assert a.tobytes() == w.tobytes()


@pytest.mark.parametrize("seed", range(6))
def test_inf_and_signed_zero_costs_give_what_the_cost_sort_gives(seed: int) -> None:
    """inf (equal to itself: an equal-length tie of infs is accepted), -inf, and 0.0 next to -0.0 (equal: the
    lengths' order stands, as the radix sort's +0.0 for both zeros and the merge sort keep position order)."""
    rng = np.random.default_rng(seed)
    cut, _ = _steps(rng, 40, 40)
    n = int(cut[-1])
    length = rng.integers(0, 8, n).astype(np.int64)
    cost = segment_cost(length, None, SPECS["text"])
    if seed % 3 == 0:  # the longest items cost inf: each step still ordered by its lengths
        cost[length == 7] = np.inf
    elif seed % 3 == 1:  # some inf and -inf anywhere: those steps sorted on their costs
        cost[rng.random(n) < 0.05] = rng.choice(np.array([np.inf, -np.inf]))
    else:  # zero-length items cost 0.0 or -0.0
        cost[length == 0] = rng.choice(np.array([0.0, -0.0]), int((length == 0).sum()))
    got = by_length_order(cost, length, cut)
    assert np.array_equal(got, np.lexsort((-cost, np.repeat(np.arange(len(cut) - 1), np.diff(cut)))))
    assert np.array_equal(got, by_cost_order(cost, cut))
    assert np.array_equal(got, _steps_order(cost, cut))
