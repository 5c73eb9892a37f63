"""The compiled natural steps of a run of positions (_lookahead_kernel.run_steps) against the NumPy forms they
replace: each step repeated by how many positions fall in it, and one binary search per position."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._lookahead_kernel import run_steps


def _repeat_steps(col: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The NumPy code run_steps replaced (_lookahead._steps_of_run before it was compiled)."""
    ta, tb = (int(x) for x in np.searchsorted(col, [lo, hi - 1], side="right") - 1)
    bounds = np.empty(tb - ta + 2, dtype=np.int64)
    bounds[0], bounds[-1] = lo, hi
    np.clip(col[ta + 1 : tb + 1], lo, hi, out=bounds[1:-1])
    return np.repeat(np.arange(ta, tb + 1, dtype=np.int64), np.diff(bounds))


@pytest.mark.parametrize("seed", range(30))
def test_run_steps_is_searchsorted_right_minus_one(seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps = int(rng.integers(1, 400))
    density = float(rng.choice([0.05, 0.3, 1.0, 4.0]))  # positions a step: sparse (many sources) to dense
    grid = np.zeros((steps + 1, 3), dtype=np.int64)
    grid[1:] = np.cumsum(rng.poisson(density, (steps, 3)), axis=0)
    col = grid[:, 1]  # a strided column of a pointer grid, as the look-ahead passes it
    end = int(col[-1])
    for lo, hi in [(0, end), (0, 1), (end // 3, end // 2 + 1), (end - 1, end), (end // 2, end // 2)]:
        lo, hi = max(lo, 0), max(hi, 0)
        got = run_steps(col, lo, hi)
        want = np.searchsorted(col, np.arange(lo, hi), side="right") - 1
        assert got.dtype == np.int64 and np.array_equal(got, want)
        if hi > lo:
            assert np.array_equal(got, _repeat_steps(col, lo, hi))


def test_run_steps_edges() -> None:
    col = np.array([0, 0, 3, 3, 3, 7], dtype=np.int64)  # empty steps at the start and in the middle
    assert run_steps(col, 0, 7).tolist() == [1, 1, 1, 4, 4, 4, 4]
    assert run_steps(col, 7, 9).tolist() == [5, 5]  # past the last pointer: the last row
    assert run_steps(col, 3, 3).tolist() == []
    assert run_steps(np.array([0], dtype=np.int64), 0, 2).tolist() == [0, 0]
