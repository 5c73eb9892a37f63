"""The planner's building blocks against simple reference implementations."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loomdata.planning import fit_cost, segment_cost
from loomdata.planning._packing import Lanes, expand_units, next_fit
from loomdata.schemas.spec import CostSpec


def _next_fit_reference(lengths: list[int], cap: int) -> list[int]:
    out, seq, used = [], 0, 0
    for n in lengths:
        if used and used + n > cap:
            seq, used = seq + 1, 0
        used += n
        out.append(seq)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=200), st.integers(50, 120))
def test_next_fit_matches_the_sequential_greedy(lengths: list[int], cap: int) -> None:
    got = next_fit(np.array(lengths, dtype=np.int64), cap)
    assert got.tolist() == _next_fit_reference(lengths, cap)


def test_expand_units_splits_long_documents_into_consecutive_segments() -> None:
    lengths = np.array([5, 10, 23, 0, 8], dtype=np.uint32)
    doc, off, ln = expand_units(np.array([2, 0, 1, 4]), lengths, Lanes(seq_len=10))
    assert doc.tolist() == [2, 2, 2, 0, 1, 4]
    assert off.tolist() == [0, 10, 20, 0, 0, 0]
    assert ln.tolist() == [10, 10, 3, 5, 10, 8]


def test_expand_units_uses_the_long_lane_capacity_above_the_threshold() -> None:
    lanes = Lanes(seq_len=10, long_seq_len=40, threshold=12, long_cp=2)
    lengths = np.array([12, 13, 90], dtype=np.uint32)
    doc, off, ln = expand_units(np.array([0, 1, 2]), lengths, lanes)
    assert doc.tolist() == [0, 0, 1, 2, 2, 2]
    assert ln.tolist() == [10, 2, 13, 40, 40, 10]
    assert off.tolist() == [0, 10, 0, 0, 40, 80]
    assert lanes.lane_of(lengths).tolist() == [0, 1, 1]


def test_segment_cost_is_the_documented_formula() -> None:
    c = CostSpec(attention=2.0, linear=3.0, encoder=5.0)
    got = segment_cost(np.array([4, 10]), np.array([1, 0]), c, np.array([1, 2]))
    assert got.tolist() == [2 * 16 + 3 * 4 + 5 * 1, (2 * 100 + 3 * 10) / 2]


def _check_assignment(asg: object, length: np.ndarray, seq_len: int, dp: int, mb: int) -> None:
    item, plen = asg.item, asg.length  # type: ignore[attr-defined]
    assert np.bincount(item, weights=plen, minlength=len(length)).tolist() == length.tolist()  # every token once
    slot = asg.rank * mb + asg.micro_batch  # type: ignore[attr-defined]
    assert np.bincount(slot, weights=plen, minlength=dp * mb).max() <= seq_len
    assert (np.diff(slot) >= 0).all()


def test_balance_step_moves_text_out_to_keep_an_image_sample_whole() -> None:
    from loomdata.planning.balance import balance_step

    length = np.array([55, 55, 30, 30, 25])
    cost = np.array([6.0, 6.0, 3.0, 3.0, 0.5])  # the image sample comes last, when no slot has 25 free
    splittable = np.array([True, True, True, True, False])
    asg = balance_step(
        length,
        cost,
        np.zeros(5, dtype=np.uint8),
        splittable,
        dp=1,
        micro_batches=2,
        lanes=Lanes(seq_len=100),
        cost_spec=CostSpec(),
    )
    _check_assignment(asg, length, 100, 1, 2)
    assert asg.item.tolist().count(4) == 1 and asg.length[asg.item.tolist().index(4)] == 25


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 100), min_size=1, max_size=120),
    st.integers(1, 6),
    st.integers(1, 4),
)
def test_balance_step_places_every_token_once_within_capacity(lengths: list[int], dp: int, mb: int) -> None:
    from loomdata.planning.balance import balance_step

    length = np.array(lengths)
    cap = 100
    length = length[np.cumsum(length) <= int(0.96 * dp * mb * cap)]  # what membership guarantees
    if len(length) == 0:
        return
    cost = segment_cost(length, None, CostSpec(attention=1.0, linear=50.0))
    asg = balance_step(
        length,
        cost,
        np.zeros(len(length), dtype=np.uint8),
        np.ones(len(length), dtype=bool),
        dp=dp,
        micro_batches=mb,
        lanes=Lanes(seq_len=cap),
        cost_spec=CostSpec(attention=1.0, linear=50.0),
    )
    _check_assignment(asg, length, cap, dp, mb)
    lb = max(cost.sum() / dp, cost.max())
    assert asg.rank_cost.max() >= lb * (1 - 1e-9) or (asg.length < length[asg.item]).any()


def test_balance_step_defers_an_image_sample_no_slot_can_hold() -> None:
    from loomdata.planning.balance import balance_step

    length = np.array([40, 40, 40, 10])
    asg = balance_step(
        length,
        segment_cost(length, None, CostSpec()),
        np.zeros(4, dtype=np.uint8),
        np.array([False, False, False, True]),
        dp=1,
        micro_batches=2,
        lanes=Lanes(seq_len=64),
        cost_spec=CostSpec(),
    )
    assert asg.deferred.tolist() == [[2, 0, 40]]  # whole, for the next step
    assert sorted(asg.item.tolist()) == [0, 1, 3]


def test_fit_cost_recovers_the_coefficients_from_measured_times() -> None:
    rng = np.random.default_rng(0)
    runs = [rng.integers(1, 4000, rng.integers(1, 12)) for _ in range(60)]
    images = [np.where(rng.random(len(r)) < 0.3, rng.integers(0, 500, len(r)), 0) for r in runs]
    true = CostSpec(attention=1.0, linear=24576.0, encoder=200.0)
    secs = np.array([segment_cost(r, i, true).sum() for r, i in zip(runs, images, strict=True)]) * 1e-12
    secs *= 1 + rng.normal(0, 1e-3, len(secs))  # measurement noise
    got = fit_cost(runs, secs, images)
    assert got.attention == 1.0
    assert abs(got.linear / 24576.0 - 1) < 0.02 and abs(got.encoder / 200.0 - 1) < 0.05


def test_fit_cost_rejects_mismatched_input() -> None:
    import pytest

    from loomdata.schemas.errors import PlanError

    with pytest.raises(PlanError, match="one list of segment lengths per measured time"):
        fit_cost([np.array([10])], [0.1, 0.2])
