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
