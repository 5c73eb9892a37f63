"""The summary's mixture error without the full share tables (mixture_error(full=False)): the same per-step
errors and last-step shares, bit for bit, as the full pass (which plot_plan uses), with and without budgets; the
report's own pass over its sparse cells (ReportBuilder._mixture_error) gives the same bits again."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loomdata.planning import _mixture, _report
from loomdata.planning._mixture import StepWeights
from loomdata.planning._report import ReportBuilder, mixture_error
from loomdata.planning._report_kernel import run_sums


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


def _segment_sums_numpy(values: np.ndarray, off: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """_step._segment_sums before run_sums (the oracle): the runs of each length gathered into one (runs,
    length) array, summed and maxed along its rows."""
    n = np.diff(off)
    total, top = np.zeros(len(n)), np.zeros(len(n))
    for size in np.unique(n).tolist():
        runs = np.flatnonzero(n == size)
        grid = values[off[runs][:, None] + np.arange(size)]
        total[runs] = np.add.reduce(grid, axis=1)
        top[runs] = grid.max(axis=1)
    return total, top


@pytest.mark.parametrize("kind", ["costs", "wide", "signed", "zeros"])
def test_run_sums_are_each_runs_own_sum_and_max(kind: str) -> None:
    """Each step's cost total and largest segment: NumPy's pairwise sums bit for bit (runs of 1 to 40,001 values,
    across the unrolled block and the halving above 128), and the old grouped NumPy code's."""
    rng = np.random.default_rng(len(kind))
    sizes = np.array([*range(1, 300), 511, 512, 513, 1023, 1025, 8191, 8192, 8193, 20_000, 40_001] * 2)
    rng.shuffle(sizes)
    n = int(sizes.sum())
    if kind == "costs":
        values = rng.integers(1, 4000, n).astype(np.float64) ** 2
    elif kind == "wide":
        values = rng.random(n) * 10.0 ** rng.integers(-8, 12, n)
    elif kind == "signed":
        values = rng.standard_normal(n)
    else:
        values = np.where(rng.random(n) < 0.5, -0.0, 0.0)
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total, top = run_sums(values, off)
    runs = list(itertools.pairwise(off.tolist()))
    assert total.tobytes() == np.array([values[a:b].sum() for a, b in runs]).tobytes()
    old_total, old_top = _segment_sums_numpy(values, off)
    assert total.tobytes() == old_total.tobytes()
    if kind == "zeros":  # which zero a max of both zeros gives is NumPy's SIMD order (a cost is never -0.0)
        assert np.array_equal(top, old_top)
    else:
        assert top.tobytes() == np.array([values[a:b].max() for a, b in runs]).tobytes() == old_top.tobytes()


def test_run_sums_refuse_an_empty_run() -> None:
    total, top = run_sums(np.ones(4), np.array([0, 2, 2, 4], dtype=np.int64))
    assert len(total) == 0 and len(top) == 0


def _schedule(rng: np.random.Generator, n_src: int, steps: int, milestone: int | None) -> StepWeights:
    """A fixed mixture (milestone None) or random weights at step 0 moving to others at `milestone`, held after."""
    if milestone is None:
        xs, ys = np.zeros(1), rng.random((1, n_src)) + 0.01
    else:
        xs, ys = np.array([0.0, float(milestone)]), rng.random((2, n_src)) + 0.01
    held = int(min(max(np.ceil(xs[-1]), 0), steps))
    sums = np.array([_mixture._interpolated(xs, ys, a, a + 1).sum() for a in range(held)])
    return StepWeights(xs, ys, ys[-1] / ys[-1].sum(), sums, held, 0, steps)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("budgets", [False, True])
@pytest.mark.parametrize(
    ("steps", "n_src", "milestone", "seeded"),
    [
        (300, 40, 116, 0),
        (300, 9, 115, 0),
        (257, 7, None, 0),
        (200, 300, 50, 92),
        (1, 3, None, 0),
        (500, 5, 600, 130),
        (0, 4, None, 0),
    ],
)
def test_the_reports_mixture_error_over_its_cells_is_the_dense_pass(
    steps: int,
    n_src: int,
    milestone: int | None,
    seeded: int,
    budgets: bool,
    sparse: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ReportBuilder's mixture error, one pass down the steps over the counts' nonzero cells in blocks of steps
    (the steady weight row shared, a re-plan's base weights first), gives mixture_error's bits on the dense
    (steps, sources) tables: every step's worst error and the last step's shares."""
    monkeypatch.setattr(_report, "WEIGHT_BLOCK_CELLS", n_src * 23)  # blocks of 23 steps (115 = 5 x 23)
    rng = np.random.default_rng(steps + n_src)
    tokens = ((rng.random((steps, n_src)) < 0.2) * rng.integers(1, 70_000, (steps, n_src))).astype(np.int64)
    tokens[: min(2, steps)] = 0  # leading steps with nothing placed
    w = _schedule(rng, n_src, steps, milestone)
    b = rng.integers(1, 1000, steps).astype(np.float64) if budgets else None
    names = [f"s{k}" for k in range(n_src)]
    r = ReportBuilder(steps, names, 2, weights=w, budgets=b, sparse=sparse)
    grid = w.grid()
    if seeded:  # a re-plan: its base's counts and weights of the steps before its resume step
        base = rng.random((seeded, n_src))
        rows = {f"tokens__{n}": tokens[:seeded, k] for k, n in enumerate(names)}
        r.seed({**rows, **{f"weight__{n}": base[:, k] for k, n in enumerate(names)}}, seeded)
        grid[:seeded] = base
    r.tokens.put(seeded, tokens[seeded:])
    got = r._mixture_error()
    want = mixture_error(tokens, grid, b, full=False)
    for g, x in zip(got, want, strict=True):
        assert g.shape == x.shape and g.tobytes() == x.tobytes()
    assert float(want[0].max(initial=0.0)) > 0.0 or steps < 3  # the errors compared are not all zero
