"""The report's tokens of each source in each step, a (steps, sources) table of integers, dense or sparse.

With many sources and a small dp a step places tokens of a few of them (300 sources at dp 4: about 60 a step), and the
dense table grows with steps x sources (166K steps x 300 sources of uint16 at 10M samples: 10 bytes a sample).
`SparseCounts` (the plan's report, filled in step order) keeps the nonzero cells step-major, sources ascending within a
step (the order report/sources.parquet stores them in): each step's number of cells (uint32), and per cell its source
(uint16) and count (the narrowest type of the largest of its put: 4 bytes a cell at dp 4); a large put's cells are a
chunk of their own, small ones are joined into a chunk every STAGE_CELLS cells. A block's placed pieces are summed into
its cells directly (_counts_kernel.piece_cells: a row of the sources in cache, no dense block of the steps), so writing
the report reads them as stored and the summary's mixture error runs over them step by step
(_report_kernel.mixture_steps) without rows of sources made dense. `DenseCounts` (a range's report, whose rows a fix-up
may rewrite) is the source-major grid, widened when a count does not fit its type. Both read back the same values: a run
of steps' cells, rows of sources over a run of steps, each source's total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning._counts_kernel import dense_cells, piece_cells, source_sums

__all__ = ["STAGE_CELLS", "DenseCounts", "Pieces", "SparseCounts", "StepCounts", "count_dtype"]

STAGE_CELLS = 1 << 20
"""Nonzero cells a SparseCounts gathers from small puts before joining them into a chunk (a put of an eighth of
this or more is a chunk of its own)."""
_UINT32_MAX = int(np.iinfo(np.uint32).max)


def count_dtype(most: int) -> type[np.uint16] | type[np.uint32] | type[np.int64]:
    """The narrowest of uint16, uint32 and int64 that holds counts up to `most`."""
    if most <= np.iinfo(np.uint16).max:
        return np.uint16
    return np.uint32 if most <= _UINT32_MAX else np.int64


@dataclass(frozen=True, slots=True)
class Pieces:
    """A block of `steps` consecutive steps' counts as pieces: each one's step within the block (ascending),
    source and count; a (step, source) cell's count is the sum of its pieces'."""

    steps: int
    step: np.ndarray  # int64
    source: np.ndarray  # integer source ids
    count: np.ndarray  # int64

    def check(self, n_sources: int) -> None:
        """Raise ValueError unless every piece's step is within the block and ascending and its source below
        `n_sources` (the compiled adding checks no bounds: a bad piece would write outside its rows)."""
        step, src = self.step, self.source
        if len(step) == 0:
            return
        if step[0] < 0 or step[-1] >= self.steps or (len(step) > 1 and bool(np.any(step[1:] < step[:-1]))):
            raise ValueError(f"pieces' steps must be ascending within the block's {self.steps} steps")
        if int(src.min()) < 0 or int(src.max()) >= n_sources:
            raise ValueError(f"pieces' sources must be below {n_sources}, got {int(src.min())}..{int(src.max())}")

    def dense(self, n_sources: int) -> np.ndarray:
        """(steps, n_sources) int64: the block's cells."""
        self.check(n_sources)
        by_src = self.source.astype(np.int64) * self.steps + self.step
        cells = np.bincount(by_src, weights=self.count, minlength=self.steps * n_sources)
        return cells.astype(np.int64).reshape(n_sources, self.steps).T


class StepCounts:
    """(steps, sources) integer counts: what the report reads of them."""

    steps: int
    n_sources: int

    def __len__(self) -> int:
        return self.steps

    def put(self, first: int, block: np.ndarray) -> None:
        """Rows first..first+len(block)-1 := block ((n, sources) non-negative integers)."""
        raise NotImplementedError

    def put_pieces(self, first: int, pieces: Pieces) -> None:
        """Rows first..first+pieces.steps-1 := the cells of `pieces` (put of their dense block)."""
        self.put(first, pieces.dense(self.n_sources))

    def source_rows(self, k0: int, k1: int, a: int = 0, b: int | None = None) -> np.ndarray:
        """(k1 - k0, b - a) C-ordered: sources k0..k1-1's counts at steps a..b-1, as rows (of `dtype`)."""
        b = self.steps if b is None else b
        out = np.zeros((k1 - k0, max(b - a, 0)), dtype=self.dtype)
        per_step, src, value = self.step_cells(a, b)
        step = np.repeat(np.arange(b - a), per_step)
        keep = (src >= k0) & (src < k1)
        out[src[keep].astype(np.int64) - k0, step[keep]] = value[keep]
        return out

    def rows(self, a: int, b: int) -> np.ndarray:
        """(b - a, sources) int64: steps a..b-1's rows."""
        return np.ascontiguousarray(self.source_rows(0, self.n_sources, a, b).T, dtype=np.int64)

    def step_cells(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The nonzero cells of steps a..b-1, step after step, sources ascending within a step: (each step's
        number of cells, their uint16 sources, their counts (of `dtype`, or int64)); views where they can be."""
        rows = self.rows(a, b)
        step, src = np.nonzero(rows)
        return np.bincount(step, minlength=b - a), src.astype(np.uint16), rows[step, src]

    def cells(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The nonzero cells of steps a..b-1, step after step, sources in order within a step: (int64 steps,
        uint16 sources, int64 counts)."""
        per_step, src, value = self.step_cells(a, b)
        step = np.repeat(np.arange(a, b, dtype=np.int64), per_step)
        return step, np.asarray(src, dtype=np.uint16), np.asarray(value, dtype=np.int64)

    def source_totals(self) -> np.ndarray:
        """(sources,) int64: each source's count over all steps."""
        raise NotImplementedError

    @property
    def dtype(self) -> np.dtype:
        """The narrowest type every count held fits (what source_rows returns)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        raise NotImplementedError


class DenseCounts(StepCounts):
    """The (steps, sources) grid, stored source-major, in the narrowest type its counts fit (widened on demand)."""

    def __init__(self, steps: int, n_sources: int, most: int = _UINT32_MAX) -> None:
        """`most`: the largest count expected (sizes the type; a larger one widens it)."""
        self.steps = steps
        self.n_sources = n_sources
        self.grid = np.zeros((n_sources, steps), dtype=count_dtype(most))  # source-major

    def fit(self, counts: np.ndarray) -> None:
        """Widen the grid if `counts` (to be stored in it) do not fit its type."""
        g = self.grid
        if counts.size and g.dtype != np.int64 and int(counts.max()) > np.iinfo(g.dtype).max:
            self.grid = g.astype(count_dtype(int(counts.max())))

    def put(self, first: int, block: np.ndarray) -> None:
        self.fit(block)
        self.grid.T[first : first + len(block)] = block

    def source_rows(self, k0: int, k1: int, a: int = 0, b: int | None = None) -> np.ndarray:
        b = self.steps if b is None else b
        return np.ascontiguousarray(self.grid[k0:k1, a:b])

    def source_totals(self) -> np.ndarray:
        return self.grid.sum(axis=1, dtype=np.int64)

    @property
    def dtype(self) -> np.dtype:
        return self.grid.dtype

    @property
    def nbytes(self) -> int:
        return int(self.grid.nbytes)


class SparseCounts(StepCounts):
    """The nonzero cells, step-major (module docstring); rows must arrive in step order (put's `first` never before
    the last row put; steps skipped stay zero)."""

    def __init__(self, steps: int, n_sources: int) -> None:
        self.steps = steps
        self.n_sources = n_sources
        self._per_step = np.zeros(steps, dtype=np.uint32)  # each step's cells
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []  # (uint16 sources, narrow counts), in cell order
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # small puts' cells, not yet joined into a chunk
        self._pending_cells = 0
        self._filled = 0  # steps before this are final (put or skipped)
        self._most = 0  # the largest count held
        self._row = np.zeros(n_sources, dtype=np.int64)  # put_pieces' scratch row (left zero)
        self._offsets: np.ndarray | None = None  # each step's first cell (steps + 1), once asked for

    def _check(self, first: int, n: int) -> None:
        if first < self._filled:
            raise ValueError(f"counts of step {first} after step {self._filled - 1}: rows must come in step order")
        if first + n > self.steps:
            raise ValueError(f"steps {first}..{first + n - 1} are beyond the {self.steps} steps")

    def put(self, first: int, block: np.ndarray) -> None:
        n = len(block)
        self._check(first, n)
        cells = int(np.count_nonzero(block))
        src = np.empty(cells + 1, dtype=np.uint16)
        val = np.empty(cells + 1, dtype=np.int64)
        c, most = dense_cells(np.asarray(block, dtype=np.int64), src, val, self._per_step[first : first + n])
        self._add(src[:c].copy(), val[:c].astype(count_dtype(most)), most, first + n)

    def put_pieces(self, first: int, pieces: Pieces) -> None:
        """put of the pieces' cells, summed straight from the pieces (_counts_kernel.piece_cells: no dense block of
        the steps, whose (steps x sources) cells cost more to make and scan than the pieces to add)."""
        n = pieces.steps
        pieces.check(self.n_sources)
        self._check(first, n)
        src = np.empty(len(pieces.step) + 1, dtype=np.uint16)
        val = np.empty(len(pieces.step) + 1, dtype=np.int64)
        per = np.zeros(n, dtype=np.uint32)
        c, most = piece_cells(pieces.step, pieces.source, pieces.count, n, self._row, src, val, per)
        self._per_step[first : first + n] = per
        self._add(src[:c].copy(), val[:c].astype(count_dtype(most)), most, first + n)

    def _add(self, src: np.ndarray, val: np.ndarray, most: int, filled: int) -> None:
        """Append the cells of the steps just put (`most`: their largest count; filled: the step after them)."""
        self._filled = max(self._filled, filled)
        self._offsets = None
        if len(val) >= STAGE_CELLS // 8:  # a block's cells: a chunk of their own (not copied again)
            self._flush()
            self._chunks.append((src, val))
        elif len(val):
            self._pending.append((src, val))
            self._pending_cells += len(val)
        self._most = max(self._most, most)
        if self._pending_cells >= STAGE_CELLS:
            self._flush()

    def _flush(self) -> None:
        """The pending cells into one chunk (their counts each put's narrowest type, joined: the widest of them)."""
        if not self._pending:
            return
        src = np.concatenate([s for s, _ in self._pending]) if len(self._pending) > 1 else self._pending[0][0]
        val = np.concatenate([v for _, v in self._pending]) if len(self._pending) > 1 else self._pending[0][1]
        self._chunks.append((src, val))
        self._pending, self._pending_cells = [], 0

    def _settled(self) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Every chunk (the pending cells chunked first) and each step's first cell (steps + 1, int64)."""
        self._flush()
        if self._offsets is None:
            off = np.zeros(self.steps + 1, dtype=np.int64)
            np.cumsum(self._per_step, out=off[1:])
            self._offsets = off
        return self._chunks, self._offsets

    def step_cells(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        chunks, off = self._settled()
        c0, c1 = int(off[a]), int(off[b])
        srcs, vals = [], []
        at = 0
        for s, v in chunks:
            lo, hi = max(c0, at), min(c1, at + len(s))
            if hi > lo:
                srcs.append(s[lo - at : hi - at])
                vals.append(v[lo - at : hi - at])
            at += len(s)
        if len(srcs) == 1:
            return self._per_step[a:b], srcs[0], vals[0]
        src = np.concatenate(srcs) if srcs else np.zeros(0, dtype=np.uint16)
        val = np.concatenate(vals) if vals else np.zeros(0, dtype=self.dtype)
        return self._per_step[a:b], src, val

    def source_totals(self) -> np.ndarray:
        out = np.zeros(self.n_sources, dtype=np.int64)
        for s, v in self._settled()[0]:
            source_sums(s, v, out)
        return out

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(count_dtype(self._most))

    @property
    def nbytes(self) -> int:
        held = [*self._chunks, *self._pending]
        return int(self._per_step.nbytes + self._row.nbytes) + sum(s.nbytes + v.nbytes for s, v in held)

    @property
    def entries(self) -> int:
        """Nonzero cells held."""
        return int(self._per_step.sum(dtype=np.int64))
