"""A Source Loader over S3 opens its objects and reads its first steps ahead before any request (real moto server).

The loader runs in this process (what a Dask actor runs): once it has warmed up and its read-ahead settled,
serving the start step fetches no unit (the loader's read-ahead counters) and opens no object (no HEAD in
the process's request counts); its tokens equal an independent read of the local copy, and a small read of
a step nobody read ahead is sent to the loader's thread instead of the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.execution import _prefetch
from loomdata.execution._loader import SourceLoader
from loomdata.execution._loader_cache import CachePolicy
from loomdata.execution._partition import partition_source
from loomdata.execution._plan_ahead import _needs_fsspec
from loomdata.execution._verify import Verifier
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import IndexFiles, parse_spec, read_manifest, read_plan
from loomdata.storage import _fs, request_stats, reset_request_stats
from loomdata.storage._arrow import ARROW_MIN_READ
from loomtest.s3 import S3Server
from loomtest.stream import step_request

BUCKET = "loom-warm"


def _write(root: Path) -> dict[str, list[np.ndarray]]:
    """Three Parquet files of 96 documents in row groups of 16; the documents per file name."""
    rng = np.random.default_rng(7)
    out = {}
    root.mkdir(parents=True, exist_ok=True)
    for k in range(3):
        docs = [rng.integers(1, 5000, size=int(n), dtype=np.int32) for n in rng.integers(30, 300, size=96)]
        pq.write_table(
            pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), root / f"p{k}.parquet", row_group_size=16
        )
        out[f"p{k}.parquet"] = docs
    return out


def _write_large(root: Path) -> dict[str, list[np.ndarray]]:
    """Two Parquet files of 96 documents in row groups of 48, each row group over `ARROW_MIN_READ` (read through
    pyarrow's handle, as every request of such a loader is)."""
    rng = np.random.default_rng(8)
    out = {}
    root.mkdir(parents=True, exist_ok=True)
    for k in range(2):
        docs = [rng.integers(1, 1 << 30, size=int(n), dtype=np.int32) for n in rng.integers(3000, 5000, size=96)]
        table = pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))})
        pq.write_table(table, root / f"p{k}.parquet", row_group_size=48, use_dictionary=False, compression="none")
        assert pq.ParquetFile(root / f"p{k}.parquet").metadata.row_group(0).total_byte_size > ARROW_MIN_READ
        out[f"p{k}.parquet"] = docs
    return out


def _plan(
    tmp: Path, s3: S3Server, dask_client: Client, write: Any = _write, prefix: str = "warm"
) -> tuple[Path, dict[str, list[np.ndarray]]]:
    docs = write(tmp / "data")
    s3.upload_dir(tmp / "data", BUCKET, prefix)
    source: dict[str, Any] = {
        "name": "web",
        "format": "parquet",
        "paths": [f"s3://{BUCKET}/{prefix}/*.parquet"],
        "tokens_field": "tokens",
        "shuffle": "block",
        "block_size": 16,
        "window": 2,
    }
    raw = {
        "name": "s3-warm",
        "workdir": str(tmp / "work"),
        "sources": [source],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 512, "steps": 30, "dp_size": 2, "micro_batches": 1},
    }
    spec = parse_spec(raw, tmp)
    build_index(spec, dask_client)
    return Path(make_plan(spec).plan_dir), docs


def _loader(plan_dir: Path, start: int, chunk: int) -> SourceLoader:
    meta = read_plan(plan_dir)
    files = IndexFiles.of(meta.spec.workdir, meta.sources[0])
    (part,) = partition_source(0, meta.sources[0], files.sample_shards().column("shard").to_numpy(), 1)
    policy = CachePolicy(worker_bytes=64 << 20, horizon_steps=6, chunk_steps=chunk, prefetch=4, start_step=start)
    return SourceLoader(str(plan_dir), part, policy)


def _expected(plan_dir: Path, req: np.ndarray, docs: dict[str, list[np.ndarray]]) -> np.ndarray:
    """The request's tokens read from the local files, by the index's (sample -> path, row)."""
    meta = read_plan(plan_dir)
    files = IndexFiles.of(meta.spec.workdir, meta.sources[0])
    samples = files.samples_of_shards(0, 1 << 30, ["sample", "shard", "row"])
    shards = files.shard_table()
    path_of = dict(zip(shards.column("shard").to_pylist(), shards.column("path").to_pylist(), strict=True))
    where = {
        int(s): (path_of[int(sh)], int(r))
        for s, sh, r in zip(*(samples.column(c).to_numpy() for c in ("sample", "shard", "row")), strict=True)
    }
    parts = []
    for sample, off, n in zip(req["sample"], req["offset"], req["length"], strict=True):
        path, row = where[int(sample)]
        parts.append(docs[str(path).rsplit("/", 1)[-1]][row][int(off) : int(off) + int(n)])
    return np.concatenate(parts)


@pytest.mark.parametrize(("start", "chunk"), [(0, 32), (12, 32), (5, 2)], ids=["start", "resume", "chunks"])
def test_the_start_step_is_served_without_a_storagestep_request(
    dask_client: Client, s3: S3Server, tmp_path: Path, start: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`chunks`: manifest chunks of 2 steps, so most of the reach is planned by the background planner.

    No assumed step rate: the reach is the horizon, so the plan's later steps are not read ahead at warm-up.
    """
    monkeypatch.setattr(_prefetch, "FAST_STEPS_PER_S", 0.0)
    plan_dir, docs = _plan(tmp_path, s3, dask_client)
    reset_request_stats()
    loader = _loader(plan_dir, start, chunk)
    try:
        assert loader._warm is not None
        loader._warm.result(timeout=60)
        assert loader._plan is not None and loader._plan.prefetch is not None
        assert loader._plan.idle(60)
        if chunk == 2:
            assert loader._plan._planned >= {2, 3, 4, 5}  # steps 5..11: chunk 2 at once, 3..5 behind it
        warmed = request_stats()
        assert warmed.get("get", 0) >= 2 * len(loader._verifier.opened) >= 6, warmed  # shards opened, units read
        assert warmed.get("head", 0) == 0, warmed  # no HEAD at all: footers at the indexed size need none, the
        # checks' first edge GETs answer for theirs (objects under 512 KiB: no pyarrow handle opened ahead)
        req = step_request(plan_dir, start)
        assert loader._inline_ok(req)  # everything held: a small read may stay on the event loop
        reset_request_stats()
        before = dataclasses.replace(loader._plan.prefetch.counters)
        got = loader.read_now(req)
        after = loader._plan.prefetch.counters
        assert after.misses == before.misses and after.waited == before.waited, (before, after)  # no unit fetched
        assert request_stats().get("head", 0) == 0, request_stats()  # no object opened on the read path
        np.testing.assert_array_equal(got.tokens, _expected(plan_dir, req, docs))
        assert loader._plan.prefetch.counters.hits >= 1
        later = [step_request(plan_dir, s) for s in range(start + 12, 30)]
        far = next(r for r in later if not loader._plan.held(r))  # a step whose units nobody read yet
        assert not loader._inline_ok(far)  # it would wait on a GET: the loader's thread reads it
        np.testing.assert_array_equal(loader.read_now(far).tokens, _expected(plan_dir, far, docs))
    finally:
        loader._pool.submit(loader._reader.close).result()
        loader._plan.close() if loader._plan is not None else None


def _first_chunks(plan_dir: Path, chunk: int) -> tuple[dict[str, int], dict[int, set[str]]]:
    """Per object name, the first manifest chunk reading it; per chunk, the object names it reads."""
    meta = read_plan(plan_dir)
    files = IndexFiles.of(meta.spec.workdir, meta.sources[0])
    samples = files.samples_of_shards(0, 1 << 30, ["sample", "shard"])
    shards = files.shard_table()
    ids, paths = shards.column("shard").to_pylist(), shards.column("path").to_pylist()
    name_of = {int(s): str(p).rsplit("/", 1)[-1] for s, p in zip(ids, paths, strict=True)}
    shard_of = dict(zip(samples.column("sample").to_pylist(), samples.column("shard").to_pylist(), strict=True))
    t = read_manifest(plan_dir, meta, 0, meta.steps - 1)
    by_chunk: dict[int, set[str]] = {}
    for step, sample in zip(t.column("step").to_pylist(), t.column("sample").to_pylist(), strict=True):
        by_chunk.setdefault(step // chunk, set()).add(name_of[int(shard_of[sample])])
    first: dict[str, int] = {}
    for c in sorted(by_chunk):
        for name in by_chunk[c]:
            first.setdefault(name, c)
    return first, by_chunk


def test_a_read_never_waits_on_another_chunks_shard_opening(
    dask_client: Client, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object's footer fetch is held back (a gate): the loader opens it ahead as soon as the manifest names it,
    and while it is held, reads of chunks that do not read it (before and after the chunk that first does, which
    the background planner is waiting on) are served with the right tokens; then that chunk is served too."""
    from loomdata.sources.parquet import ParquetReader

    chunk = 2
    plan_dir, docs = _plan(tmp_path, s3, dask_client)
    first, by_chunk = _first_chunks(plan_dir, chunk)
    late = max(first, key=lambda n: first[n])  # the object the plan reads last for the first time
    cx = first[late]
    after = [c for c in sorted(by_chunk) if c > cx and late not in by_chunk[c]]
    assert cx >= 2 and after, (first, by_chunk)  # the plan of this seed has both (a fixed plan)
    gate, began = threading.Event(), threading.Event()
    real = ParquetReader.prepare

    def prepare(self: ParquetReader, path: Any, size: int | None = None) -> None:
        if str(path).endswith(late):
            began.set()
            assert gate.wait(60)
        real(self, path, size)

    monkeypatch.setattr(ParquetReader, "prepare", prepare)
    loader = _loader(plan_dir, 0, chunk)
    try:
        assert loader._warm is not None and loader._plan is not None
        loader._warm.result(timeout=60)
        assert began.wait(60)  # opened ahead at warm-up, long before chunk cx is planned
        with ThreadPoolExecutor(1) as pool:
            for c in (cx - 1, after[0]):  # chunk cx-1 puts cx in the background planner's hands (its reach)
                req = step_request(plan_dir, c * chunk)
                got = pool.submit(loader.read_now, req).result(timeout=60)  # never waits for the gate
                np.testing.assert_array_equal(got.tokens, _expected(plan_dir, req, docs))
            assert not gate.is_set() and cx not in loader._plan._planned  # still held: chunk cx waits for it
            held_back = step_request(plan_dir, cx * chunk)
            assert not loader._plan.held(held_back)  # answered at once (the event loop asks), no footer fetched
            gate.set()
            got = pool.submit(loader.read_now, held_back).result(timeout=60)
            np.testing.assert_array_equal(got.tokens, _expected(plan_dir, held_back, docs))
        assert loader._plan.idle(60)
    finally:
        gate.set()
        loader._pool.submit(loader._reader.close).result()
        loader._plan.close() if loader._plan is not None else None


def test_the_read_ahead_starts_before_the_shard_checks_and_the_read_waits_for_them(
    dask_client: Client, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard check (HEAD and two edge reads) is held back: the warm-up still plans and reads the start
    step's units ahead; the read of the start step waits until the checks are done, then serves the right tokens;
    the loader's metrics report the GET latency it measured and the reach it used."""
    plan_dir, docs = _plan(tmp_path, s3, dask_client)
    gate = threading.Event()
    real = Verifier._check

    def check(self: Verifier, shard: int, path: Any) -> None:
        assert gate.wait(60)
        real(self, shard, path)

    monkeypatch.setattr(Verifier, "_check", check)
    loader = _loader(plan_dir, 0, 32)
    try:
        assert loader._warm is not None and loader._plan is not None and loader._plan.prefetch is not None
        loader._warm.result(timeout=60)  # planned while every check is held
        pf = loader._plan.prefetch
        assert pf.settle(60) and pf.counters.prefetched >= 1, pf.counters  # units read ahead before any check
        req = step_request(plan_dir, 0)
        assert not loader._plan.held(req)  # its shards are not checked: not a read for the event loop
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(loader.read_now, req)
            with pytest.raises(TimeoutError):
                reading.result(timeout=0.3)  # waits for the check, not served unchecked
            gate.set()
            np.testing.assert_array_equal(reading.result(timeout=60).tokens, _expected(plan_dir, req, docs))
        assert loader._plan.idle(60) and loader._plan.held(req)
        m = asyncio.run(loader.metrics())
        assert m.get_latency_s is not None and m.get_latency_s > 0  # the store's GETs, measured
        assert m.prefetch_reach_steps is not None and m.prefetch_reach_steps >= 6  # at least the horizon
    finally:
        gate.set()
        loader._pool.submit(loader._reader.close).result()
        loader._plan.close() if loader._plan is not None else None


def test_a_loader_whose_requests_all_go_through_pyarrow_makes_no_s3fs_client(
    dask_client: Client, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Footers held, every object read through a pyarrow handle and checked by its HEAD: the warm-up makes no s3fs
    client (~0.3 s of CPU) and no request asks for one; the steps served equal an independent read of the local copy.
    """
    plan_dir, docs = _plan(tmp_path, s3, dask_client, _write_large, "large")
    monkeypatch.setattr(_fs, "_MADE", set())  # as in a fresh worker: no s3fs client made yet
    made: list[str] = []
    real = _fs._fs
    monkeypatch.setattr(_fs, "_fs", lambda url, options: made.append(url) or real(url, options))
    reset_request_stats()
    loader = _loader(plan_dir, 0, 32)
    try:
        assert loader._warm is not None
        loader._warm.result(timeout=60)
        assert loader._plan is not None and loader._plan.idle(60)
        assert not _needs_fsspec(loader)
        for step in range(12):
            req = step_request(plan_dir, step)
            np.testing.assert_array_equal(loader.read_now(req).tokens, _expected(plan_dir, req, docs))
        assert made == [], made  # no s3fs filesystem asked for: checks, opens and reads through pyarrow
        assert request_stats().get("head", 0) == len(loader._verifier.opened) == 2, request_stats()  # one per object
    finally:
        loader._pool.submit(loader._reader.close).result()
        loader._plan.close() if loader._plan is not None else None
