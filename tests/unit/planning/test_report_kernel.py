"""The summary's mixture error without the full share tables (mixture_error(full=False)): the same per-step
errors and last-step shares, bit for bit, as the full pass (which plot_plan uses), with and without budgets."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._report import mixture_error


@pytest.mark.parametrize("budgets", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (300, 40), (0, 2)])
def test_last_rows_only_are_the_full_passs_last_rows(shape: tuple[int, int], budgets: bool) -> None:
    rng = np.random.default_rng(shape[0])
    tokens = rng.integers(0, 5000, shape).astype(np.int64)
    tokens[: min(2, shape[0])] = 0  # leading steps with nothing placed (a zero total)
    weights = rng.random(shape)
    weights /= np.maximum(weights.sum(axis=1, keepdims=True), 1e-12)
    b = rng.integers(1, 1000, shape[0]).astype(np.float64) if budgets else None
    err, realized, target = mixture_error(tokens, weights, b)
    err1, realized1, target1 = mixture_error(tokens, weights, b, full=False)
    assert err1.tobytes() == err.tobytes()
    assert realized1.shape == (min(shape[0], 1), shape[1]) and target1.shape == realized1.shape
    assert realized1.tobytes() == realized[-1:].tobytes() and target1.tobytes() == target[-1:].tobytes()


def _numpy_mixture_error(
    tokens: np.ndarray, weights: np.ndarray, budgets: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mixture error in NumPy passes down the steps (the oracle): cumulative shares and their worst gap."""
    cum = np.cumsum(tokens, axis=0)
    tot = cum.sum(axis=1)
    realized = cum / np.where(tot > 0, tot, 1).astype(np.float64)[:, None]
    if budgets is None:
        target = np.cumsum(weights, axis=0) / np.arange(1, len(tokens) + 1, dtype=np.float64)[:, None]
    else:
        target = np.cumsum(weights * budgets[:, None], axis=0) / np.maximum(np.cumsum(budgets), 1.0)[:, None]
    err = np.abs(realized - target).max(axis=1, initial=0.0) * 100.0
    return err, realized, target


@pytest.mark.parametrize("budgets", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (9, 4), (500, 300), (0, 3), (2000, 1)])
def test_mixture_error_is_numpys_on_step_and_source_major_grids(shape: tuple[int, int], budgets: bool) -> None:
    """The compiled source-major pass gives the NumPy passes' bits, from a step-major grid (the plot's) and from
    a source-major one (the report's own layout, read without a copy)."""
    rng = np.random.default_rng(shape[0] + 7)
    tokens = rng.integers(0, 9000, shape).astype(np.int64)
    tokens[: min(3, shape[0])] = 0
    weights = rng.random(shape)
    b = rng.integers(1, 1000, shape[0]).astype(np.float64) if budgets else None
    want = _numpy_mixture_error(tokens, weights, b)
    for t, w in ((tokens, weights), (np.asfortranarray(tokens), np.asfortranarray(weights))):
        got = mixture_error(t, w, b)
        for g, x in zip(got, want, strict=True):
            assert g.shape == x.shape and np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(x).tobytes()
