"""The report's tokens of each source in each step, a (steps, sources) table of integers, dense or sparse.

With many sources and a small dp a step places tokens of a few of them (300 sources at dp 4: about 60 a step),
and the dense table grows with steps x sources (166K steps x 300 sources of uint16 at 10M samples: 10 bytes a
sample). `SparseCounts` (the plan's report, filled in step order) keeps chunks of consecutive steps, each with
per source the steps of the chunk where it has tokens and how many (uint16 local steps and the narrowest count
type the chunk's largest count fits: 4 bytes a nonzero cell at dp 4), rows arriving into a dense staging block
of about STAGE_CELLS cells until it is compressed. `DenseCounts` (a range's report, whose rows a fix-up may
rewrite) is the source-major grid, widened when a count does not fit its type. Both read back the same values:
rows of sources over a run of steps, each source's total, the grand total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning._counts_kernel import add_pieces, count_nonzero, fill_nonzero, scatter_sources, source_sums

__all__ = ["STAGE_CELLS", "DenseCounts", "Pieces", "SparseCounts", "StepCounts", "count_dtype"]

STAGE_CELLS = 1 << 20
"""(steps x sources) cells of a SparseCounts' staging block (int64: 8 MiB), at least 64 steps."""
_UINT32_MAX = int(np.iinfo(np.uint32).max)
_SHORT_STEPS = 1 << 16


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
        """(k1 - k0, b - a) C-ordered: sources k0..k1-1's counts at steps a..b-1, as rows."""
        raise NotImplementedError

    def rows(self, a: int, b: int) -> np.ndarray:
        """(b - a, sources) int64: steps a..b-1's rows."""
        return np.ascontiguousarray(self.source_rows(0, self.n_sources, a, b).T, dtype=np.int64)

    def cells(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The nonzero cells of steps a..b-1, step after step, sources in order within a step: (int64 steps,
        uint16 sources, int64 counts). This one reads the steps' rows (a block of them at once)."""
        rows = self.rows(a, b)
        step, src = np.nonzero(rows)
        return step + a, src.astype(np.uint16), rows[step, src]

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


@dataclass(frozen=True, slots=True)
class _Chunk:
    first: int  # first step
    rows: int  # steps
    indptr: np.ndarray  # int64 (sources + 1,): source k's cells are indptr[k]..indptr[k+1]-1
    step: np.ndarray  # uint16 / int32 local steps, ascending within a source
    value: np.ndarray  # their counts (nonzero), the narrowest type the chunk's largest fits


class SparseCounts(StepCounts):
    """The nonzero cells, by chunks of steps (module docstring); rows must arrive in step order (put's `first`
    never before the last row put; steps skipped stay zero)."""

    def __init__(self, steps: int, n_sources: int) -> None:
        self.steps = steps
        self.n_sources = n_sources
        self._chunks: list[_Chunk] = []
        self._stage_rows = max(64, STAGE_CELLS // max(n_sources, 1))
        self._stage = np.zeros((0, n_sources), dtype=np.int64)  # allocated on the first put
        self._s0 = 0  # the staging block's first step
        self._filled = 0  # steps before this are final (put or skipped)
        self._dtype: np.dtype = np.dtype(np.uint16)

    def put(self, first: int, block: np.ndarray) -> None:
        if first < self._filled:
            raise ValueError(f"counts of step {first} after step {self._filled - 1}: rows must come in step order")
        if first + len(block) > self.steps:
            raise ValueError(f"steps {first}..{first + len(block) - 1} are beyond the {self.steps} steps")
        if len(self._stage) == 0:
            self._stage = np.zeros((self._stage_rows, self.n_sources), dtype=np.int64)
        at = 0
        while at < len(block):
            t = first + at
            if t >= self._s0 + self._stage_rows:  # the staging block is full: compress it, start the next at t
                self._flush(t)
            n = min(len(block) - at, self._s0 + self._stage_rows - t)
            self._stage[t - self._s0 : t - self._s0 + n] = block[at : at + n]
            at += n
            self._filled = max(self._filled, t + n)

    def put_pieces(self, first: int, pieces: Pieces) -> None:
        """put of the pieces' cells, the pieces added straight into the staging block (no dense block of the
        steps: its (steps x sources) cells cost more to make and copy than the pieces to add)."""
        n = pieces.steps
        pieces.check(self.n_sources)
        if first < self._filled:
            raise ValueError(f"counts of step {first} after step {self._filled - 1}: rows must come in step order")
        if first + n > self.steps:
            raise ValueError(f"steps {first}..{first + n - 1} are beyond the {self.steps} steps")
        if len(self._stage) == 0:
            self._stage = np.zeros((self._stage_rows, self.n_sources), dtype=np.int64)
        at, lo = 0, 0
        while at < n:
            t = first + at
            if t >= self._s0 + self._stage_rows:
                self._flush(t)
            m = min(n - at, self._s0 + self._stage_rows - t)
            hi = int(np.searchsorted(pieces.step, at + m, side="left"))
            # rows from _filled on are zero (put never writes before it): adding is put's assignment
            add_pieces(self._stage, t - self._s0 - at, pieces.step, pieces.source, pieces.count, lo, hi)
            lo, at = hi, at + m
            self._filled = max(self._filled, t + m)

    def _flush(self, next_first: int) -> None:
        """Compress the staged steps s0..filled-1 into a chunk (none: nothing), restage from `next_first`."""
        n = self._filled - self._s0
        if n > 0:
            rows = self._stage[:n]
            counts = np.zeros(self.n_sources, dtype=np.int64)
            count_nonzero(rows, counts)
            indptr = np.zeros(self.n_sources + 1, dtype=np.int64)
            np.cumsum(counts, out=indptr[1:])
            most = int(rows.max()) if rows.size else 0
            dt = np.dtype(count_dtype(most))
            if dt.itemsize > self._dtype.itemsize:
                self._dtype = dt
            step = np.empty(int(indptr[-1]), dtype=np.uint16 if n <= _SHORT_STEPS else np.int32)
            value = np.empty(int(indptr[-1]), dtype=dt)
            fill_nonzero(rows, indptr, step, value)
            self._chunks.append(_Chunk(self._s0, n, indptr, step, value))
            self._stage[:n] = 0
        self._s0 = next_first
        self._filled = max(self._filled, next_first)

    def _settled(self) -> list[_Chunk]:
        """Every chunk, the staged steps compressed first (later puts go on after them)."""
        if self._filled > self._s0:
            self._flush(self._filled)
        return self._chunks

    def source_rows(self, k0: int, k1: int, a: int = 0, b: int | None = None) -> np.ndarray:
        b = self.steps if b is None else b
        out = np.zeros((k1 - k0, max(b - a, 0)), dtype=self.dtype)
        for c in self._settled():
            i0, i1 = max(a, c.first) - c.first, min(b, c.first + c.rows) - c.first
            if i1 > i0:
                scatter_sources(c.indptr, c.step, c.value, k0, i0, i1, c.first + i0 - a, out)
        return out

    def cells(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """StepCounts.cells from the chunks' nonzero cells (by source, each source's steps ascending): a stable
        sort by step a chunk, no (steps x sources) block."""
        steps, srcs, vals = [], [], []
        for c in self._settled():
            i0, i1 = max(a, c.first) - c.first, min(b, c.first + c.rows) - c.first
            if i1 <= i0:
                continue
            src = np.repeat(np.arange(self.n_sources, dtype=np.uint16), np.diff(c.indptr))
            step, value = c.step, c.value
            if i0 > 0 or i1 < c.rows:
                keep = (step >= i0) & (step < i1)
                step, value, src = step[keep], value[keep], src[keep]
            order = np.argsort(step, kind="stable")  # a step's cells keep source order
            steps.append(step[order].astype(np.int64) + c.first)
            srcs.append(src[order])
            vals.append(value[order].astype(np.int64))
        if not steps:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.int64)
        return np.concatenate(steps), np.concatenate(srcs), np.concatenate(vals)

    def source_totals(self) -> np.ndarray:
        out = np.zeros(self.n_sources, dtype=np.int64)
        for c in self._settled():
            source_sums(c.indptr, c.value, out)
        return out

    @property
    def dtype(self) -> np.dtype:
        self._settled()
        return self._dtype

    @property
    def nbytes(self) -> int:
        return int(self._stage.nbytes) + sum(c.indptr.nbytes + c.step.nbytes + c.value.nbytes for c in self._chunks)

    @property
    def entries(self) -> int:
        """Nonzero cells held."""
        return sum(len(c.step) for c in self._settled())
