"""A Source Loader's look at its future: plans its unit cache from the manifest, opens shards ahead, counts reads off.

`PlanAhead` reads the manifest a chunk of steps at a time (`CachePolicy.chunk_steps`), tells the loader's
`PlanUnitCache` which read units each of its pending steps needs, and counts every served segment off.
Planning is a hint: if it fails (a file the reader cannot open yet), those units are simply not kept,
and the read reports the real error.

Storage latency is kept off the read path:
- before any request (`warm`, in the loader's thread at construction) it plans from the start step and
  starts the read-ahead, so the first steps' units are in flight before a rank asks;
- every shard the manifest names is opened as soon as a span of the manifest naming it is read (footer,
  and alongside it the shard check and the object's read handle; `ShardOpens`: soonest first use first, a
  bounded number at once), and the next span is read once planning is half-way through the current one,
  so a shard is normally open long before its first chunk is planned; planning waits for the footer only
  (the read checks the shard before it uses its bytes), so the start step's units are issued one round trip
  after the footer, not after the check's three;
- shards are never opened under the planning lock: planning a chunk waits (outside it) only for the
  shards that chunk reads, so a read whose chunk is planned never waits on another chunk's opens;
- only the chunks holding the steps a request reads are planned on the read path (they normally were
  long before); the chunks up to the cache's reach are planned in the background, then read ahead.

With `verify: sample` the loader holds the checksums of the samples each span read names (`hold_checksums`: one
read of samples.parquet where one is new) and drops those no step from the cache's floor on reads as reads are
served: from the floor to the newest step planned, however many spans that is. A failed read of them is a planning
error like the others (counted): the read that needs one reads them again and reports the error.

Planning uses a reader of its own (a `sibling` of the loader's, sharing its footers) under this object's
lock, so it never runs inside the loader's reader concurrently with a read.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from loomdata.execution._loader_cache import CachePolicy, PlanUnitCache, unit_key
from loomdata.execution._manifest import source_span
from loomdata.execution._prefetch import Prefetcher, submit_shared
from loomdata.execution._shard_opens import ShardOpens
from loomdata.schemas.errors import LoomError
from loomdata.sources import FormatReader
from loomdata.storage import is_url, open_ahead, warm_client
from loomdata.storage._arrow import ARROW_MIN_READ

if TYPE_CHECKING:  # annotations only: no pydantic in a serving worker
    from loomdata.schemas.plan import AnyPlan

__all__ = ["PlanAhead"]

_log = logging.getLogger(__name__)

_SPAN_ROWS = 1 << 18  # manifest rows read at once when planning the cache (this partition's are kept)


class PlanAhead:
    """The cache planning and read-ahead of one Source Loader (see the module docstring)."""

    def __init__(self, plan_dir: str, meta: AnyPlan, loader: Any, policy: CachePolicy) -> None:
        """`loader`: the `SourceLoader` this serves (its index arrays, paths, reader, verifier, counters; `_loader`
        imports this module, so it is not named here)."""
        self._plan_dir = plan_dir
        self._meta = meta
        self._loader = loader
        self._policy = policy
        self._planned: set[int] = set()  # manifest chunks counted
        self._spans: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # first chunk -> (step, sample) of this partition
        total = sum(f.rows for f in meta.manifest)
        per_chunk = max(1.0, total / max(meta.steps, 1) * policy.chunk_steps)
        self._span_chunks = max(1, int(_SPAN_ROWS / per_chunk))  # manifest chunks one span holds
        self._next_read: set[int] = set()  # spans whose read ahead was handed to the background planner
        self._queued: set[int] = set()  # chunks handed to the background planner
        self._lock = threading.Lock()  # planning: `_planned`, the spans, the planning reader
        self.opens = ShardOpens(self._open_jobs, side_of=self._check_jobs)
        self._closed = False
        self._later: list[Future[None]] = []  # background planning in progress
        shard_of = {str(p): s for s, p in loader._paths.items()}
        self.cache = PlanUnitCache(meta.plan_id, meta.steps, policy, shard_of)
        self._units: FormatReader = loader._reader.sibling()  # the planner's own reader (units only)
        self._table = UnitTable()  # where each shard's units start, as the readers told it (footers are held)
        self.prefetch: Prefetcher | None = None
        if policy.prefetch > 0 and policy.worker_bytes > 0:
            part = loader.partition
            self.prefetch = Prefetcher(
                self.cache, loader._reader.sibling, loader._paths, policy.prefetch, f"{part.source}-{part.part}"
            )
        loader._reader.use_unit_cache(self.prefetch if self.prefetch is not None else self.cache)

    def warm(self) -> None:
        """Before any request: plan from the start step (opening those shards at once) and read ahead."""
        _warm_store(self._loader)
        start = np.array([min(self._policy.start_step, max(self._meta.steps - 1, 0))], dtype=np.int64)
        self.ahead(start)
        self.pump(start)

    def keys(self, samples: np.ndarray, reader: FormatReader | None = None) -> np.ndarray:
        """Unit key per sample of this partition (-1 where the reader cannot tell); the loader's reader by default."""
        return _keys_rows(self._loader, self._table, samples, reader)[0]

    def held(self, request: np.ndarray) -> bool:
        """Whether every row `request` reads is held now (reading it makes no storage request).

        Asked on the worker's event loop: a shard not opened yet is not held (telling its units would fetch its footer).
        """
        if not self.opens.done(self._shards_of(request["sample"])):
            return False
        keys = self.keys(request["sample"])
        if not len(keys) or not bool((keys >= 0).all()):
            return False
        return self.cache.holds(keys, self._rows_of(request["sample"]))

    def ready(self, request: np.ndarray) -> bool:
        """Whether the chunks of `request`'s steps are planned (serving it reads no manifest; see `held` for units).

        Asked on the worker's event loop: planning a chunk there reads the manifest and waits for its shards'
        opens, which queue behind every other loader's at start-up.
        """
        chunk = self._policy.chunk_steps
        return all(c in self._planned for c in np.unique(request["step"].astype(np.int64) // chunk).tolist())

    def reading(self, request: np.ndarray) -> bool:
        """Whether a unit `request` reads is being read ahead now (serving it would wait for that read)."""
        pf = self.prefetch  # none in flight (local files, read-ahead off): no keys to tell
        return pf is not None and pf.in_flight() > 0 and pf.reading(self.keys(request["sample"]))

    def _shards_of(self, samples: np.ndarray) -> np.ndarray:
        """The shard of each of `samples` (of this partition)."""
        index = self._loader._index
        return index.shard_at(index.locate(samples)[0]) if len(index) else np.zeros(0, dtype=np.int64)

    def _rows_of(self, samples: np.ndarray) -> np.ndarray:
        """The file row of each of `samples` (of this partition)."""
        index = self._loader._index
        return index.row_at(index.locate(samples)[0])

    def ahead(self, steps: np.ndarray) -> None:
        """Plan the chunks of the steps asked now; those up to the cache's reach beyond them in the background."""
        if len(steps) == 0:
            return
        chunk = self._policy.chunk_steps
        first, now = int(np.min(steps)) // chunk, int(np.max(steps)) // chunk
        last = min(int(np.max(steps)) + self.cache.plan_reach, self._meta.steps - 1) // chunk
        for c in range(first, now + 1):
            if c not in self._planned:
                self._plan_once(c)
        later = [c for c in range(now + 1, last + 1) if c not in self._planned and c not in self._queued]
        nxt = self._next_span(last)
        if (later or nxt is not None) and not self._closed:
            self._queued.update(later)
            if nxt is not None:
                self._next_read.add(nxt)
            self._later = [f for f in self._later if not f.done()]
            self._later.append(submit_shared(functools.partial(self._plan_later, later, nxt)))

    def idle(self, timeout: float) -> bool:
        """Wait until background planning and read-ahead are done (tests, benchmarks); False on timeout."""
        _, pending = wait_for(list(self._later), timeout)
        if pending or not self.opens.settle(timeout):
            return False
        return self.prefetch is None or self.prefetch.settle(timeout)

    def _plan_later(self, chunks: list[int], next_span: int | None) -> None:
        """Plan `chunks` (and read the next span) on a planning thread. Nobody waits on its future, so a failure is
        counted (`plan_errors`) and logged here, not lost: a chunk it left unplanned is planned when its steps are
        asked, where the same failure reaches the request."""
        try:
            for c in chunks:
                if self._closed:
                    return
                self._plan_once(c)
                self.pump(None)  # read ahead what this chunk needs now, not after the whole batch (hundreds of steps)
            if next_span is not None:
                self._read_next_span(next_span)
        except Exception as err:  # a background thread's last stop: counted and logged, see above
            self._loader._counters.plan_errors += 1
            p = self._loader.partition
            _log.warning(
                "loomdata: planning steps ahead for source %d (samples %d..%d) failed at chunks %s: %s: %s; those "
                "steps are planned when a rank asks for them",
                p.source_id, p.first_sample, p.stop_sample - 1, chunks, type(err).__name__, err,
            )  # fmt: skip

    def _plan_once(self, c: int) -> None:
        with self._lock:
            if c in self._planned or self._closed:
                return
            got = self._mine(c)
        if got is not None and len(got[1]):
            self.opens.wait(self._shards_of(got[1]))  # outside the lock: other chunks plan meanwhile
        with self._lock:
            if c not in self._planned and not self._closed:
                self._plan_chunk(c, got)
                self._planned.add(c)

    def _plan_chunk(self, c: int, got: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Count chunk `c`'s planned reads (its shards are open: telling their units makes no request)."""
        if got is None:
            return
        step, sample = got
        keys, rows = _keys_rows(self._loader, self._table, sample, self._units)
        ok = keys >= 0
        self.cache.plan(keys[ok], step[ok], rows[ok])

    def _mine(self, c: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(step, sample) of this partition's manifest rows in chunk `c`; None if the manifest cannot be read.

        Every manifest read scans whole row groups (milliseconds), so the rows of several chunks (a span of
        about `_SPAN_ROWS` manifest rows) are read at once and only this partition's (a small part) are kept.
        """
        start = self._span_of(c)
        if start not in self._spans:
            got = self._read_span(start)
            if got is None:
                return None
            self._keep_span(start, got)
        step, sample = self._spans[start]
        chunk = self._policy.chunk_steps
        lo, hi = np.searchsorted(step, np.array([c * chunk, (c + 1) * chunk], dtype=step.dtype))
        return step[lo:hi], sample[lo:hi]

    def _span_of(self, c: int) -> int:
        """The first chunk of the span holding chunk `c` (spans are fixed: chunk multiples of `_span_chunks`)."""
        return c - c % self._span_chunks

    def _read_span(self, start: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(step, sample) of this partition's manifest rows in the span from chunk `start`, in step order.

        The span is read once per process for every loader (`source_span`); this keeps views of its source's rows
        (a copy only of those in its sample range when the source has several partitions).
        """
        chunk, p = self._policy.chunk_steps, self._loader.partition
        last = min((start + self._span_chunks) * chunk, self._meta.steps) - 1
        try:
            step, sample = source_span(self._plan_dir, self._meta, start * chunk, last, p.source_id)
        except (LoomError, OSError, pa.ArrowException):
            self._loader._counters.plan_errors += 1
            return None
        if len(sample) and (int(sample.min()) < p.first_sample or int(sample.max()) >= p.stop_sample):
            mine = (sample >= p.first_sample) & (sample < p.stop_sample)
            return step[mine], sample[mine]
        return step, sample

    def _keep_span(self, start: int, rows: tuple[np.ndarray, np.ndarray]) -> None:
        """Hold a span's rows (and the next one's, read ahead; older ones are dropped) and open its shards ahead."""
        self._spans = {k: v for k, v in self._spans.items() if k >= start - self._span_chunks}
        self._spans[start] = rows
        step, sample = rows
        _hold_checksums(self._loader, step, sample, start * self._policy.chunk_steps)
        if len(sample):
            shards, first = np.unique(self._shards_of(sample), return_index=True)  # rows in step order
            self.opens.want(shards, step[first])

    def _next_span(self, c: int) -> int | None:
        """The span after chunk `c`'s once planning is half-way through this one and it is not read (else None)."""
        start = self._span_of(c)
        nxt = start + self._span_chunks
        if c - start < self._span_chunks // 2 or nxt * self._policy.chunk_steps >= self._meta.steps:
            return None
        return None if nxt in self._spans or nxt in self._next_read else nxt

    def _read_next_span(self, nxt: int) -> None:
        """Read span `nxt` (and open its shards ahead) before any of its chunks is planned."""
        with self._lock:
            if nxt in self._spans or self._closed:
                return
            got = self._read_span(nxt)
            if got is not None:
                self._keep_span(nxt, got)

    def _open_jobs(self, shard: int) -> list[functools.partial[None]]:
        """What planning a shard needs: its footer (which rows each unit holds)."""
        path = self._loader._paths.get(shard)  # at its indexed size: an object's footer is one GET, no HEAD
        return (
            [] if path is None else [functools.partial(self._loader._reader.prepare, path, _size(self._loader, shard))]
        )

    def _check_jobs(self, shard: int) -> list[functools.partial[None]]:
        """What only serving a shard's bytes needs, opened alongside: its check against the index, its read handle.

        Planning and the read-ahead do not wait for them (a read checks the shard before it uses any of its bytes).
        """
        lo = self._loader
        path = lo._paths.get(shard)
        if path is None:
            return []
        return _check_and_handle(lo, shard, path)

    def served(self, request: np.ndarray, keys: np.ndarray | None = None) -> None:
        """The segments of `request` (their unit `keys`, if the read knew them) were read: count their uses off."""
        self.cache.served(self.keys(request["sample"]) if keys is None else keys, request["step"].astype(np.int64))

    def pump(self, steps: np.ndarray | None) -> None:
        """Read ahead what the pending steps need (no-op without prefetch)."""
        if self.prefetch is not None and not self._closed:
            self.prefetch.pump(steps)

    def close(self) -> None:
        self._closed = True
        self.opens.close()
        if self.prefetch is not None:
            self.prefetch.close()
        with self._lock:
            self._units.close()
        self.cache.close()


def _keys_rows(
    loader: Any, table: UnitTable, samples: np.ndarray, reader: FormatReader | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`PlanAhead.keys` and the file row of each sample (planning needs both: one lookup of the samples in the index)
    from `loader`'s index, and its paths, counters and (by default) reader.

    A shard's unit starts are asked of the reader once (`table`), then every sample's unit is one search of all of
    them (session 27: a reader's `units` per shard per chunk planned was the largest part of planning a chunk). A
    shard whose units cannot be told (its footer does not read: the read itself reports it, with the verifier's
    words) is asked again at the next call, and counted as a planning error each time."""
    lo = loader
    reader = lo._reader if reader is None else reader
    pos, _ = lo._index.locate(samples)
    shard, row = lo._index.shard_row_at(pos)
    keys = table.keys(shard, row)
    if not (keys < 0).any():  # every shard told (no `np.unique` of the shards: ~20 us a chunk)
        return keys, row
    new = [s for s in sorted(set(shard[keys < 0].tolist())) if s not in table]  # (a fixed order of reader calls)
    if new:
        starts: dict[int, np.ndarray] = {}
        for s in new:
            try:
                got = reader.unit_starts(lo._paths[int(s)])
            except (LoomError, OSError, pa.ArrowException):
                lo._counters.plan_errors += 1
                continue
            if got is not None:
                starts[s] = got
        table.add(starts)
    return table.keys(shard, row), row


class UnitTable:
    """Where the read units of a loader's shards start, for the shards told so far: the unit key of any (shard, row)
    in one search, however many shards a chunk reads.

    The shards' rows are laid end to end (sorted by shard) and each unit's first row placed in that one row space, so
    a unit is a `searchsorted` of it, exactly as `FormatReader.units` searches one shard's starts (an empty unit is
    passed over the same way). Rebuilt when shards are added (once each); read from any thread (one tuple swapped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: dict[int, np.ndarray] = {}
        empty = np.zeros(0, dtype=np.int64)
        # shards (sorted), their first row in the row space, their rows, their first unit's place, every unit's start
        self._table: tuple[np.ndarray, ...] = (empty, empty, empty, empty, empty)

    def __contains__(self, shard: int) -> bool:
        return shard in self._starts

    def add(self, starts: dict[int, np.ndarray]) -> None:
        """Shards' unit starts (`FormatReader.unit_starts`: each unit's first row, then the shard's rows)."""
        if not starts:
            return
        with self._lock:
            self._starts.update(starts)
            shards = sorted(self._starts)
            got = [np.asarray(self._starts[s], dtype=np.int64) for s in shards]
            rows = np.array([int(g[-1]) for g in got], dtype=np.int64)
            units = np.array([len(g) - 1 for g in got], dtype=np.int64)
            first = np.cumsum(rows) - rows
            place = np.cumsum(units) - units
            where = np.concatenate([g[:-1] + f for g, f in zip(got, first.tolist(), strict=True)])
            self._table = (np.array(shards, dtype=np.int64), first, rows, place, where)

    def keys(self, shard: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The unit key (`unit_key`) of each (shard, row); -1 where its shard is not told or the row is not in it."""
        shards, first, rows, place, where = self._table
        if len(shards) == 0:
            return np.full(len(shard), -1, dtype=np.int64)
        shard, row = np.asarray(shard, dtype=np.int64), np.asarray(row, dtype=np.int64)
        i = np.minimum(np.searchsorted(shards, shard), len(shards) - 1)
        unit = np.searchsorted(where, first[i] + row, side="right") - 1 - place[i]
        ok = (shards[i] == shard) & (row >= 0) & (row < rows[i]) & (unit >= 0)
        return np.where(ok, unit_key(shard, unit), -1)


def _hold_checksums(loader: Any, step: np.ndarray, sample: np.ndarray, first_step: int) -> None:
    """Hold the checksums of a span's samples (`verify: sample`); a failure is a planning error, counted: the read
    that needs one reads them again and reports it (`HeldChecksums`)."""
    try:
        loader.hold_checksums(step, sample, first_step)
    except (LoomError, OSError, pa.ArrowException):
        loader._counters.plan_errors += 1


def _check_and_handle(loader: Any, shard: int, path: Any) -> list[functools.partial[None]]:
    """A shard's check and the open of its read handle, or the check alone where its HEAD opens the handle."""
    check = functools.partial(loader._verifier.open_shard, shard, path)
    if shard not in loader._verifier.opened and loader._verifier.opens_handle(shard, path):
        return [check]
    return [check, functools.partial(open_ahead, path, loader._source.storage_options, _size(loader, shard))]


def _size(loader: Any, shard: int) -> int | None:
    """A shard's size as the index recorded it (None where the verifier does not know the shard)."""
    known = loader._verifier.shards.get(shard)
    return known.size_bytes if known is not None else None


def _warm_store(loader: Any) -> None:
    """On an object store, make its client now (0.3 s in a fresh process), so the first request pays only its trip;
    s3fs's only where the loader's requests go through it (`_needs_fsspec`)."""
    remote = next((p for p in loader._paths.values() if is_url(p)), None)
    if remote is not None:
        warm_client(remote, loader._source.storage_options, fsspec=_needs_fsspec(loader))


def _needs_fsspec(loader: Any) -> bool:
    """Whether a loader's requests go through fsspec: an object whose footer the index did not keep for it (read by a
    small GET), that is not checked and read through a pyarrow handle (`Verifier.opens_handle`), or one of whose units
    is read by a GET under `ARROW_MIN_READ` (`_small_units`). Where none does, making s3fs's client at warm-up (~0.3 s
    of CPU, session 24: beside the first window's GETs on a loaded host) is left to a request that needs it (a read
    whose handle was refused, a read ahead's coalesced span)."""
    held = loader._held_layouts
    check = loader._verifier
    return any(
        is_url(p) and (str(p) not in held or not check.opens_handle(s, p) or _small_units(loader, s, p))
        for s, p in loader._paths.items()
    )


def _small_units(loader: Any, shard: int, path: Any) -> bool:
    """Whether reading some unit (row group) of object `path` is a GET under `ARROW_MIN_READ` (those go through
    fsspec: `storage._fs._read_view`), from its footer the index kept: parsed now rather than at its first planning
    (no request; the same parse, earlier). A unit's GET is its content column's bytes (`unit_span`; a read of fewer
    bytes would fetch `RangeFile`'s 256 KiB, still under the bar). True where that cannot be told (no units told, a
    footer that does not parse: read by a small GET)."""
    reader = loader._reader
    try:
        reader.prepare(path, _size(loader, shard))
    except (LoomError, OSError, pa.ArrowException):
        return True
    unit = 0
    while (span := reader.unit_span(path, unit)) is not None:
        if span[1] - span[0] < ARROW_MIN_READ:
            return True
        unit += 1
    return unit == 0
