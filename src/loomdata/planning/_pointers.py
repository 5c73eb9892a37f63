"""Membership's stream pointers, stored sparse: ptr[t, k] = segments of source k drawn before step t.

The pointers are a (steps + 1, sources) table of non-decreasing columns. With many sources and a small dp a
step draws from a few of them (300 sources at dp 4: about 60 a step), and the dense table grows with steps x
sources rather than with samples: 166K steps x 300 sources of int32 at 10M samples (20 bytes a sample), 20 GB
at a billion. Here it is kept by chunks of consecutive steps (those membership's repair works out at once), each
holding its first row (a dense checkpoint: row access by step needs no walk from step 0) and, per source, the
steps of the chunk at which that source draws and its pointer after each, less its pointer before the chunk
(CSC: `indptr`, `step`, `end`): 4 bytes a (step, source) cell that draws where a chunk has at most 65,536 steps
and no source draws more than 65,535 segments in it (uint16 local steps and offsets; wider types where not),
plus 12 bytes a source a chunk. A cell draws at
least one segment, so the table never holds more entries than segments drawn, nor more than steps x sources.

Reads (all exact: the dense table's values, tested against it): a row (`row`: a binary search a source), a
source's column over a run of steps (`column`), every step's row sum (`totals`), a range of rows re-based
(`window`, what a range's worker gets), the dense table (`dense`: tests and small tables).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from loomdata.planning._mixture_kernel import changes_by_source
from loomdata.planning._pointers_kernel import (
    column_into,
    count_changes,
    dense_into,
    fill_changes,
    fill_run_steps,
    row_at,
    totals_into,
)

__all__ = ["CHUNK_ROW_CELLS", "PointerChunk", "Pointers", "ReleasedPointers", "chunk_of_changes", "compress_rows"]

CHUNK_ROW_CELLS = 1 << 20
"""(steps x sources) cells of a chunk when a dense table is compressed (`Pointers.from_dense`)."""
_SHORT_STEPS = 1 << 16
"""Chunks of at most this many steps store their entries' steps as uint16."""


@dataclass(frozen=True, slots=True, eq=False)
class PointerChunk:
    """Steps first..first+rows-1 of the pointers: row i (0..rows) is the pointers before step first + i."""

    first: int  # the chunk's first step
    rows: int  # its steps
    base: np.ndarray  # (sources,) the pointers before step `first`
    indptr: np.ndarray  # int64 (sources + 1,): source k's entries are indptr[k]..indptr[k+1]-1
    step: np.ndarray  # uint16 / int32 local step of each entry (ascending within a source): the source draws there
    end: np.ndarray  # the source's pointer after that step less base[k]: uint16 / uint32 / int64, what fits

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's arrays."""
        return int(self.base.nbytes + self.indptr.nbytes + self.step.nbytes + self.end.nbytes)

    def row(self, i: int) -> np.ndarray:
        """Local row i (0..rows)."""
        out = np.empty(len(self.base), dtype=self.base.dtype)
        row_at(self.indptr, self.step, self.end, self.base, i, out)
        return out

    def aligned(self) -> PointerChunk:
        """The chunk with its arrays aligned (Dask may hand arrays over unaligned in its frames)."""
        arrays = {name: getattr(self, name) for name in ("base", "indptr", "step", "end")}
        if all(a.flags.aligned for a in arrays.values()):
            return self
        return replace(self, **{n: a if a.flags.aligned else a.copy() for n, a in arrays.items()})


def compress_rows(rows: np.ndarray, first: int, dtype: np.dtype | type | None = None) -> PointerChunk:
    """The chunk of a dense (steps + 1, sources) block of pointer rows (row 0: the pointers before step `first`)."""
    r = rows.shape[0] - 1
    n_src = rows.shape[1]
    dt = np.dtype(rows.dtype if dtype is None else dtype)
    counts = np.zeros(n_src, dtype=np.int64)
    count_changes(rows, counts)
    indptr = np.zeros(n_src + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    nnz = int(indptr[-1])
    step = np.empty(nnz, dtype=np.uint16 if r <= _SHORT_STEPS else np.int32)
    most = int((rows[-1].astype(np.int64) - rows[0]).max()) if n_src and r else 0  # columns do not decrease
    low = int((rows[-1].astype(np.int64) - rows[0]).min()) if n_src and r else 0
    end = np.empty(nnz, dtype=_offset_dtype(low, most))
    fill_changes(rows, indptr, step, end)
    return PointerChunk(first, r, rows[0].astype(dt), indptr, step, end)


def chunk_of_changes(
    base: np.ndarray, rows: int, first: int, step: np.ndarray, src: np.ndarray, end: np.ndarray
) -> PointerChunk:
    """The chunk of `rows` steps from `first` given its row before them (`base`) and its changes in step order
    (local step, source, pointer after the step: each (step, source) whose pointer moved, as membership's
    held pass finds them): the same entries as compress_rows of the dense rows, without the dense rows."""
    steps = np.empty(len(step), dtype=np.uint16 if rows <= _SHORT_STEPS else np.int32)
    indptr, rel, low, most = changes_by_source(step, src, end, base.astype(np.int64), steps)
    return PointerChunk(first, rows, base, indptr, steps, rel.astype(_offset_dtype(low, most)))


def _offset_dtype(low: int, most: int) -> type[np.uint16] | type[np.uint32] | type[np.int64]:
    """The narrowest type of a chunk's offsets from its base row (uint16, uint32, int64)."""
    if low < 0:
        return np.int64
    return np.uint16 if most <= 0xFFFF else np.uint32 if most <= 0xFFFFFFFF else np.int64


@dataclass(frozen=True, slots=True, eq=False)
class Pointers:
    """The (steps + 1, sources) stream pointers as chunks of steps (module docstring); row 0 is `chunks[0].base`."""

    chunks: list[PointerChunk]  # consecutive, covering steps 0..steps-1 (one chunk of 0 rows for 0 steps)
    steps: int
    starts: np.ndarray = field(init=False, repr=False, compare=False)  # int64 each chunk's first step

    def __post_init__(self) -> None:
        starts = np.fromiter((c.first for c in self.chunks), dtype=np.int64, count=len(self.chunks))
        object.__setattr__(self, "starts", starts)

    @property
    def shape(self) -> tuple[int, int]:
        """(steps + 1, sources): the dense table's shape."""
        return (self.steps + 1, len(self.chunks[0].base))

    @property
    def n_sources(self) -> int:
        """Sources (columns)."""
        return len(self.chunks[0].base)

    @property
    def dtype(self) -> np.dtype:
        """The pointers' integer type (the rows', columns' and dense table's)."""
        return self.chunks[0].base.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of all chunks' arrays."""
        return sum(c.nbytes for c in self.chunks)

    @property
    def entries(self) -> int:
        """(step, source) cells that draw."""
        return sum(len(c.step) for c in self.chunks)

    def __len__(self) -> int:
        return self.steps + 1

    @classmethod
    def from_dense(cls, ptr: np.ndarray, chunk_rows: int | None = None) -> Pointers:
        """The sparse form of a dense (steps + 1, sources) table, chunks of `chunk_rows` steps (default about
        CHUNK_ROW_CELLS cells)."""
        steps, n_src = ptr.shape[0] - 1, ptr.shape[1]
        rows = chunk_rows if chunk_rows is not None else max(64, CHUNK_ROW_CELLS // max(n_src, 1))
        chunks = [compress_rows(ptr[a : min(steps, a + rows) + 1], a) for a in range(0, steps, max(rows, 1))]
        if not chunks:
            chunks = [compress_rows(ptr[:1], 0)]
        return cls(chunks, steps)

    def _chunk_of(self, t: int) -> PointerChunk:
        """The chunk holding row t (the last chunk for t == steps)."""
        if not 0 <= t <= self.steps:
            raise IndexError(f"pointer row {t} is outside 0..{self.steps}")
        i = int(np.searchsorted(self.starts, t, side="right")) - 1
        c = self.chunks[i]
        if t - c.first > c.rows and i + 1 < len(self.chunks):  # (chunks are consecutive: not reached)
            raise AssertionError("pointer chunks are not consecutive")
        return c

    def row(self, t: int) -> np.ndarray:
        """Row t: every source's pointer before step t (negative t counts from the end, as for the dense table)."""
        t = t + self.steps + 1 if t < 0 else t
        c = self._chunk_of(t)
        return c.row(t - c.first)

    def last(self) -> np.ndarray:
        """The last row (every source's segments drawn by the plan's steps)."""
        return self.row(self.steps)

    def _overlapping(self, t0: int, t1: int) -> Iterator[tuple[PointerChunk, int, int]]:
        """(chunk, local a, local b) for the chunks holding rows t0..t1 (inclusive), rows a..b of each, each row
        once (a row shared by two chunks, the end of one and the base of the next, from the earlier chunk)."""
        i = max(int(np.searchsorted(self.starts, t0, side="right")) - 1, 0)
        t = t0
        while t <= t1:
            c = self.chunks[i]
            b = min(t1, c.first + c.rows) - c.first
            yield c, t - c.first, b
            t = c.first + b + 1
            i += 1
            if i >= len(self.chunks):
                break

    def column(self, k: int, t0: int = 0, t1: int | None = None) -> np.ndarray:
        """Source k's pointers at rows t0..t1 (inclusive; default through the last row): ptr[t0 : t1 + 1, k]."""
        t1 = self.steps if t1 is None else t1
        if t0 < 0 or t1 > self.steps:
            raise IndexError(f"pointer rows {t0}..{t1} outside 0..{self.steps}")
        out = np.empty(max(t1 - t0 + 1, 0), dtype=self.dtype)
        at = 0
        for c, a, b in self._overlapping(t0, t1):
            column_into(c.indptr, c.step, c.end, c.base, k, a, out[at : at + b - a + 1])
            at += b - a + 1
        return out

    def run_steps_into(self, k: int, lo: int, hi: int, out: np.ndarray, shift: int = 0) -> bool:
        """out[v - lo] = (the step t that draws source k's stream position v: ptr[t, k] <= v < ptr[t + 1, k]) + shift
        for v in lo..hi-1, from the entries of the steps that draw (no column of every step: with many sources
        a source draws at a few steps of each chunk). False, with `out` partly written, where a position is not
        drawn by any step (below row 0's pointer or from the last row's on)."""
        wrote = 0
        for c in self.chunks:
            if c.rows:
                wrote += fill_run_steps(c.indptr, c.step, c.end, c.base, k, c.first, lo, hi, shift, out)
        return wrote == hi - lo

    def totals(self) -> np.ndarray:
        """(steps + 1,) int64: every row's sum over sources (ptr.sum(axis=1))."""
        out = np.empty(self.steps + 1, dtype=np.int64)
        for c in self.chunks:
            part = np.empty(c.rows + 1, dtype=np.int64)
            totals_into(c.indptr, c.step, c.end, c.base, part)
            out[c.first : c.first + c.rows + 1] = part
        return out

    def dense(self) -> np.ndarray:
        """The dense (steps + 1, sources) table (tests, small tables)."""
        out = np.empty(self.shape, dtype=self.dtype)
        for c in self.chunks:
            dense_into(c.indptr, c.step, c.end, c.base, out[c.first : c.first + c.rows + 1])
        return out

    def window(self, first: int, stop: int, lo: np.ndarray | None = None) -> Pointers:
        """Rows first..stop as Pointers of their own (row 0: step `first`), each source's values less lo[k]
        (int64; default: row `first`, so row 0 is zeros)."""
        if not 0 <= first <= stop <= self.steps:
            raise ValueError(f"rows {first}..{stop} are not within 0..{self.steps}")
        sub = np.asarray(self.row(first) if lo is None else lo, dtype=np.int64)
        pieces = [
            (c, max(first, c.first) - c.first, min(stop, c.first + c.rows) - c.first)
            for c in self.chunks
            if c.first < stop and first < c.first + c.rows
        ]
        if not pieces:  # no steps: the row alone
            c = self._chunk_of(first)
            pieces = [(c, first - c.first, first - c.first)]
        chunks: list[PointerChunk] = []
        for c, a, b in pieces:
            n_src = len(c.base)
            src = np.repeat(np.arange(n_src), np.diff(c.indptr))
            keep = (c.step >= a) & (c.step < b)
            counts = np.bincount(src[keep], minlength=n_src)
            indptr = np.zeros(n_src + 1, dtype=np.int64)
            np.cumsum(counts, out=indptr[1:])
            rows = b - a
            step = (c.step[keep].astype(np.int64) - a).astype(np.uint16 if rows <= _SHORT_STEPS else np.int32)
            at_a = c.row(a).astype(np.int64)
            end = c.end[keep].astype(np.int64) + (c.base.astype(np.int64) - at_a)[src[keep]]  # from the new base
            chunks.append(PointerChunk(c.first + a - first, rows, at_a - sub, indptr, step, end))
        return Pointers(chunks, stop - first)

    def aligned(self) -> Pointers:
        """The pointers with every array aligned (after Dask's transfer)."""
        return Pointers([c.aligned() for c in self.chunks], self.steps)

    def release(self) -> None:
        """Let the chunks go in place, so that every holder of these pointers sees them gone (the look-ahead does
        once it has read the natural steps, when its caller balances from the assignment); later reads raise."""
        self.chunks.clear()
        object.__setattr__(self, "starts", np.zeros(0, dtype=np.int64))
        object.__setattr__(self, "__class__", ReleasedPointers)  # same slots: every read now says why it fails

    def released(self) -> Pointers:
        """Their steps alone, the chunks let go: what balancing a look-ahead plan in one process reads of the
        pointers (its length; at 300 sources x dp 4 the chunks are about 4 bytes a segment). Reading a row, a
        column or the totals of it raises."""
        return ReleasedPointers([], self.steps)


class ReleasedPointers(Pointers):
    """Pointers whose chunks were let go (Pointers.released): the number of steps, nothing to read."""

    __slots__ = ()

    def _gone(self) -> ValueError:
        return ValueError("these pointers were released after the look-ahead: only their length is kept")

    @property
    def shape(self) -> tuple[int, int]:
        raise self._gone()

    @property
    def n_sources(self) -> int:
        raise self._gone()

    @property
    def dtype(self) -> np.dtype:
        raise self._gone()

    def _chunk_of(self, t: int) -> PointerChunk:
        raise self._gone()

    def _overlapping(self, t0: int, t1: int) -> Iterator[tuple[PointerChunk, int, int]]:
        raise self._gone()

    def totals(self) -> np.ndarray:
        raise self._gone()

    def window(self, first: int, stop: int, lo: np.ndarray | None = None) -> Pointers:
        raise self._gone()

    def run_steps_into(self, k: int, lo: int, hi: int, out: np.ndarray, shift: int = 0) -> bool:
        raise self._gone()
