"""`build_index`: the Dask scan job over every source's shards, incremental by shard fingerprint.

The client fingerprints each shard and takes unchanged ones from the per-shard cache; only new or
changed shards become tasks. A shard's first task splits it (`num_parts`) and scans part 0; the
client then submits the remaining parts. Results stream back through `as_completed`, each finished
shard is cached at once (a stopped job keeps its progress), and every source is reassembled.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from distributed import Client, Future, wait
from tqdm import tqdm

from loomdata.indexing._assemble import assemble, concat_scans, write_tables
from loomdata.indexing._cache import (
    ObjectMemo,
    ShardScan,
    load_objects,
    load_scan,
    parts_dir,
    store_objects,
    store_scan,
)
from loomdata.indexing._fingerprint import (
    ShardStat,
    cache_key,
    index_fingerprint,
    samples_content_hash,
    scan_config_hash,
    stat_shard,
)
from loomdata.indexing._summary import IndexSummary, SourceSummary
from loomdata.indexing._task import Failure, FailureKind, PartOutcome, ScanJob, run_scan
from loomdata.schemas.errors import ContractError, IndexBuildError, SourceDataError
from loomdata.schemas.freshness import SETTINGS_KEY, scan_settings
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.spec import OnError, SourceSpec, Spec
from loomdata.schemas.tables import INDEX_COLUMNS, TableKind, read_table, table_metadata
from loomdata.sources._integrity import CHECKSUM, files_of, version_stamp
from loomdata.sources._layouts import write_layouts
from loomdata.storage import Location, identity, is_url

__all__ = ["DEFAULT_PART_BYTES", "build_index"]

DEFAULT_PART_BYTES = 64 * 1024 * 1024
"""Target size of one scan task's part of a shard."""

_UNREADABLE = "unreadable"
_WAIT_S = 1.0  # the scan loop wakes at least this often (a finished part is taken as soon as it is done)


def _empty_rows() -> pa.Table:
    return pa.table(
        {
            "row": pa.array([], pa.uint64()),
            "num_tokens": pa.array([], pa.uint32()),
            "num_image_tokens": pa.array([], pa.uint32()),
            "checksum": pa.array([], pa.uint32()),
        }
    )


@dataclass(slots=True)
class _SourceRun:
    """One source's state during a build: its shards, their scans so far, and the run's counts."""

    idx: int
    source: SourceSpec
    files: IndexFiles
    config_hash: str
    stats: list[ShardStat]
    keys: list[str | None]  # cache file key per shard; None: not cacheable (unreadable)
    scans: list[ShardScan | None]
    removed: int
    settings: str = ""  # scan_settings JSON, recorded in samples.parquet
    missing: list[int] = field(default_factory=list)
    parts: dict[int, dict[int, PartOutcome]] = field(default_factory=dict)
    objects: dict[str, ObjectMemo] = field(default_factory=dict)  # URL shards as stat'ed now (the next run's memo)

    def cache_path(self, shard: int) -> Path | None:
        key = self.keys[shard]
        return None if key is None else parts_dir(self.files.root) / f"{key}.parquet"


def _select(spec: Spec, names: Sequence[str] | None) -> list[SourceSpec]:
    if names is None:
        return list(spec.sources)
    unknown = [n for n in names if n not in spec.source_names]
    if unknown:
        raise IndexBuildError(
            f"unknown source(s) {', '.join(map(repr, unknown))} (known: {', '.join(spec.source_names)})"
        )
    return [spec.source(n) for n in dict.fromkeys(names)]


def _previous_paths(files: IndexFiles) -> set[str]:
    """Paths of the shards the previous index held (indexed or skipped whole)."""
    out: set[str] = set()
    try:
        if files.shards.exists():
            out.update(pq.read_table(str(files.shards), columns=["path"]).column("path").to_pylist())
        if files.errors.exists():
            errs = pq.read_table(str(files.errors), columns=["path", "row"])
            out.update(errs.filter(pc.is_null(errs.column("row"))).column("path").to_pylist())
    except (OSError, pa.ArrowException, KeyError):
        return out
    return out


def _stat(path: Location, source: SourceSpec, memo: dict[str, ObjectMemo], seen: dict[str, ObjectMemo]) -> ShardStat:
    """A shard's stat; an object whose version and size match the memo costs one HEAD and no data read."""
    if not is_url(path):
        return stat_shard(path, source.format, source.storage_options)
    idents = [identity(f, source.storage_options) for f in files_of(path, source.format)]
    version, size = ",".join(i.version for i in idents), sum(i.size for i in idents)
    old = memo.get(str(path))
    if old is not None and all(i.version for i in idents) and (old.version, old.size) == (version, size):
        stat = ShardStat(path, size, version_stamp(version), old.fingerprint, version=version)
    else:
        stat = stat_shard(path, source.format, source.storage_options)
    seen[str(path)] = ObjectMemo(stat.version, stat.size_bytes, stat.fingerprint)
    return stat


def _prepare(spec: Spec, idx: int, source: SourceSpec) -> _SourceRun:
    """Stat and fingerprint a source's shards and load the cached scans of unchanged ones."""
    clash = [m for m in source.metadata if m in INDEX_COLUMNS]
    if clash:
        raise IndexBuildError(
            f"source {source.name!r}: metadata column(s) {', '.join(map(repr, clash))} clash with index "
            f"columns ({', '.join(INDEX_COLUMNS)}); rename them in the files or drop them from `metadata`"
        )
    files = IndexFiles.of(spec.workdir, source.name)
    config = scan_config_hash(spec, source)
    paths = spec.resolve_paths(source)
    settings = json.dumps(scan_settings(spec, source), sort_keys=True)
    run = _SourceRun(idx, source, files, config, [], [], [], removed=0, settings=settings)
    memo = load_objects(files.root)
    for path in paths:
        try:
            stat = _stat(path, source, memo, run.objects)
        except SourceDataError as e:
            if source.on_error is OnError.ERROR:
                raise
            run.stats.append(ShardStat(path, 0, 0, _UNREADABLE))
            run.keys.append(None)
            run.scans.append(ShardScan(_empty_rows(), [(None, e.reason)], skipped=True))
            continue
        run.stats.append(stat)
        run.keys.append(cache_key(stat, config))
        cached_at = run.cache_path(len(run.keys) - 1)
        run.scans.append(load_scan(cached_at) if cached_at is not None else None)
    run.missing = [i for i, s in enumerate(run.scans) if s is None]
    current = {str(p) for p in paths}
    run.removed = len(_previous_paths(files) - current)
    return run


def _failure_message(f: Failure) -> str:
    return f"row {f.row}: {f.reason}" if f.row is not None else f.reason


def _raise_failure(run: _SourceRun, f: Failure) -> None:
    if f.error is not None:
        raise f.error  # the reader's SourceDataError as raised: file, row and hint crossed intact
    raise IndexBuildError(
        f"{f.path}: the {run.source.format.value} reader of source {run.source.name!r} failed "
        f"({f.message}); this is a bug in loomdata, report it with this traceback:\n{f.detail}"
    )


class _Scanner:
    """Submits scan tasks, collects parts into whole-shard scans, caches each finished shard."""

    def __init__(self, client: Client, spec: Spec, runs: list[_SourceRun], part_bytes: int, bar: tqdm) -> None:
        self.client = client
        self.spec = spec
        self.runs = runs
        self.part_bytes = part_bytes
        self.bar = bar
        self.token = uuid.uuid4().hex[:10]
        self.pending: set[Future] = set()

    def _job(self, run: _SourceRun, shard: int) -> ScanJob:
        return ScanJob(
            source_idx=run.idx,
            shard_idx=shard,
            path=run.stats[shard].path,
            source=run.source,
            tokenizer=self.spec.tokenizer,
            images=self.spec.images,
            target_bytes=self.part_bytes,
        )

    def _key(self, run: _SourceRun, shard: int, part: int) -> str:
        return f"loom-scan-{run.source.name}-{shard}-{part}-{self.token}"

    def run(self) -> None:
        # Largest shards first (a long shard started last would stretch the job's tail).
        order = sorted(((r, s) for r in self.runs for s in r.missing), key=lambda rs: -rs[0].stats[rs[1]].size_bytes)
        jobs = [self._job(r, s) for r, s in order]
        if not jobs:
            return
        keys = [self._key(self.runs[j.source_idx], j.shard_idx, 0) for j in jobs]
        nones = [None] * len(jobs)
        futures: list[Future] = self.client.map(run_scan, jobs, nones, nones, key=keys, pure=False)
        self.pending.update(futures)
        # distributed.wait in rounds, not as_completed(with_results=True) + add(): under load (TLS clusters,
        # many small parts) that iterator was seen to miss a finished future and wait forever.
        try:
            while self.pending:
                try:
                    done, _ = wait(list(self.pending), timeout=_WAIT_S, return_when="FIRST_COMPLETED")
                except TimeoutError:  # nothing finished within _WAIT_S: wait again (a fresh wait each round)
                    continue
                for fut in sorted(done, key=lambda f: str(f.key)):  # a fixed order: same cache writes each run
                    self.pending.discard(fut)
                    if fut.status != "finished":  # the task itself failed (lost worker, cancelled)
                        e = fut.exception() if fut.status == "error" else fut.status
                        raise IndexBuildError(f"scan task {fut.key} failed: {type(e).__name__}: {e}")
                    out = fut.result()
                    fut.release()
                    if not isinstance(out, PartOutcome):
                        raise IndexBuildError(f"scan task {fut.key} returned {type(out).__name__}, not a PartOutcome")
                    self._accept(out)
        finally:
            if self.pending:
                self.client.cancel(list(self.pending))
                self.pending.clear()

    def _accept(self, out: PartOutcome) -> list[Future]:
        """Take one part's outcome; return the futures of the shard's other parts when it has some."""
        run = self.runs[out.source_idx]
        shard = out.shard_idx
        if run.scans[shard] is not None:  # already skipped whole after another part failed
            return []
        if out.failure is not None:
            if out.failure.kind is FailureKind.INTERNAL or run.source.on_error is OnError.ERROR:
                _raise_failure(run, out.failure)
            self._finish_shard(run, shard, ShardScan(_empty_rows(), [(None, _failure_message(out.failure))], True))
            return []
        parts = run.parts.setdefault(shard, {})
        parts[out.part] = out
        extra: list[Future] = []
        if out.part == 0 and out.num_parts > 1:
            job = self._job(run, shard)
            for p in range(1, out.num_parts):
                # Ahead of queued first parts: a started shard finishes (and is cached) sooner.
                key = self._key(run, shard, p)
                f = self.client.submit(run_scan, job, p, out.num_parts, key=key, pure=False, priority=1)
                extra.append(f)
            self.pending.update(extra)  # the run loop waits on everything pending
        if len(parts) == out.num_parts:
            ordered = [parts[p] for p in range(out.num_parts)]
            tables = [o.rows for o in ordered if o.rows is not None]
            where = str(run.stats[shard].path)
            rows = concat_scans(tables, where, "parts of the file") if len(tables) > 1 else tables[0]
            errors = [e for o in ordered for e in o.errors]
            self._finish_shard(run, shard, ShardScan(rows, errors))
        return extra

    def _finish_shard(self, run: _SourceRun, shard: int, scan: ShardScan) -> None:
        run.scans[shard] = scan
        run.parts.pop(shard, None)
        at = run.cache_path(shard)
        if at is not None:
            store_scan(at, scan)
        self.bar.update(1)


def _collect_garbage(run: _SourceRun) -> None:
    """Remove cached scans no current shard uses (removed or changed shards, an old scan config)."""
    folder = parts_dir(run.files.root)
    if not folder.is_dir():
        return
    keep = {f"{k}.parquet" for k in run.keys if k is not None}
    for p in folder.iterdir():
        if p.name not in keep:
            p.unlink(missing_ok=True)


def _finish(run: _SourceRun) -> SourceSummary:
    """Assemble and write one source's index (unless unchanged), and summarise it."""
    scans = [s for s in run.scans if s is not None]
    if len(scans) != len(run.stats):  # every missing shard is scanned or the job raised
        raise IndexBuildError(f"source {run.source.name!r}: {len(run.stats) - len(scans)} shard(s) were not scanned")
    tables = assemble(run.source.name, run.stats, scans, run.source.metadata)
    fp = index_fingerprint(run.config_hash, [s.fingerprint for s in run.stats], samples_content_hash(tables.samples))
    f = run.files
    unchanged = (
        f.samples.exists()
        and f.shards.exists()
        and f.errors.exists() == (tables.errors is not None)
        and _stored_fingerprint(f) == fp
        and _stored_shards_equal(f, tables.shards)  # loaders check size and mtime against shards.parquet
        and _stored_settings(f) == run.settings
        and _stored_meta(f, "checksum") == CHECKSUM  # an index of another checksum definition is rewritten
    )
    if not unchanged:
        write_tables(tables, f.samples, f.shards, f.errors, fp, {SETTINGS_KEY: run.settings})
    else:
        # the layouts of the shards scanned now; a shard whose scan was cached before layouts were kept has none
        # until it is rescanned (the scan cache's version is not bumped for it: that would re-read every shard's data
        # to save one footer GET per object open); its loaders read its footer from the object, as before
        write_layouts(f.root, tables.layouts)
    _collect_garbage(run)
    store_objects(f.root, run.objects)
    samples = tables.samples
    return SourceSummary(
        shards=tables.shards.num_rows,
        samples=samples.num_rows,
        tokens=int(pc.sum(samples.column("num_tokens")).as_py() or 0),
        image_tokens=int(pc.sum(samples.column("num_image_tokens")).as_py() or 0),
        skipped=0 if tables.errors is None else tables.errors.num_rows,
        rescanned=len(run.missing),
        reused=len(run.stats) - len(run.missing) - sum(k is None for k in run.keys),
        removed=run.removed,
        fingerprint=fp,
    )


def _stored_shards_equal(files: IndexFiles, shards: pa.Table) -> bool:
    """Whether the stored shards table holds exactly `shards` (a touched file keeps content, not mtime)."""
    try:
        return bool(read_table(files.shards, TableKind.SHARDS).equals(shards))
    except (OSError, pa.ArrowException, ContractError):
        return False


def _stored_settings(files: IndexFiles) -> str | None:
    try:
        return table_metadata(files.samples).get(SETTINGS_KEY)
    except (OSError, pa.ArrowException):
        return None


def _stored_fingerprint(files: IndexFiles) -> str | None:
    return _stored_meta(files, "fingerprint")


def _stored_meta(files: IndexFiles, key: str) -> str | None:
    try:
        return table_metadata(files.samples).get(key)
    except (OSError, pa.ArrowException):
        return None


def build_index(
    spec: Spec,
    client: Client,
    *,
    progress: bool = False,
    sources: Sequence[str] | None = None,
    part_bytes: int = DEFAULT_PART_BYTES,
) -> IndexSummary:
    """Index `spec`'s sources (or the named ones) on `client`'s cluster; rescan only changed shards.

    Raises the reader's SourceDataError (naming file and row) on bad input unless the source sets
    `on_error: skip`, and IndexBuildError when the job itself fails.
    """
    if part_bytes <= 0:
        raise IndexBuildError(f"part_bytes must be positive, got {part_bytes}")
    t0 = time.perf_counter()
    runs = [_prepare(spec, i, s) for i, s in enumerate(_select(spec, sources))]
    total = sum(len(r.missing) for r in runs)
    show = progress and sys.stderr.isatty()
    with tqdm(total=total, unit="shard", desc="loom index", disable=not show, file=sys.stderr) as bar:
        _Scanner(client, spec, runs, part_bytes, bar).run()
    summaries = {r.source.name: _finish(r) for r in runs}
    return IndexSummary(sources=summaries, elapsed_s=time.perf_counter() - t0)
