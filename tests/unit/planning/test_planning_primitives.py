"""The planner's building blocks against simple reference implementations."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loomdata.planning import segment_cost
from loomdata.planning._packing import Lanes, expand_units, ffd_bins, next_fit
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


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=80), st.integers(100, 250))
def test_ffd_bins_respect_capacity_and_use_few_bins(lengths: list[int], cap: int) -> None:
    arr = np.array(lengths)
    bins = ffd_bins(arr, cap)
    load = np.bincount(bins, weights=arr)
    assert load.max() <= cap
    assert len(load) <= 2 * int(np.ceil(arr.sum() / cap)) + 1  # FFD uses at most ~11/9 OPT + 1 bins


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
