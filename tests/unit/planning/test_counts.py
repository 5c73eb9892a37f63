"""planning._counts: the report's sparse token counts read back as the dense table, whatever the puts' sizes."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning import _counts
from loomdata.planning._counts import DenseCounts, Pieces, SparseCounts


def _table(rng: np.random.Generator, steps: int, n_src: int, density: float, most: int) -> np.ndarray:
    cells = (rng.random((steps, n_src)) < density) * rng.integers(1, most + 1, (steps, n_src))
    return cells.astype(np.int64)


@pytest.mark.parametrize(
    ("seed", "steps", "n_src", "density", "most", "stage"),
    [
        (0, 500, 30, 0.2, 60_000, 64 * 30),
        (1, 900, 300, 0.05, 100, None),
        (2, 70_000, 1, 0.9, 70_000, None),  # one chunk of more than 65,536 steps, uint32 counts
        (3, 300, 4, 0.5, 2**34, 64 * 4),  # int64 counts
        (4, 200, 7, 0.0, 5, 64 * 7),  # all zero
    ],
)
def test_sparse_counts_are_the_dense_table(
    seed: int, steps: int, n_src: int, density: float, most: int, stage: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if stage is not None:
        monkeypatch.setattr(_counts, "STAGE_CELLS", stage)
    rng = np.random.default_rng(seed)
    want = _table(rng, steps, n_src, density, most)
    sparse, dense = SparseCounts(steps, n_src), DenseCounts(steps, n_src, 1000)
    t = 0
    while t < steps:  # puts of 1 to 150 steps, some steps skipped (left zero)
        n = min(steps - t, int(rng.integers(1, 150)))
        if rng.random() < 0.1:
            want[t : t + n] = 0
        else:
            sparse.put(t, want[t : t + n])
            dense.put(t, want[t : t + n])
        t += n
        if rng.random() < 0.05:
            assert sparse.dtype.kind in "ui"  # reading settles the staged rows; later puts go on after them
    for c in (sparse, dense):
        assert len(c) == steps
        assert np.array_equal(c.rows(0, steps), want)
        assert np.array_equal(c.source_totals(), want.sum(axis=0))
        assert np.iinfo(c.dtype).max >= want.max(initial=0)
        for _ in range(5):
            k0 = int(rng.integers(0, n_src))
            k1 = int(rng.integers(k0, n_src + 1))
            a = int(rng.integers(0, steps))
            b = int(rng.integers(a, steps + 1))
            got = c.source_rows(k0, k1, a, b)
            assert got.flags.c_contiguous and np.array_equal(got, want[a:b, k0:k1].T)
            # the nonzero cells of a run of steps, step-major, sources ascending within a step (both kinds)
            step, src, value = c.cells(a, b)
            at = np.nonzero(want[a:b])
            assert step.dtype == np.int64 and src.dtype == np.uint16 and value.dtype == np.int64
            assert np.array_equal(step, at[0] + a) and np.array_equal(src, at[1])
            assert np.array_equal(value, want[a:b][at])
    assert sparse.entries == int(np.count_nonzero(want))
    assert sparse.dtype == _counts.count_dtype(int(want.max(initial=0)))


def test_sparse_counts_refuse_rows_out_of_order() -> None:
    c = SparseCounts(10, 2)
    c.put(3, np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="step order"):
        c.put(4, np.ones((1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="beyond"):
        c.put(9, np.ones((2, 2), dtype=np.int64))
    assert c.rows(0, 10).sum(axis=1).tolist() == [0, 0, 0, 2, 2, 0, 0, 0, 0, 0]


def _pieces(rng: np.random.Generator, block: np.ndarray) -> _counts.Pieces:
    """A block's cells cut into pieces (each cell's count split in up to 3, in shuffled order within a step)."""
    step, src, count = [], [], []
    for t in range(len(block)):
        cells = []
        for k in np.flatnonzero(block[t]).tolist():
            v = int(block[t, k])
            cuts = np.sort(rng.integers(0, v + 1, int(rng.integers(0, 3))))
            cells += [(k, int(x)) for x in np.diff(np.concatenate([[0], cuts, [v]])) if x]
        if cells and rng.random() < 0.2:  # a piece of no tokens (a cell of its own source: none unless others)
            cells.append((int(rng.integers(0, block.shape[1])), 0))
        rng.shuffle(cells)  # type: ignore[arg-type]
        step += [t] * len(cells)
        src += [k for k, _ in cells]
        count += [x for _, x in cells]
    return _counts.Pieces(
        len(block), np.asarray(step, np.int64), np.asarray(src, np.uint16), np.asarray(count, np.int64)
    )


@pytest.mark.parametrize(
    ("seed", "steps", "n_src", "stage", "density"),
    [(0, 500, 30, 64 * 30, 0.1), (1, 700, 300, None, 0.1), (2, 400, 150, 50, 0.6), (3, 300, 9, None, 0.95)],
)
def test_put_pieces_is_put_of_their_cells(
    seed: int, steps: int, n_src: int, stage: int | None, density: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """put_pieces (the report's path from a block's placed pieces) stores what put of the summed cells does, for
    puts joined into chunks of `stage` cells and with steps skipped between them, in both kinds: steps touching
    few of the sources and most of them (more than 64: several bitmap words), pieces of 0 tokens left out."""
    if stage is not None:
        monkeypatch.setattr(_counts, "STAGE_CELLS", stage)
    rng = np.random.default_rng(seed)
    want = _table(rng, steps, n_src, density, 5000)
    sparse, dense = SparseCounts(steps, n_src), DenseCounts(steps, n_src, 1000)
    t = 0
    while t < steps:
        n = min(steps - t, int(rng.integers(1, 150)))
        if rng.random() < 0.1:
            want[t : t + n] = 0
        else:
            p = _pieces(rng, want[t : t + n])
            assert np.array_equal(p.dense(n_src), want[t : t + n])
            sparse.put_pieces(t, p)
            dense.put_pieces(t, p)
        t += n
    for c in (sparse, dense):
        assert np.array_equal(c.rows(0, steps), want)
        step, src, value = c.cells(0, steps)
        at = np.nonzero(want)
        assert np.array_equal(step, at[0]) and np.array_equal(src, at[1]) and np.array_equal(value, want[at])
    with pytest.raises(ValueError, match="step order"):
        sparse.put_pieces(0, _pieces(rng, want[:2]))


@pytest.mark.parametrize(
    ("step", "source", "match"),
    [
        ([70, 5, 90, 1], [0, 1, 2, 3], "ascending"),  # out of order: would be dropped or misplaced across stages
        ([0, 1, 100], [0, 0, 0], "ascending"),  # a step past the block: would land in the next source's column
        ([-1, 0], [0, 0], "ascending"),
        ([0, 1], [0, 4], "below 4"),  # a source past the table: the compiled adding would write outside it
        ([0, 1], [-1, 0], "below 4"),
    ],
)
def test_bad_pieces_are_refused_not_written_outside(step: list[int], source: list[int], match: str) -> None:
    """A piece outside the block (its step) or the table (its source) raises in both paths, before any write."""
    p = Pieces(100, np.array(step, dtype=np.int64), np.array(source, dtype=np.int64), np.ones(len(step), np.int64))
    with pytest.raises(ValueError, match=match):
        p.dense(4)
    sparse = SparseCounts(200, 4)
    with pytest.raises(ValueError, match=match):
        sparse.put_pieces(0, p)
    assert not sparse.rows(0, 200).any()
