"""The compiled membership passes and dealing order give NumPy's reference results bit for bit."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loomdata.planning import _mixture
from loomdata.planning._jit import stable_argsort, stable_argsort_into
from loomdata.planning._mixture import (
    CumulativeTargets,
    _nearest,
    membership,
    step_weights,
)
from loomdata.planning._mixture_kernel import nearest_column, nearest_run
from loomdata.planning.balance._deal_kernel import (
    RADIX_STEP,
    _radix_order,
    _steps_order,
    by_cost_order,
)
from loomdata.schemas import parse_spec
from loomdata.schemas.spec import Spec


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float64).view(np.int64)


def _spec(tmp_path: Path, n_src: int, steps: int, mixture: dict[str, Any]) -> Spec:
    names = [f"s{k}" for k in range(n_src)]
    raw = {
        "name": "kernels",
        "workdir": str(tmp_path),
        "sources": [{"name": n, "format": "parquet", "paths": ["x"], "tokens_field": "t"} for n in names],
        "mixture": mixture,
        "training": {"seq_len": 128, "steps": steps, "dp_size": 1, "micro_batches": 1},
    }
    return parse_spec(raw, tmp_path, check_paths=False)


def _reference_weights(spec: Spec) -> np.ndarray:
    """The interpolation over every step, normalised row by row (what step_weights computed before)."""
    ms = spec.mixture.milestones()
    xs = np.array([m.step for m in ms], dtype=np.float64)
    t = np.arange(spec.training.steps, dtype=np.float64)
    cols = [np.interp(t, xs, [float(m.weights.get(n, 0.0)) for m in ms]) for n in spec.source_names]
    w = np.stack(cols, 1)
    return w / w.sum(axis=1)[:, None]


def _targets(weights: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """The cumulative targets' definition: each step's weights times its budget, summed down the steps."""
    return np.cumsum(weights * budget[:, None], axis=0)


@pytest.mark.parametrize("seed", range(12))
def test_step_weights_match_the_interpolation_over_every_step(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_src, steps = int(rng.integers(1, 320)), int(rng.integers(2, 400))
    names = [f"s{k}" for k in range(n_src)]
    if seed % 3 == 0:  # one fixed mixture: every row is the held one
        mixture: dict[str, Any] = {"weights": {n: float(rng.random() * 3 + 0.01) for n in names}}
    else:  # a schedule: interpolated rows, then the last milestone's held
        at = sorted({0, *rng.integers(1, steps, int(rng.integers(1, 4))).tolist()})
        mixture = {"schedule": [{"step": s, "weights": {n: float(rng.random()) + 0.01 for n in names}} for s in at]}
    spec = _spec(tmp_path, n_src, steps, mixture)
    got, want = step_weights(spec), _reference_weights(spec)
    assert got.grid().shape == want.shape
    assert np.array_equal(_bits(got.grid()), _bits(want))
    # any block of rows or of sources, and any window's, is that block of the grid, bit for bit
    a = int(rng.integers(0, steps))
    b = int(rng.integers(a, steps + 1))
    k0 = int(rng.integers(0, n_src))
    k1 = int(rng.integers(k0 + 1, n_src + 1))
    assert np.array_equal(_bits(got.rows(a, b)), _bits(want[a:b]))
    assert np.array_equal(_bits(got.columns(k0, k1)), _bits(np.ascontiguousarray(want[:, k0:k1].T)))
    win = got.window(a, b)
    assert len(win) == b - a
    assert np.array_equal(_bits(win.grid()), _bits(want[a:b]))
    if b > a:
        assert np.array_equal(_bits(win.columns(k0, k1)), _bits(np.ascontiguousarray(want[a:b, k0:k1].T)))


@pytest.mark.parametrize("seed", range(6))
def test_cumulative_targets_by_blocks_are_the_grid_bit_for_bit(tmp_path: Path, seed: int) -> None:
    """CumulativeTargets' blocks of sources, runs of steps (each given the row before) and last row are the
    whole grid's, as membership uses them instead of the grid."""
    rng = np.random.default_rng(100 + seed)
    n_src, steps = int(rng.integers(1, 40)), int(rng.integers(2, 300))
    names = [f"s{k}" for k in range(n_src)]
    at = sorted({0, *rng.integers(1, steps, 2).tolist()})
    mixture = {"schedule": [{"step": s, "weights": {n: float(rng.random()) + 0.01 for n in names}} for s in at]}
    w = step_weights(_spec(tmp_path, n_src, steps, mixture))
    budget = rng.integers(1, 10**8, steps).astype(np.int64)
    want = _targets(w.grid(), budget)
    tg = CumulativeTargets(w, budget)
    k0 = int(rng.integers(0, n_src))
    assert np.array_equal(_bits(tg.columns(k0, n_src)), _bits(np.ascontiguousarray(want[:, k0:].T)))
    cuts = sorted({0, steps, *rng.integers(1, steps, 3).tolist()})
    before = None
    for a, b in itertools.pairwise(cuts):
        rows = tg.rows(a, b, before)
        assert np.array_equal(_bits(rows), _bits(want[a:b]))
        before = rows[-1]
    assert np.array_equal(_bits(tg.final()), _bits(want[-1]))


@pytest.mark.parametrize("kind", ["increasing", "integer_ties", "shuffled", "beyond_the_stream"])
def test_nearest_column_is_nearest_then_running_maximum(kind: str) -> None:
    rng = np.random.default_rng(len(kind))
    lengths = rng.integers(0, 5000, 3000)  # zero-length segments make runs of equal counts
    cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    x = np.cumsum(rng.random(700) * 9000.0)
    if kind == "integer_ties":
        j = rng.integers(0, len(cum) - 1, len(x) // 2)
        mid = (cum[j] + cum[j + 1]) / 2.0  # exactly between two counts: ties go to the shorter prefix
        x = np.sort(np.concatenate([np.round(x[: len(x) - len(mid)] / 1000.0) * 1000.0, mid]))
    elif kind == "shuffled":
        x = rng.permutation(x)
    elif kind == "beyond_the_stream":
        x = x * (cum[-1] / x[-1]) * 1.5
    want = np.zeros(len(x) + 1, dtype=np.int64)
    want[1:] = _nearest(cum, x)
    np.maximum.accumulate(want, out=want)
    got = np.zeros(len(x) + 1, dtype=np.int64)
    nearest_column(cum, np.ascontiguousarray(x), got)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_nearest_run_carried_across_pieces_is_the_whole_column(seed: int) -> None:
    """nearest_run over a source's targets cut into pieces, its search state carried, gives nearest_column's
    pointers (a search going back included: shuffled targets)."""
    rng = np.random.default_rng(seed)
    cum = np.concatenate([[0], np.cumsum(rng.integers(0, 4000, 2500))]).astype(np.int64)
    x = np.cumsum(rng.random(900) * 9000.0)
    if seed % 2:
        x = rng.permutation(x)
    want = np.zeros(len(x) + 1, dtype=np.int64)
    nearest_column(cum, x, want)
    got = np.zeros(len(x), dtype=np.int64)
    state = np.zeros(2, dtype=np.int64)
    cuts = sorted({0, len(x), *rng.integers(1, len(x), 6).tolist()})
    for a, b in itertools.pairwise(cuts):
        nearest_run(cum, x[a:b], got[a:b], state)
    assert np.array_equal(got, want[1:])


def test_membership_pointers_of_many_sources_are_each_sources_own(tmp_path: Path) -> None:
    """The grid laid out by source and back: column k of ptr is source k's (nearest, running maximum)."""
    from loomdata.planning._mixture import build_stream
    from loomdata.planning._packing import Lanes

    rng = np.random.default_rng(5)
    lanes = Lanes(seq_len=4096)
    streams = [build_stream(f"s{k}", 3, rng.integers(16, 3000, 2000).astype(np.uint32), lanes, 2) for k in range(5)]
    w = rng.random((60, 5))
    w /= w.sum(axis=1)[:, None]
    targets = _targets(w, np.full(60, 8 * 4096, dtype=np.int64))
    ptr = membership(targets, streams, lanes, 8, 8 * lanes.seq_len).dense()
    assert ptr.shape == (61, 5) and ptr.flags.c_contiguous
    for k, st in enumerate(streams):
        col = np.concatenate([[0], _nearest(st.cum, targets[:, k])])
        assert (ptr[:, k] <= np.maximum.accumulate(col)).all()  # the repair only defers
    assert (np.diff(ptr, axis=0) >= 0).all()


@pytest.mark.parametrize("cells", [5, 70 * 7, 100 * 7 + 5])
def test_membership_pointers_worked_out_a_chunk_of_steps_at_a_time_are_the_whole_grids(
    cells: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 64, 70 and 100 steps (REPAIR_CHUNK_CELLS over 7 sources, at least 64), repaired in windows of 40
    (the nearest search carried across chunks), give the pointers of one chunk, bit for bit."""
    from loomdata.planning import _mixture
    from loomdata.planning._packing import Lanes

    rng = np.random.default_rng(7)
    lanes = Lanes(seq_len=4096)
    streams = [
        _mixture.build_stream(f"s{k}", 3, rng.integers(16, 3000, 2000).astype(np.uint32), lanes, 2) for k in range(7)
    ]
    w = rng.random((200, 7))
    w /= w.sum(axis=1)[:, None]
    targets = _targets(w, np.full(200, 8 * 4096, dtype=np.int64))
    whole = membership(targets, streams, lanes, 8, 8 * lanes.seq_len)
    assert len(whole.chunks) == 1
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", cells)
    monkeypatch.setattr(_mixture, "REPAIR_WINDOW", 40)
    chunked = membership(targets, streams, lanes, 8, 8 * lanes.seq_len)
    assert len(chunked.chunks) > 4
    assert np.array_equal(chunked.dense(), whole.dense())


@pytest.mark.parametrize("seed", range(6))
def test_dealing_order_is_the_lexsort_by_step_then_largest_cost(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 60))
    ns = rng.integers(0, 90, b)  # steps of 0..89 items: insertion sort and merge sort both
    cut = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    step = np.repeat(np.arange(b), ns)
    cost = rng.integers(0, 4, len(step)).astype(np.float64) if seed % 2 else rng.random(len(step))  # ties, or not
    assert np.array_equal(by_cost_order(cost, cut), np.lexsort((-cost, step)))


@pytest.mark.parametrize("seed", range(8))
def test_radix_dealing_order_is_the_lexsort_by_step_then_largest_cost(seed: int) -> None:
    """The radix sort gives the lexsort on costs with ties, both zeros, infinities, negatives, subnormals and
    integer-valued costs (whose low key bits never differ: passes start where keys differ)."""
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 12))
    ns = rng.integers(0, 3 * RADIX_STEP, b)
    cut = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    step = np.repeat(np.arange(b), ns)
    n = len(step)
    pool = np.array([0.0, -0.0, np.inf, -np.inf, 5e-324, -5e-324, 1.0, -1.0, 2.0**60, 3.0])
    kind = seed % 4
    if kind == 0:
        cost = rng.integers(0, 2**27, n).astype(np.float64) * (1 if seed % 8 else 2.0**-30)
    elif kind == 1:
        cost = rng.choice(pool, n)
    elif kind == 2:
        cost = rng.standard_normal(n) * 10.0 ** rng.integers(-300, 300, n)
    else:
        cost = rng.integers(0, 5, n).astype(np.float64)  # few values: most key bits alike
    want = np.lexsort((-cost, step))
    assert np.array_equal(_radix_order(cost, cut), want)
    assert np.array_equal(_steps_order(cost, cut), want)
    assert np.array_equal(by_cost_order(cost, cut), want)


def test_radix_dealing_order_leaves_nan_to_the_step_by_step_sort() -> None:
    cost = np.linspace(1.0, 2.0, 2 * RADIX_STEP)
    cost[7] = np.nan
    cut = np.array([0, len(cost)], dtype=np.int64)
    assert len(_radix_order(cost, cut)) == 0
    assert np.array_equal(by_cost_order(cost, cut), _steps_order(cost, cut))


@pytest.mark.parametrize("n", [1, 2, 4, 31, 32, 33, 64, 1024])
def test_stable_argsort_into_a_buffer_is_numpys_stable_argsort(n: int) -> None:
    """The rank order a dealing round writes into its buffer: np.argsort(kind="stable"), ties by rank."""
    rng = np.random.default_rng(n)
    out = np.full(n, -1, dtype=np.int64)
    for x in (rng.integers(0, 3, n).astype(np.float64), rng.random(n), np.zeros(n), -np.arange(n, dtype=np.float64)):
        stable_argsort_into(x, out)
        assert np.array_equal(out, np.argsort(x, kind="stable"))
        assert np.array_equal(stable_argsort(x), out)


def _random_mixture(rng: np.random.Generator, n_src: int, steps: int, *, held: bool) -> dict[str, Any]:
    """Random weights for n_src sources: one milestone (held: every row the same) or a schedule of up to 3."""
    names = [f"s{k}" for k in range(n_src)]
    if held:
        return {"weights": {n: float(rng.random()) + 0.01 for n in names}}
    at = sorted({0, *rng.integers(1, steps // 2, 2).tolist()})
    return {"schedule": [{"step": s, "weights": {n: float(rng.random()) + 0.01 for n in names}} for s in at]}


@pytest.mark.parametrize("seed", range(6))
def test_final_targets_over_held_chunks_are_the_grids_last_row(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """final() sums chunks whose weights are all the held last row in one compiled pass (held_targets), chunks of
    64 steps here (the grid's last row bit for bit: interpolated chunks before, held ones after, a chunk that
    changes from one to the other, constant weights held from step 0, and a window's)."""
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", 1)  # 64 steps a chunk
    rng = np.random.default_rng(200 + seed)
    n_src, steps = int(rng.integers(1, 40)), int(rng.integers(65, 700))
    mixture = _random_mixture(rng, n_src, steps, held=seed % 3 == 0)  # held: one milestone, every row held
    w = step_weights(_spec(tmp_path, n_src, steps, mixture))
    budget = rng.integers(1, 10**8, steps).astype(np.int64)
    want = _targets(w.grid(), budget)
    assert np.array_equal(_bits(CumulativeTargets(w, budget).final()), _bits(want[-1]))
    a = int(rng.integers(0, steps - 64))
    win = CumulativeTargets(w.window(a, steps), budget[a:])
    assert np.array_equal(_bits(win.final()), _bits(_targets(w.grid()[a:], budget[a:])[-1]))


@pytest.mark.parametrize("seed", range(4))
def test_rows_and_columns_are_the_rows_and_their_transpose(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rows_and_columns (membership's targets: held chunks in one compiled pass) gives rows() and its transpose
    bit for bit, chunk after chunk, each given the row before."""
    rng = np.random.default_rng(300 + seed)
    n_src, steps = int(rng.integers(1, 40)), int(rng.integers(65, 500))
    mixture = _random_mixture(rng, n_src, steps, held=seed % 2 == 0)
    w = step_weights(_spec(tmp_path, n_src, steps, mixture))
    budget = rng.integers(1, 10**8, steps).astype(np.int64)
    want = _targets(w.grid(), budget)
    tg = CumulativeTargets(w, budget)
    before = None
    for a in range(0, steps, 37):
        b = min(steps, a + 37)
        rows, cols = tg.rows_and_columns(a, b, before)
        assert np.array_equal(_bits(rows), _bits(want[a:b]))
        assert np.array_equal(_bits(cols), _bits(np.ascontiguousarray(want[a:b].T)))
        before = rows[-1]
