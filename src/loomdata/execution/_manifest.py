"""The executor's views of the manifest.

- `ManifestSlice`, a constructor's: its ranks' rows, read a chunk of steps at a time. Rows come back as NumPy
  columns ordered by (step, dp_rank, micro_batch), keeping the stored sequence order inside each micro-batch
  (the sort is stable). At most `keep` chunks stay in memory, so memory does not grow with the plan.
- `source_span`, the Source Loaders': one source's (step, sample) rows of a span of steps, from a span read
  once per process (`SpanRows`) and shared by every loader of the process, instead of each of a worker's
  hundreds of loaders reading and decoding the whole span to keep its own small part.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loomdata.schemas.plan_view import read_manifest
from loomdata.schemas.tables import MANIFEST_SCHEMA

if TYPE_CHECKING:  # annotations only: no pydantic in a serving worker
    from loomdata.schemas.plan import AnyPlan

__all__ = ["ManifestRows", "ManifestSlice", "SpanRows", "source_span"]

_COLUMNS = tuple(MANIFEST_SCHEMA.names)  # ManifestRows' fields, in the stored order (checked below)


@dataclass(frozen=True, slots=True)
class ManifestRows:
    """Manifest columns as NumPy arrays, one row per segment."""

    step: np.ndarray
    dp_rank: np.ndarray
    micro_batch: np.ndarray
    source: np.ndarray
    sample: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    lane: np.ndarray

    def take(self, idx: np.ndarray | slice) -> ManifestRows:
        """The rows at `idx` (the fields spelled out: a constructor takes a step's rows a few thousand times a run)."""
        return ManifestRows(
            self.step[idx],
            self.dp_rank[idx],
            self.micro_batch[idx],
            self.source[idx],
            self.sample[idx],
            self.offset[idx],
            self.length[idx],
            self.lane[idx],
        )

    def __len__(self) -> int:
        return len(self.step)

    @classmethod
    def concat(cls, parts: Sequence[ManifestRows]) -> ManifestRows:
        """Several runs of rows end to end (in the order given; one part: itself)."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, c) for p in parts]) for c in _COLUMNS))


if tuple(f.name for f in dataclasses.fields(ManifestRows)) != _COLUMNS:  # pragma: no cover - a programming error
    raise ImportError(f"ManifestRows fields differ from MANIFEST_SCHEMA columns {_COLUMNS}; keep them the same")


def _steps_for_rows(meta: AnyPlan, ranks: int, rows: int) -> int:
    """About how many steps hold `rows` manifest rows of `ranks` ranks (rows spread evenly over steps and ranks)."""
    total = sum(f.rows for f in meta.manifest)
    if rows <= 0 or total <= 0:
        return 0
    per_step = total / max(meta.steps, 1) * ranks / max(meta.dp_size, 1)
    return min(meta.steps, int(rows / max(per_step, 1e-9)))


class ManifestSlice:
    """Rows of one step for a fixed set of ranks, from a small cache of step chunks."""

    def __init__(
        self,
        plan_dir: str | Path,
        meta: AnyPlan,
        ranks: list[int],
        chunk_steps: int = 32,
        keep: int = 2,
        chunk_rows: int = 0,
        keep_steps: int = 0,
    ):
        """`chunk_steps`: steps read at a time, or more to hold about `chunk_rows` of this slice's rows.

        Every read scans whole manifest row groups (milliseconds each), so reading few steps at a time
        costs a scan per few steps; `chunk_rows` bounds the memory a larger chunk takes instead.
        `keep_steps`: keep at least the chunks `keep_steps` steps span, and 2 more (a window's steps, counted in
        the chunks actually read: a 256-step window of 1 rank is one chunk, not 256 // 32).
        """
        self._plan_dir = Path(plan_dir)
        self._meta = meta
        self._ranks = sorted(ranks)
        self._chunk = max(1, chunk_steps, _steps_for_rows(meta, len(self._ranks), chunk_rows))
        self._keep = max(1, keep, 2 + -(-keep_steps // self._chunk) if keep_steps > 0 else 0)
        self._cache: collections.OrderedDict[int, tuple[ManifestRows, np.ndarray]] = collections.OrderedDict()
        # the event loop reads hits while the constructor's pool reads and evicts chunks: the cache's moves are locked
        self._cache_lock = threading.Lock()

    def rows(self, step: int, ranks: list[int] | None = None) -> ManifestRows:
        """Rows of `step` (for `ranks`, default all of this slice's), ordered by (dp_rank, micro_batch)."""
        index = step // self._chunk
        chunk, starts = self._chunk_rows(index)
        at = step - index * self._chunk
        lo, hi = starts[at : at + 2].tolist()  # the step's rows: one run, its bounds found once a chunk
        if self._all(ranks):
            return chunk.take(slice(lo, hi))
        # a step's rows are ordered by dp_rank: each rank's rows are one run, found by bisection
        want = np.unique(np.asarray(ranks, dtype=chunk.dp_rank.dtype))
        ranks_of_step = chunk.dp_rank[lo:hi]
        a = lo + np.searchsorted(ranks_of_step, want, side="left")
        b = lo + np.searchsorted(ranks_of_step, want, side="right")
        if len(want) == 1:
            return chunk.take(slice(int(a[0]), int(b[0])))
        return chunk.take(np.concatenate([np.arange(x, y) for x, y in zip(a.tolist(), b.tolist(), strict=True)]))

    def rows_of(self, work: Sequence[tuple[int, list[int]]]) -> tuple[ManifestRows, np.ndarray]:
        """The rows of every (step, ranks) of `work` end to end, and where each one's rows start (one more: the end).

        Consecutive steps of one chunk for all of this slice's ranks (a build group, as the window asks for them)
        are one slice of the chunk: no take a step (a constructor builds every step of a run once).
        """
        parts: list[ManifestRows] = []
        counts: list[np.ndarray] = []
        i = 0
        while i < len(work):
            step, ranks = work[i]
            if not self._all(ranks):
                parts.append(self.rows(step, ranks))
                counts.append(np.array([len(parts[-1])], dtype=np.int64))
                i += 1
                continue
            index = step // self._chunk
            j = i + 1
            while (
                j < len(work)
                and work[j][0] == work[j - 1][0] + 1
                and work[j][0] // self._chunk == index
                and self._all(work[j][1])
            ):
                j += 1
            chunk, starts = self._chunk_rows(index)
            at = step - index * self._chunk
            cut = starts[at : at + j - i + 1].astype(np.int64)
            parts.append(chunk.take(slice(int(cut[0]), int(cut[-1]))))
            counts.append(np.diff(cut))
            i = j
        bounds = np.zeros(len(work) + 1, dtype=np.int64)
        if counts:
            np.cumsum(np.concatenate(counts), out=bounds[1:])
        if not parts:
            raise ValueError("rows_of needs at least one (step, ranks)")
        return ManifestRows.concat(parts), bounds

    def _all(self, ranks: list[int] | None) -> bool:
        """Whether `ranks` (None: all) are all of this slice's ranks."""
        return ranks is None or ranks == self._ranks or sorted(ranks) == self._ranks

    def cached(self, step: int) -> bool:
        """Whether `step`'s chunk is in memory (`rows` then does no I/O)."""
        return step // self._chunk in self._cache

    def _chunk_rows(self, index: int) -> tuple[ManifestRows, np.ndarray]:
        """Chunk `index`'s rows, and where each of its steps' rows start (one more: the end)."""
        with self._cache_lock:
            hit = self._cache.get(index)
            if hit is not None:
                self._cache.move_to_end(index)
                return hit
        first = index * self._chunk
        last = min(first + self._chunk, self._meta.steps) - 1
        table = read_manifest(self._plan_dir, self._meta, first, last, dp_ranks=self._ranks)
        cols = {c: table.column(c).to_numpy() for c in _COLUMNS}
        order = np.lexsort((cols["micro_batch"], cols["dp_rank"], cols["step"]))
        rows = ManifestRows(*(cols[c][order] for c in _COLUMNS))
        edges = np.arange(first, first + self._chunk + 1)  # to a whole chunk's end: a step past the plan has none
        starts = np.searchsorted(rows.step, edges.astype(rows.step.dtype, copy=False))
        with self._cache_lock:
            self._cache[index] = (rows, starts)
            while len(self._cache) > self._keep:
                self._cache.popitem(last=False)
        return rows, starts


@dataclass(frozen=True, slots=True)
class SpanRows:
    """(step, sample) of every manifest row in a span of steps, grouped by source: source `s` holds the rows
    `bounds[s]:bounds[s + 1]`, in step order and, within a step, in stored order (the sort is stable)."""

    step: np.ndarray  # uint32
    sample: np.ndarray  # uint64
    bounds: np.ndarray  # int64, one more than the plan's sources

    def of(self, source: int) -> tuple[np.ndarray, np.ndarray]:
        """Source `source`'s (step, sample) rows: views, no copy."""
        if source + 1 >= len(self.bounds):
            return self.step[:0], self.sample[:0]
        lo, hi = int(self.bounds[source]), int(self.bounds[source + 1])
        return self.step[lo:hi], self.sample[lo:hi]

    @property
    def nbytes(self) -> int:
        return self.step.nbytes + self.sample.nbytes + self.bounds.nbytes


def read_span(plan_dir: str | Path, meta: AnyPlan, first: int, last: int) -> SpanRows:
    """Read steps [first, last] of the manifest (three of its columns) into a `SpanRows`."""
    t = read_manifest(plan_dir, meta, first, last, columns=["step", "source", "sample"])
    step, source, sample = (t.column(c).to_numpy() for c in ("step", "source", "sample"))
    order = np.lexsort((step, source))  # stable: equal (source, step) rows keep their stored order
    source = source[order]
    bounds = np.searchsorted(source, np.arange(len(meta.sources) + 1), side="left").astype(np.int64)
    rows = SpanRows(step[order], sample[order].astype(np.uint64, copy=False), bounds)
    for a in (rows.step, rows.sample, rows.bounds):
        a.flags.writeable = False  # shared by every loader of the process: views only
    return rows


_SPAN_KEEP = 3  # spans kept per process: the one being planned, the one before and the one read ahead
_SPANS: collections.OrderedDict[tuple[str, str, int, int], _SpanEntry] = collections.OrderedDict()
_SPANS_LOCK = threading.Lock()


class _SpanEntry:
    """One span being read or read: the first loader to ask reads it, the others wait for its rows or error."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.rows: SpanRows | None = None
        self.error: BaseException | None = None


def source_span(
    plan_dir: str | Path, meta: AnyPlan, first: int, last: int, source: int
) -> tuple[np.ndarray, np.ndarray]:
    """Source `source`'s (step, sample) manifest rows in steps [first, last], in step order (stored order within
    a step), as views of a span this process reads once for all its loaders (the last `_SPAN_KEEP` are kept).

    Raises what reading the manifest raises (`LoomError`, `OSError`, `pyarrow.ArrowException`); a failed read is
    not kept, so the next caller reads again.
    """
    key = (str(plan_dir), meta.plan_id, first, last)
    with _SPANS_LOCK:
        entry = _SPANS.get(key)
        mine = entry is None
        if entry is None:
            entry = _SPANS[key] = _SpanEntry()
            while len(_SPANS) > _SPAN_KEEP:
                _SPANS.popitem(last=False)
        else:
            _SPANS.move_to_end(key)
    if mine:
        try:
            entry.rows = read_span(plan_dir, meta, first, last)
        except BaseException as e:
            entry.error = e
            with _SPANS_LOCK:
                if _SPANS.get(key) is entry:
                    del _SPANS[key]
            raise
        finally:
            entry.done.set()
    else:
        entry.done.wait()
    if entry.rows is None:
        raise entry.error if entry.error is not None else RuntimeError(f"manifest span {key} was not read")
    return entry.rows.of(source)


def clear_spans() -> None:
    """Forget every shared span (tests; a process that stops serving a plan)."""
    with _SPANS_LOCK:
        _SPANS.clear()
