"""planning._pointers: the sparse stream pointers read back exactly as the dense (steps + 1, sources) table."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._pointers import Pointers, chunk_of_changes, compress_rows


def _dense(rng: np.random.Generator, steps: int, n_src: int, draws: float, dtype: type = np.int32) -> np.ndarray:
    """A random pointer table: row 0 zeros, each column non-decreasing, a source drawing in a step with
    probability `draws` (a few segments when it does)."""
    step_draws = (rng.random((steps, n_src)) < draws) * rng.integers(1, 5, (steps, n_src))
    out = np.zeros((steps + 1, n_src), dtype=dtype)
    np.cumsum(step_draws, axis=0, out=out[1:])
    return out


@pytest.mark.parametrize(
    ("seed", "steps", "n_src", "draws", "chunk_rows"),
    [
        (0, 300, 7, 0.2, 64),
        (1, 1000, 40, 0.05, 17),
        (2, 50, 300, 0.2, None),
        (3, 200, 1, 0.9, 1),
        (4, 70_000, 2, 0.5, None),  # a chunk of more than 65,536 steps: int32 local steps
        (5, 120, 5, 0.0, 30),  # nothing drawn
        (6, 40, 3, 1.0, None),  # a source drawing more than 65,535 segments in a chunk: uint32 offsets
    ],
)
def test_sparse_pointers_read_back_as_the_dense_table(
    seed: int, steps: int, n_src: int, draws: float, chunk_rows: int | None
) -> None:
    rng = np.random.default_rng(seed)
    ptr = _dense(rng, steps, n_src, draws)
    if seed == 6:
        ptr[1:, 1] += 70_000
    sp = Pointers.from_dense(ptr, chunk_rows)
    if seed == 6:
        assert sp.chunks[0].end.dtype == np.uint32
    assert sp.shape == ptr.shape and len(sp) == steps + 1 and sp.dtype == ptr.dtype
    assert np.array_equal(sp.dense(), ptr)
    assert sp.entries == int(np.count_nonzero(np.diff(ptr, axis=0)))  # only the cells that draw
    assert np.array_equal(sp.totals(), ptr.sum(axis=1, dtype=np.int64))
    assert np.array_equal(sp.last(), ptr[-1]) and np.array_equal(sp.row(-1), ptr[-1])
    for t in {0, 1, steps // 3, steps - 1, steps, *rng.integers(0, steps + 1, 20).tolist()}:
        assert np.array_equal(sp.row(t), ptr[t]), t
    for k in range(min(n_src, 6)):
        assert np.array_equal(sp.column(k), ptr[:, k])
        for _ in range(5):
            t0 = int(rng.integers(0, steps + 1))
            t1 = int(rng.integers(t0, steps + 1))
            assert np.array_equal(sp.column(k, t0, t1), ptr[t0 : t1 + 1, k]), (k, t0, t1)


@pytest.mark.parametrize("seed", range(4))
def test_a_window_of_the_pointers_is_the_dense_rows_rebased(seed: int) -> None:
    """window(first, stop, lo) == ptr[first : stop + 1] - lo (int64), whatever chunk bounds the range crosses."""
    rng = np.random.default_rng(seed)
    steps, n_src = int(rng.integers(1, 400)), int(rng.integers(1, 30))
    ptr = _dense(rng, steps, n_src, float(rng.random()))
    sp = Pointers.from_dense(ptr, int(rng.integers(1, 80)))
    for _ in range(8):
        first = int(rng.integers(0, steps + 1))
        stop = int(rng.integers(first, steps + 1))
        lo = None if rng.random() < 0.5 else rng.integers(-5, 50, n_src)
        want = ptr[first : stop + 1].astype(np.int64) - (ptr[first] if lo is None else lo)[None, :]
        win = sp.window(first, stop, lo)
        assert win.shape == want.shape
        assert np.array_equal(win.dense(), want)
        assert np.array_equal(win.totals(), want.sum(axis=1))
        if stop > first:
            t = int(rng.integers(0, stop - first + 1))
            assert np.array_equal(win.row(t), want[t])
            assert np.array_equal(win.column(0, 0, stop - first), want[:, 0])


def test_compressed_rows_keep_a_base_row_and_only_the_changes() -> None:
    rows = np.array([[5, 0, 2], [5, 1, 2], [6, 1, 2], [6, 1, 2], [9, 4, 2]], dtype=np.int64)
    c = compress_rows(rows, 10)
    assert c.first == 10 and c.rows == 4
    assert c.base.tolist() == [5, 0, 2] and c.indptr.tolist() == [0, 2, 4, 4]
    assert c.step.dtype == np.uint16 and c.step.tolist() == [1, 3, 0, 3]
    assert c.end.dtype == np.uint16 and c.end.tolist() == [1, 4, 1, 4]  # offsets from the base row
    for i in range(5):
        assert c.row(i).tolist() == rows[i].tolist()


def test_pointers_pickle_and_align() -> None:
    import pickle

    rng = np.random.default_rng(9)
    ptr = _dense(rng, 90, 4, 0.3)
    sp = pickle.loads(pickle.dumps(Pointers.from_dense(ptr, 25)))
    assert np.array_equal(sp.aligned().dense(), ptr)


def test_a_row_outside_the_table_is_refused() -> None:
    sp = Pointers.from_dense(np.zeros((4, 2), dtype=np.int32))
    with pytest.raises(IndexError):
        sp.row(4)
    with pytest.raises(IndexError):
        sp.column(0, 0, 6)  # rows past the last (before: uninitialised values)
    with pytest.raises(IndexError):
        sp.column(0, -1, 2)
    assert sp.column(1, 0, 3).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("seed", "steps", "n_src", "draws", "chunk_rows"),
    [(0, 300, 7, 0.2, 64), (1, 1000, 40, 0.05, 17), (3, 200, 1, 0.9, 1), (6, 40, 3, 1.0, None), (7, 90, 4, 0.0, 9)],
)
def test_run_steps_from_the_drawing_steps_are_the_columns_binary_search(
    seed: int, steps: int, n_src: int, draws: float, chunk_rows: int | None
) -> None:
    """run_steps_into (the look-ahead's natural steps of a fresh plan) writes searchsorted(column, v, "right") - 1
    (+ shift) for every drawn position of any run, and says False where a run goes past what the steps draw."""
    rng = np.random.default_rng(seed)
    ptr = _dense(rng, steps, n_src, draws)
    if seed == 6:
        ptr[1:, 1] += 70_000  # uint32 offsets
    sp = Pointers.from_dense(ptr, chunk_rows)
    for k in range(n_src):
        last = int(ptr[-1, k])
        runs = [(0, last), (last // 3, last // 2), (last, last)] + [
            tuple(sorted(rng.integers(0, last + 1, 2).tolist())) for _ in range(4)
        ]
        for lo, hi in runs:
            out = np.full(hi - lo, -99, dtype=np.int32)
            assert sp.run_steps_into(k, lo, hi, out, shift=-3)
            want = np.searchsorted(ptr[:, k], np.arange(lo, hi), side="right") - 1 - 3
            assert np.array_equal(out, want), (k, lo, hi)
        out = np.zeros(2, dtype=np.int32)
        assert not sp.run_steps_into(k, last, last + 2, out)  # no step draws from the last row's pointer on


def test_released_pointers_keep_their_length_and_refuse_reads() -> None:
    """What a one-process look-ahead plan balances with: the pointers' length, no chunks; any read raises."""
    ptr = _dense(np.random.default_rng(9), 50, 4, 0.3)
    rel = Pointers.from_dense(ptr, 16).released()
    assert len(rel) == len(ptr) and rel.steps == 50 and rel.nbytes == 0
    for read in (
        lambda: rel.row(3),
        lambda: rel.column(1),
        lambda: rel.totals(),
        lambda: rel.window(0, 10),
        lambda: rel.run_steps_into(0, 0, 1, np.zeros(1, dtype=np.int64)),
        lambda: rel.last(),
    ):
        with pytest.raises(ValueError, match="released"):
            read()


def test_pointers_released_in_place_refuse_reads_wherever_held() -> None:
    """release() lets the chunks go for every holder (the look-ahead's caller too); reads then raise."""
    dense = _dense(np.random.default_rng(10), 40, 3, 0.5)
    ptr = Pointers.from_dense(dense, 16)
    held = [ptr]
    assert np.array_equal(held[0].row(7), dense[7])
    ptr.release()
    assert held[0].nbytes == 0 and len(held[0]) == 41
    out = np.empty(4, dtype=np.int32)
    reads = (
        lambda: held[0].row(7),
        lambda: held[0].totals(),
        lambda: held[0].window(0, 5),
        lambda: held[0].column(0),
        lambda: held[0].shape,
        lambda: held[0].run_steps_into(0, 0, 4, out),
    )
    for read in reads:
        with pytest.raises(ValueError, match="released"):
            read()
    assert len(ptr.released()) == 41


@pytest.mark.parametrize(
    ("seed", "steps", "n_src", "draws", "dtype"),
    [
        (0, 300, 7, 0.2, np.int32),
        (1, 70_000, 3, 0.3, np.int32),  # int32 local steps
        (2, 40, 3, 1.0, np.int64),  # uint32 offsets
        (3, 120, 5, 0.0, np.int32),  # no change
        (4, 500, 300, 0.05, np.int64),
    ],
)
def test_a_chunk_of_changes_is_the_compressed_dense_rows(
    seed: int, steps: int, n_src: int, draws: float, dtype: type
) -> None:
    """chunk_of_changes (the held pass's changes in step order, laid out by source in one compiled pass) gives the
    very arrays, dtypes included, of compress_rows over the dense rows they describe."""
    rng = np.random.default_rng(seed)
    dense = _dense(rng, steps, n_src, draws, dtype)
    if seed == 2:
        dense[1:] *= 30_000  # offsets past 65,535
    dense += rng.integers(0, 1000, n_src).astype(dtype)  # a base row that is not zeros
    t, k = np.nonzero(dense[1:] != dense[:-1])  # in step order, sources ascending within a step
    order = np.lexsort((rng.random(len(t)), t))  # any source order within a step
    t, k = t[order], k[order]
    got = chunk_of_changes(dense[0].copy(), steps, 11, t.astype(np.int32), k.astype(np.int32), dense[t + 1, k])
    want = compress_rows(dense, 11)
    assert (got.first, got.rows) == (want.first, want.rows)
    for name in ("base", "indptr", "step", "end"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b)
