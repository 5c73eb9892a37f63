"""A Source Loader's look at its future: plans its unit cache from the manifest, opens shards ahead, counts reads off.

`PlanAhead` reads the manifest a chunk of steps at a time (`CachePolicy.chunk_steps`), tells the loader's
`PlanUnitCache` which read units each of its pending steps needs, and counts every served segment off.
Planning is a hint: if it fails (a file the reader cannot open yet), those units are simply not kept,
and the read reports the real error.

Storage latency is kept off the read path:
- before any request (`warm`, in the loader's thread at construction) it plans from the start step and
  starts the read-ahead, so the first steps' units are in flight before a rank asks;
- each newly planned chunk's shards are opened at once (shard check, object HEAD, footer: one job per
  shard on the shared read-ahead threads), not one after another;
- only the chunks holding the steps a request reads are planned on the read path (they normally were
  long before); the chunks up to the cache's reach are planned in the background, then read ahead.

Planning uses a reader of its own (a `sibling` of the loader's, sharing its footers) under this object's
lock, so it never runs inside the loader's reader concurrently with a read.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any

import numpy as np
import pyarrow as pa

from loomdata.execution._loader_cache import CachePolicy, PlanUnitCache, unit_key
from loomdata.execution._prefetch import Prefetcher, run_concurrently, submit_shared
from loomdata.schemas.errors import LoomError
from loomdata.schemas.plan import PlanMeta, read_manifest
from loomdata.sources import FormatReader

__all__ = ["PlanAhead"]

_SPAN_ROWS = 1 << 18  # manifest rows read at once when planning the cache (this partition's are kept)


class PlanAhead:
    """The cache planning and read-ahead of one Source Loader (see the module docstring)."""

    def __init__(self, plan_dir: str, meta: PlanMeta, loader: Any, policy: CachePolicy) -> None:
        """`loader`: the `SourceLoader` this serves (its index arrays, paths, reader, verifier, counters; `_loader`
        imports this module, so it is not named here)."""
        self._plan_dir = plan_dir
        self._meta = meta
        self._loader = loader
        self._policy = policy
        self._planned: set[int] = set()  # manifest chunks counted
        self._span = (0, 0)  # manifest chunks [a, b) whose rows of this partition `_rows` holds
        self._rows: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.uint32), np.zeros(0, np.uint64))
        self._queued: set[int] = set()  # chunks handed to the background planner
        self._opened: set[int] = set()  # shards opened ahead (`_open_shards`)
        self._lock = threading.Lock()  # planning: `_planned`, the planning reader
        self._closed = False
        self._later: list[Future[None]] = []  # background planning in progress
        shard_of = {str(p): s for s, p in loader._paths.items()}
        self.cache = PlanUnitCache(meta.plan_id, meta.steps, policy, shard_of)
        self._units: FormatReader = loader._reader.sibling()  # the planner's own reader (units only)
        self.prefetch: Prefetcher | None = None
        if policy.prefetch > 0 and policy.worker_bytes > 0:
            part = loader.partition
            self.prefetch = Prefetcher(
                self.cache, loader._reader.sibling, loader._paths, policy.prefetch, f"{part.source}-{part.part}"
            )
        loader._reader.use_unit_cache(self.prefetch if self.prefetch is not None else self.cache)

    def warm(self) -> None:
        """Before any request: plan from the start step (opening those shards at once) and read ahead."""
        start = np.array([min(self._policy.start_step, max(self._meta.steps - 1, 0))], dtype=np.int64)
        self.ahead(start)
        self.pump(start)

    def keys(self, samples: np.ndarray, reader: FormatReader | None = None) -> np.ndarray:
        """Unit key per sample of this partition (-1 where the reader cannot tell); the loader's reader by default."""
        lo = self._loader
        reader = lo._reader if reader is None else reader
        pos, _ = lo._index.locate(samples)
        shard, row = lo._index.shard_at(pos), lo._index.row_at(pos)
        out = np.full(len(samples), -1, dtype=np.int64)
        for s in np.unique(shard).tolist():
            sel = np.flatnonzero(shard == s)
            try:
                units = reader.units(lo._paths[int(s)], row[sel])
            except (LoomError, OSError, pa.ArrowException):  # the read itself reports it, with the verifier's words
                lo._counters.plan_errors += 1
                continue
            if units is not None:
                out[sel] = np.where(units >= 0, unit_key(s, units), -1)
        return out

    def held(self, request: np.ndarray) -> bool:
        """Whether every row `request` reads is held now (reading it makes no storage request)."""
        keys = self.keys(request["sample"])
        if not len(keys) or not bool((keys >= 0).all()):
            return False
        return self.cache.holds(keys, self._rows_of(request["sample"]))

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
        last = min(int(np.max(steps)) + self.cache.reach, self._meta.steps - 1) // chunk
        for c in range(first, now + 1):
            if c not in self._planned:
                self._plan_once(c)
        later = [c for c in range(now + 1, last + 1) if c not in self._planned and c not in self._queued]
        if later and not self._closed:
            self._queued.update(later)
            self._later = [f for f in self._later if not f.done()]
            self._later.append(submit_shared(functools.partial(self._plan_later, later)))

    def idle(self, timeout: float) -> bool:
        """Wait until background planning and read-ahead are done (tests, benchmarks); False on timeout."""
        _, pending = wait_for(list(self._later), timeout)
        return not pending and (self.prefetch is None or self.prefetch.settle(timeout))

    def _plan_later(self, chunks: list[int]) -> None:
        for c in chunks:
            if self._closed:
                return
            self._plan_once(c)
        self.pump(None)

    def _plan_once(self, c: int) -> None:
        with self._lock:
            if c not in self._planned and not self._closed:
                self._plan_chunk(c)
                self._planned.add(c)

    def _plan_chunk(self, c: int) -> None:
        lo = self._loader
        got = self._mine(c)
        if got is None:
            return
        step, sample = got
        if len(lo._index) and len(sample):
            self._open_shards(np.unique(lo._index.shard_at(lo._index.locate(sample)[0])))
        keys = self.keys(sample, self._units)
        ok = keys >= 0
        self.cache.plan(keys[ok], step[ok], self._rows_of(sample[ok]))

    def _mine(self, c: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(step, sample) of this partition's manifest rows in chunk `c`; None if the manifest cannot be read.

        Every manifest read scans whole row groups (milliseconds), so the rows of several chunks (about
        `_SPAN_ROWS` manifest rows) are read at once and only this partition's (a small part) are kept.
        """
        chunk = self._policy.chunk_steps
        if not self._span[0] <= c < self._span[1]:
            total = sum(f.rows for f in self._meta.manifest)
            per_chunk = max(1.0, total / max(self._meta.steps, 1) * chunk)
            n = max(1, int(_SPAN_ROWS / per_chunk))
            p = self._loader.partition
            try:
                t = read_manifest(self._plan_dir, self._meta, c * chunk, (c + n) * chunk - 1)
            except (LoomError, OSError, pa.ArrowException):
                self._loader._counters.plan_errors += 1
                return None
            src = t.column("source").to_numpy()
            sample = t.column("sample").to_numpy().astype(np.uint64)
            mine = np.flatnonzero((src == p.source_id) & (sample >= p.first_sample) & (sample < p.stop_sample))
            step = t.column("step").to_numpy()[mine]
            order = np.argsort(step, kind="stable")  # stored order within a step is kept
            self._span, self._rows = (c, c + n), (step[order], sample[mine][order])
        step, sample = self._rows
        lo, hi = np.searchsorted(step, np.array([c * chunk, (c + 1) * chunk], dtype=step.dtype))
        return step[lo:hi], sample[lo:hi]

    def _open_shards(self, shards: np.ndarray) -> None:
        """Check and open the shards not opened yet, all at once (each its HEAD, edge and footer requests)."""
        lo = self._loader
        new = [int(s) for s in shards.tolist() if int(s) not in self._opened and int(s) in lo._paths]
        self._opened.update(new)
        jobs = [functools.partial(lo._verifier.open_shard, s, lo._paths[s]) for s in new]
        jobs += [functools.partial(lo._reader.prepare, lo._paths[s]) for s in new]
        run_concurrently(jobs)

    def served(self, request: np.ndarray) -> None:
        """The segments of `request` were read: count their uses off (drops units at their last use)."""
        self.cache.served(self.keys(request["sample"]), request["step"].astype(np.int64))

    def pump(self, steps: np.ndarray | None) -> None:
        """Read ahead what the pending steps need (no-op without prefetch)."""
        if self.prefetch is not None and not self._closed:
            self.prefetch.pump(steps)

    def close(self) -> None:
        self._closed = True
        if self.prefetch is not None:
            self.prefetch.close()
        with self._lock:
            self._units.close()
        self.cache.close()
