"""The Source Loader actor: owns one partition (a shard range) of one source and serves batched reads.

State is rebuilt from the plan and the partition alone (and the source's `storage_options`, given at
creation in memory: plan.json holds none, see `_storage_options`): the shard paths, the index lookup
sample -> (shard, row) for its own shards (`SampleIndex`: about 4 bytes a sample), one opened format reader
(file handles, Parquet metadata, tokenizer); the parsed plan is shared by the process's loaders
(`_plan_meta`). Nothing of it is per rank. Reads run off the event loop in the loader's own `Strand`
(serial, in order, on a few threads the process's loaders share: a thread per loader cost ~7 MiB each
in Arrow's per-thread heaps), so the worker's loop stays responsive and several loaders overlap.

Integrity (`verify` per source, see _verify): a shard is checked against `shards.parquet` when the
loader first plans (opens it ahead) or reads it, and with `verify: sample` every sample read against its
checksum in the index. A planned loader holds the checksums of the samples its plan reads from the cache's floor
to the newest step planned only (`HeldChecksums`, as planning reads the manifest); others are read again from
samples.parquet, checked to be the index the loader started with (its fingerprint, the plan's), else the read
fails with `index_changed`.
A reader that is not `thread_safe` is never inside two reads at once: while a read runs in the thread,
small reads queue behind it there instead of running inline.

Caching (`_loader_cache`, with a `CachePolicy`): each request names the step of every segment; the
loader reads the manifest a chunk of steps ahead of the newest step it served, counts which read units
(row groups) its pending steps need, hands the reader a `PlanUnitCache` that keeps a unit only until
its last planned use, and counts each served segment off. Planning is a hint: if it fails (a file the
reader cannot open yet), those units are simply not kept, and the read reports the real error.
With `CachePolicy.prefetch` (`_prefetch`), the units pending steps need are read ahead, in plan order,
a bounded number at once on the loader's prefetch threads, into the same cache and budget.
A new loader plans from `CachePolicy.start_step` in its thread before any request arrives (`warm`), and
each newly planned chunk's shards are opened concurrently first (shard checks, object HEADs and
footers), so neither the first step nor a shard first met later waits on those requests one by one.
A small read runs inline on the event loop only when it waits on nothing: its steps' manifest chunks
planned, their shards open, every unit it needs held and none being read ahead, at most
`INLINE_LOADERS` loaders in the process, and it starts no read ahead before it reads (a GET must never
block the worker's loop, nor a wait for a read ahead: at start-up of 300 loaders on one worker, inline
reads waited on the loop for read-aheads and for the cache's lock, and the gateway's TLS handshakes
took 39-83 s; benchmarks/gateway_startup.py).

Retirement (scaling, `Executor.set_loaders`): `close()` runs after any read already in the loader's
strand (serial, FIFO) and cannot interleave with an inline read (both run on the worker's event
loop); from then on every `read` fails fast with `LoaderRetired`, which is not a data error: the
constructor that sent it (a read issued just before its route switched) asks the new route at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import operator
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from loomdata.execution._heap import arrays_in_heap, maybe_trim
from loomdata.execution._loader_cache import CachePolicy, PlanUnitCache, unit_key
from loomdata.execution._partition import LoaderPartition
from loomdata.execution._plan_ahead import PlanAhead
from loomdata.execution._plan_meta import shared_plan
from loomdata.execution._sample_index import HeldChecksums, SampleIndex
from loomdata.execution._storage_options import SourceOptions
from loomdata.execution._strand import Strand
from loomdata.execution._verify import Verifier, index_changed, require_checksums, serving_error
from loomdata.schemas.errors import ExecutionError, LoomError, SourceDataError, StaleIndexError
from loomdata.schemas.freshness import require_fresh
from loomdata.schemas.layout import IndexFiles, load_objects
from loomdata.schemas.metrics import LoaderMetrics
from loomdata.schemas.records import VerifyMode
from loomdata.sources import FormatReader, Sample, make_reader
from loomdata.sources._integrity import span_checksums
from loomdata.sources._layouts import index_layouts
from loomdata.sources.images import decoded_image_tokens
from loomdata.storage import Location, is_url, location

__all__ = ["REQUEST_DTYPE", "LoaderRetired", "SegmentData", "SourceLoader", "read_segments", "read_waits"]

_INLINE_TOKENS = 1 << 16  # requests up to this many tokens are read on the event loop
INLINE_LOADERS = 16
"""Small reads stay on the event loop only while the process holds at most this many loaders: 300 loaders'
reads inline kept one worker's loop busy at start-up (decoding, waiting on the cache lock the read-ahead
threads hold) until the ranks' TLS handshakes to its gateway timed out (`benchmarks/gateway_startup.py`)."""
_LIVE: weakref.WeakSet[SourceLoader] = weakref.WeakSet()  # this process's open loaders

_cut: Callable[[np.ndarray, slice], np.ndarray] = operator.getitem  # type: ignore[assignment]
"""`a[s]`, typed for a C-level `map` over many arrays and slices."""

REQUEST_DTYPE = np.dtype([("sample", np.uint64), ("offset", np.uint32), ("length", np.uint32), ("step", np.uint32)])
"""One requested segment: `length` tokens of `sample` starting at token `offset`, for plan step `step`.

`step` only tells the loader's cache which planned use a read serves; it never changes what is read.
"""


class LoaderRetired(RuntimeError):
    """A read reached a loader after `close()` (it was replaced by a resize): retry on the current route.

    Deliberately not a LoomError: constructors fail a step at once only on data errors.
    """


@dataclass(frozen=True, slots=True)
class SegmentData:
    """A loader's answer: the requested segments' tokens end to end, in request order, and their images.

    `image_segment[k]` is the request index image `k` belongs to, `image_offset[k]` the position of
    its first placeholder token inside that segment.
    """

    tokens: np.ndarray  # int32, sum(request.length)
    images: list[np.ndarray] = field(default_factory=list)
    image_segment: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    image_offset: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))


@dataclass
class _Counters:
    """What a loader has done, for metrics (per-source samples/s)."""

    calls: int = 0
    samples: int = 0
    segments: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    plan_errors: int = 0  # manifest chunks or shards the cache could not plan (their units are not kept)
    first_t: float | None = None
    last_t: float | None = None


class SourceLoader:
    """Dask actor serving `read(request)` for the samples of one partition of one source."""

    def __init__(
        self,
        plan_dir: str,
        partition: LoaderPartition,
        cache: CachePolicy | None = None,
        storage: SourceOptions | None = None,
    ) -> None:
        """`storage`: the storage options of the partition's source (plan.json holds none; see `_storage_options`)."""
        arrays_in_heap()
        meta = shared_plan(plan_dir)
        spec = meta.spec
        self.partition = partition
        source = spec.source(partition.source)
        self._source = storage.source_record(source) if storage is not None else source
        files = IndexFiles.of(spec.workdir, partition.source)
        require_fresh(meta, spec.workdir, [partition.source])
        shards = files.shard_table()
        self._verifier = Verifier.of(
            partition.source,
            self._source.verify,
            self._source.format,
            shards,
            partition.first_shard,
            partition.stop_shard,
            self._source.storage_options,
        )
        if self._verifier.samples:
            require_checksums(files.samples, partition.source)
        columns = ["sample", "shard", "row", *(["checksum"] if self._verifier.samples else [])]
        fingerprint = meta.index_fingerprints.get(partition.source)
        table = _partition_rows(files, partition, columns, fingerprint)  # the plan's index, or StaleIndexError
        self._index = SampleIndex.of(
            table.column("sample").to_numpy(),
            table.column("shard").to_numpy(),
            table.column("row").to_numpy(),
            table.column("checksum").to_numpy() if self._verifier.samples else None,
        )
        del table
        if self._verifier.samples and cache is not None:  # planned: the plan's next samples' checksums only
            load = functools.partial(_checksums_again, files, partition, fingerprint, len(self._index))
            every = self._index.checksums
            assert isinstance(every, np.ndarray)
            held = HeldChecksums(load, len(self._index), every=every)  # held until the first span is
            self._index = dataclasses.replace(self._index, checksums=held)
        ids = shards.column("shard").to_pylist()
        paths = shards.column("path").to_pylist()
        self._held_layouts: frozenset[str] = frozenset()
        self._paths = {
            int(s): location(p)  # a URL stays a string (Path would fold its "//")
            for s, p in zip(ids, paths, strict=True)
            if partition.first_shard <= s < partition.stop_shard
        }
        self._reader: FormatReader = make_reader(self._source, spec.tokenizer, spec.images)
        if self._verifier.mode is not VerifyMode.OFF:  # objects' footers the index kept (no footer GET); checked reads
            layouts = index_layouts(files.root, shards, self._paths)
            self._reader.hold_layouts(layouts)
            self._held_layouts = frozenset(layouts)  # URLs whose footer no request reads
            if any(is_url(p) for p in self._paths.values()):  # their whole ETags, for the one-request shard check
                self._verifier.hold_versions(load_objects(files.root), self._paths)
        self._patch = spec.images.patch_size
        self._plan = PlanAhead(plan_dir, meta, self, cache) if cache is not None else None
        self._pool = Strand(f"loom-loader-{partition.source}-{partition.part}")
        self._counters = _Counters()
        self._closed = False
        self._in_thread = 0  # reads queued or running in the thread (changed only on the event loop)
        self._remote = any(is_url(p) for p in self._paths.values())
        self._warm = self._pool.submit(self._plan.warm) if self._plan is not None else None
        _LIVE.add(self)

    async def read(self, request: np.ndarray) -> SegmentData:
        """The segments of `request` (REQUEST_DTYPE): small reads inline, large ones in this actor's thread.

        A thread hop costs about a millisecond on a busy worker (GIL), more than a small read itself. A
        reader that is not thread-safe takes a small read inline only while no read is in the thread.
        After `close()` it raises `LoaderRetired` at once.
        """
        self._check_open()
        small = int(request["length"].sum()) <= _INLINE_TOKENS
        if small and (self._in_thread == 0 or self._reader.thread_safe) and self._inline_ok(request):
            return self.read_now(request, inline=True)
        self._in_thread += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.read_now, request)
        finally:
            self._in_thread -= 1

    def _inline_ok(self, request: np.ndarray) -> bool:
        """Whether a read waits on nothing: warmed up, its steps planned, its shards open and every unit it needs
        held (else it would read the manifest, or wait for an open or a read ahead queued behind other loaders'
        on the shared threads, blocking the loop); without a plan, local files."""
        if len(_LIVE) > INLINE_LOADERS or (self._warm is not None and not self._warm.done()):
            return False
        if self._plan is None:
            return not self._remote
        return (
            self._plan.ready(request)
            and self._plan.held(request)
            and not self._plan.reading(request)
            and self._checksums_held(request)
        )

    def _checksums_held(self, request: np.ndarray) -> bool:
        """Whether the checksums of every sample of `request` are held (its check reads no samples.parquet)."""
        sums = self._index.checksums
        return not isinstance(sums, HeldChecksums) or sums.covers(self._index.locate(request["sample"])[0])

    def hold_checksums(self, step: np.ndarray, sample: np.ndarray, first_step: int) -> None:
        """Planning read the manifest rows (`step`, `sample`) of a span from `first_step`: hold their checksums.

        Raises what reading the checksums again raises (`PlanAhead` counts it as a planning error)."""
        sums = self._index.checksums
        if isinstance(sums, HeldChecksums):
            pos, found = self._index.locate(sample)
            sums.hold(pos[found], step[found], first_step)

    def _release_checksums(self, cache: PlanUnitCache) -> None:
        """Reads were served (the cache's floor may have moved): drop the checksums no request from it on reads."""
        sums = self._index.checksums
        if isinstance(sums, HeldChecksums):
            sums.release(cache.floor)  # read under the cache's lock

    def read_now(self, request: np.ndarray, *, inline: bool = False) -> SegmentData:
        """Synchronous `read` (the work itself); `inline` (on the event loop): no read ahead is started before it
        (one of this request's units issued then would make the read wait for it on the loop). Over local files no
        read ahead is started before it either: the read ahead after it covers the same steps (a unit this read
        lacks it decodes itself, the same CPU as on a read-ahead thread), and the pending uses' bookkeeping of a
        second pump per request cost 7-20% of a block-shuffle replay's CPU (`loader_replay_s16_prepump_ab.json`).

        A data error (a `SourceDataError` naming the file, row and fix) reaches the constructor and the
        client intact: LoomErrors pickle by their arguments.
        """
        self._check_open()
        t0 = time.perf_counter()
        if self._plan is not None:
            self._plan.ahead(request["step"])
            if self._remote and not inline:  # this request's units not yet asked for: GETs in parallel, not in turn
                self._plan.pump(request["step"])
        out, keys, distinct = _read(
            self._reader, request, self._index, self._paths, self._patch, self.partition, self._verifier
        )
        if self._plan is not None:
            self._plan.served(request, keys)
            self._release_checksums(self._plan.cache)
            self._plan.pump(None)
        maybe_trim()  # the worker's C heap: freed arrays' pages back to the OS every few seconds
        c = self._counters
        t1 = time.perf_counter()
        c.calls += 1
        c.segments += len(request)
        c.samples += distinct
        c.tokens += len(out.tokens)
        c.busy_s += t1 - t0
        c.first_t = t0 if c.first_t is None else c.first_t
        c.last_t = t1
        return out

    async def metrics(self) -> LoaderMetrics:
        """Counters and rates of this loader (samples/s over its active wall time and per busy second)."""
        c = self._counters
        wall = (c.last_t - c.first_t) if c.first_t is not None and c.last_t is not None else 0.0
        return LoaderMetrics(
            source=self.partition.source,
            part=self.partition.part,
            calls=c.calls,
            samples=c.samples,
            segments=c.segments,
            tokens=c.tokens,
            busy_s=c.busy_s,
            samples_per_s=c.samples / wall if wall > 0 else None,
            samples_per_busy_s=c.samples / c.busy_s if c.busy_s > 0 else None,
            state_bytes=self._index.nbytes,
            rss_bytes=_rss(),
            plan_errors=c.plan_errors,
            **self._prefetch_counts(),
            **self._checksum_counts(),
            **self._decode_counts(),
        )

    def _decode_counts(self) -> dict[str, Any]:
        """What its reader and the reader's siblings (planning, reads ahead) decoded: counted per unit by the format."""
        d = self._reader.decoded
        if d is None:
            return {}
        units, rows, tokens = d.snapshot()
        return {"units_decoded": units, "samples_decoded": rows, "tokens_decoded": tokens}

    def _checksum_counts(self) -> dict[str, Any]:
        sums = self._index.checksums
        if not isinstance(sums, HeldChecksums):
            return {}
        return {"checksums_held": sums.held, "checksum_loads": sums.loads, "checksum_rereads": sums.rereads}

    def _prefetch_counts(self) -> dict[str, Any]:
        pf = self._plan.prefetch if self._plan is not None else None
        if pf is None:
            return {}
        c = pf.counters
        return {
            "get_latency_s": pf.latency(),
            "prefetch_reach_steps": pf.cache.reach,
            "prefetched": c.prefetched,
            "prefetch_hits": c.hits,
            "prefetch_errors": c.errors,
            "prefetch_waits": c.waited,
            "unit_misses": c.misses,
        }

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderRetired(
                f"loader part {self.partition.part} of source {self.partition.source!r} was retired; "
                "read from the current route"
            )

    async def close(self) -> None:
        """Retire: later reads fail fast with LoaderRetired; release open files and the strand.

        Idempotent. A read running in the strand finishes first (serial, FIFO); queued ones fail fast.
        """
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        await asyncio.get_running_loop().run_in_executor(self._pool, self._reader.close)
        if self._plan is not None:
            self._plan.close()
        self._pool.shutdown(wait=False)


def read_waits() -> list[dict[str, Any]]:
    """This process's open loaders' latest waits on units being read ahead (`Prefetcher.waits`), oldest first: where a
    run waited on storage (`benchmarks/object_store.py` runs it in each worker), with the source and part waiting."""
    out = []
    for lo in list(_LIVE):
        pf = lo._plan.prefetch if lo._plan is not None else None
        if pf is not None:
            who = {"source": lo.partition.source, "part": lo.partition.part}
            with pf._lock:  # appended under it by the reading threads
                waits = list(pf.waits)
            out += [{**who, **dataclasses.asdict(w)} for w in waits]
    return sorted(out, key=lambda w: w["at"])


def _partition_rows(
    files: IndexFiles, partition: LoaderPartition, columns: list[str], fingerprint: str | None
) -> pa.Table:
    """`columns` of the partition's rows of samples.parquet (stored order), from an index whose fingerprint is
    `fingerprint` (the plan's): StaleIndexError where the index there now is another one."""
    table, now = files.shard_samples(partition.first_shard, partition.stop_shard, columns)
    if now != fingerprint:
        raise index_changed(files.samples, partition.source, f"its fingerprint is {now}, the plan's {fingerprint}")
    return table


def _checksums_again(files: IndexFiles, partition: LoaderPartition, fingerprint: str | None, size: int) -> np.ndarray:
    """Every checksum of the partition by index position (`SampleIndex.of`'s sample order), read again from
    samples.parquet: only from the index the loader started with (the plan's fingerprint), else `index_changed`."""
    try:
        table = _partition_rows(files, partition, ["sample", "checksum"], fingerprint)
    except StaleIndexError:
        raise
    except (LoomError, OSError, pa.ArrowException) as e:  # gone, or not a readable index table now
        raise index_changed(files.samples, partition.source, f"it cannot be read again: {e}") from None
    if table.num_rows != size:
        raise index_changed(files.samples, partition.source, f"{table.num_rows} samples where it had {size}")
    order = np.argsort(table.column("sample").to_numpy(), kind="stable")
    return table.column("checksum").to_numpy()[order].astype(np.uint32)


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # psutil comes with distributed; metrics must never fail a loader
        return 0


def read_segments(
    reader: FormatReader,
    request: np.ndarray,
    index: SampleIndex,
    paths: dict[int, Location],
    patch_size: int,
    partition: LoaderPartition,
    verifier: Verifier | None = None,
) -> SegmentData:
    """Read the samples a request names (one `token_spans` pass where the reader gives spans, else one `reader.read`
    per shard) and cut out the segments.

    With a `verifier`, each shard is checked when first read, and (given the index's checksums) every
    sample read is checked against its checksum in the index.
    """
    return _read(reader, request, index, paths, patch_size, partition, verifier)[0]


def _read(
    reader: FormatReader,
    request: np.ndarray,
    index: SampleIndex,
    paths: dict[int, Location],
    patch_size: int,
    partition: LoaderPartition,
    verifier: Verifier | None,
) -> tuple[SegmentData, np.ndarray | None, int]:
    """`read_segments`, and what the loader's bookkeeping needs of it: the unit key of every segment (None where
    the per-shard path ran: the cache tells them itself) and the number of distinct samples read."""
    if request.dtype != REQUEST_DTYPE:
        raise ExecutionError(f"loader request has dtype {request.dtype}, expected {REQUEST_DTYPE}")
    samples = request["sample"]
    pos, found = index.locate(samples)
    if not found.all():
        bad = int(samples[~found][0])
        raise ExecutionError(
            f"source {partition.source!r}: sample {bad} is not in loader part {partition.part} "
            f"(samples {partition.first_sample}..{partition.stop_sample - 1}); the executor routed it wrong "
            "or the index changed: restart `loom serve`"
        )
    if type(reader).token_spans is not FormatReader.token_spans:  # a format that can give spans (else no pass)
        fast = _read_spans(reader, request, index, pos, paths, partition, verifier)
        if fast is not None:
            return fast
    out = _read_per_shard(reader, request, index, pos, paths, patch_size, partition, verifier)
    return out, None, len(np.unique(samples))


def _read_spans(
    reader: FormatReader,
    request: np.ndarray,
    index: SampleIndex,
    pos: np.ndarray,
    paths: dict[int, Location],
    partition: LoaderPartition,
    verifier: Verifier | None,
) -> tuple[SegmentData, np.ndarray, int] | None:
    """The whole request in a few vectorised passes, where the reader gives token spans (`token_spans`); else None.

    Distinct samples are sorted by index position, which is (shard, row) order (the index contract, checked):
    one `token_spans` per shard gives every sample's tokens as a view into its decoded row group; the checksums
    of all samples read are one C-level map over those views, and the segments are joined into the answer by
    one `concatenate` of views (no per-sample Python frame, no intermediate copy). A narrowed unit's uint16
    buffer is widened to int32 by that same `concatenate` (and, for the checksums, by `span_checksums`).
    """
    if len(request) == 0:
        return SegmentData(tokens=np.zeros(0, dtype=np.int32)), np.zeros(0, dtype=np.int64), 0
    upos, inverse = np.unique(pos, return_inverse=True)
    shard, row = index.shard_at(upos), index.row_at(upos)
    new_shard = np.diff(shard) != 0
    if not bool(np.all((np.diff(row) > 0) | new_shard)):
        return None  # rows not ascending within a shard: not the index contract's order (the per-shard path sorts)
    bounds = [0, *(np.flatnonzero(new_shard) + 1).tolist(), len(upos)]
    n = len(upos)
    buffers: list[np.ndarray] = []
    buffer, start = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    stop, unit = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for a, b in itertools.pairwise(bounds):
        s = int(shard[a])
        path = paths[s]
        if verifier is not None:
            verifier.open_shard(s, path)
        try:
            spans = reader.token_spans(path, row[a:b])
        except (SourceDataError, OSError) as e:
            options = verifier.options if verifier is not None else None
            raise serving_error(path, e, partition.source, options) from None
        if spans is None:
            return None
        buffer[a:b] = spans.buffer + len(buffers)
        start[a:b], stop[a:b], unit[a:b] = spans.start, spans.stop, spans.unit
        buffers.extend(spans.buffers)
    lengths = stop - start
    if verifier is not None and index.checksums is not None and verifier.samples:
        got = span_checksums(buffers, buffer, start, stop)
        expected = index.checksums[upos]
        bad = np.flatnonzero(got != expected)
        if len(bad):  # report it for the shard of the first one, as the per-shard path does
            s = int(shard[bad[0]])
            sel = np.flatnonzero(shard == s)
            smp = index.samples[upos[sel]] if index.samples is not None else upos[sel] + index.first
            verifier.compare(paths[s], row[sel], smp, lengths[sel], got[sel], expected[sel])
    offset = request["offset"].astype(np.int64)
    length = request["length"].astype(np.int64)
    first = start[inverse] + offset
    last = first + length
    over = np.flatnonzero(offset + length > lengths[inverse])
    if len(over):
        i = int(over[0])
        u = int(inverse[i])
        o, ln = int(offset[i]), int(length[i])
        raise ExecutionError(
            f"{paths[int(shard[u])]}, row {int(row[u])}: sample {int(request['sample'][i])} of source "
            f"{partition.source!r} has {int(lengths[u])} tokens but the plan uses tokens {o}..{o + ln - 1}; the file "
            "changed since indexing: re-run `loom index` and `loom plan`"
        )
    tokens = np.empty(int(length.sum()), dtype=np.int32)
    views: map[np.ndarray] = map(
        _cut, map(buffers.__getitem__, buffer[inverse].tolist()), map(slice, first.tolist(), last.tolist())
    )
    np.concatenate(list(views), out=tokens)
    return SegmentData(tokens=tokens), unit_key(shard, unit)[inverse], n


def _read_per_shard(
    reader: FormatReader,
    request: np.ndarray,
    index: SampleIndex,
    pos: np.ndarray,
    paths: dict[int, Location],
    patch_size: int,
    partition: LoaderPartition,
    verifier: Verifier | None,
) -> SegmentData:
    """The general path: one `reader.read` per shard (`Sample`s, images), each segment cut out in turn."""
    n = len(request)
    samples = request["sample"]
    shard = index.shard_at(pos)
    row = index.row_at(pos)
    checksum_of = index.checksums
    offset = request["offset"].astype(np.int64)
    length = request["length"].astype(np.int64)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(length, out=starts[1:])
    tokens = np.empty(int(starts[-1]), dtype=np.int32)
    images: list[np.ndarray] = []
    img_seg: list[int] = []
    img_off: list[int] = []
    for s in np.unique(shard):
        sel = np.flatnonzero(shard == s)
        path = paths[int(s)]
        rows, first_at, inverse = np.unique(row[sel], return_index=True, return_inverse=True)
        if verifier is not None:
            verifier.open_shard(int(s), path)
        try:
            read: list[Sample] = reader.read(path, rows)
        except (SourceDataError, OSError) as e:
            options = verifier.options if verifier is not None else None
            raise serving_error(path, e, partition.source, options) from None
        if verifier is not None and checksum_of is not None and verifier.samples:
            at = pos[sel][first_at]
            dtype = reader.checksum_dtype(path)
            verifier.check_samples(path, rows, samples[sel][first_at], checksum_of[at], read, dtype)
        for j, i in enumerate(sel.tolist()):
            smp = read[int(inverse[j])]
            o, ln = int(offset[i]), int(length[i])
            if o + ln > len(smp.tokens):
                raise ExecutionError(
                    f"{path}, row {int(row[i])}: sample {int(samples[i])} of source {partition.source!r} has "
                    f"{len(smp.tokens)} tokens but the plan uses tokens {o}..{o + ln - 1}; the file changed "
                    "since indexing: re-run `loom index` and `loom plan`"
                )
            tokens[starts[i] : starts[i] + ln] = smp.tokens[o : o + ln]
            if smp.images:
                first = 0
                for im in smp.images:
                    if o <= first < o + ln:
                        # Decoders may hand out read-only views (np.asarray of a PIL image); clients wrap
                        # arrays without copying (torch.from_numpy needs writable memory), so own them here.
                        images.append(im if im.flags.writeable else im.copy())
                        img_seg.append(i)
                        img_off.append(first - o)
                    first += decoded_image_tokens(im, patch_size)
    if not images:
        return SegmentData(tokens=tokens)
    order = np.lexsort((np.asarray(img_off), np.asarray(img_seg)))
    return SegmentData(
        tokens=tokens,
        images=[images[k] for k in order.tolist()],
        image_segment=np.asarray(img_seg, dtype=np.int32)[order],
        image_offset=np.asarray(img_off, dtype=np.int32)[order],
    )
