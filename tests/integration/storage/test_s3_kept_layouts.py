"""Object shards' footers kept by the index (`layouts.parquet`): a loader opens them with no footer read.

On a real S3-protocol server (moto on loopback): the index job writes a layout per object shard (none for local
files), an incremental re-run keeps it with no data read, a reader holding the kept layouts opens and reads an
object with requests for its row groups only and the same rows as a footer read; a stale row (another
fingerprint) is ignored; an index without the table (older loomdata) still serves, reading footers; an object
rewritten after indexing is still refused, naming its URL, while its old footer is held.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.execution._loader import SourceLoader
from loomdata.execution._partition import partition_source
from loomdata.execution._verify import Verifier
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import IndexFiles, LoomError, Spec, VerifyMode, parse_spec, read_plan
from loomdata.schemas.layout import load_objects
from loomdata.schemas.spec import SourceFormat
from loomdata.schemas.tables import LAYOUTS_SCHEMA, TableKind, read_table, write_table
from loomdata.sources._integrity import unchanged_object, version_stamp
from loomdata.sources._layouts import LAYOUTS_FILE, index_layouts
from loomdata.sources.parquet import ParquetReader
from loomdata.storage import (
    ObjectNotFoundError,
    _fs,
    head_identity,
    location,
    read_range,
    read_range_identity,
    request_stats,
    reset_request_stats,
)
from loomdata.storage._arrow import ARROW_MIN_READ, TRANSPORT_ENV, drop_handle
from loomtest.s3 import S3Server

BUCKET = "loom-layouts"


def _parquet(path: Path, seed: int, rows: int = 96) -> None:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 1000, size=int(n), dtype=np.int32) for n in rng.integers(20, 200, size=rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=16)


def _spec(tmp: Path, pattern: str, verify: str = "sample") -> Spec:
    source: dict[str, Any] = {
        "name": "web",
        "format": "parquet",
        "paths": [pattern],
        "tokens_field": "tokens",
        "verify": verify,
    }
    raw = {
        "name": "layouts",
        "workdir": str(tmp / "work"),
        "sources": [source],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 256, "steps": 4, "dp_size": 2, "micro_batches": 1},
    }
    return parse_spec(raw, tmp)


def _upload(s3: S3Server, tmp: Path, prefix: str, shards: int = 3) -> Path:
    root = tmp / prefix
    for i in range(shards):
        _parquet(root / f"part-{i}.parquet", seed=i)
    s3.upload_dir(root, BUCKET, prefix)
    return root


_ARRAYS = ("input_ids", "labels", "position_ids", "cu_seqlens")


def _serve_all(plan_dir: Path, dask_client: Client) -> list[tuple[Any, ...]]:
    """Every batch of the plan, per rank in order: (rank, step, micro-batch, lane, *its `_ARRAYS`)."""
    meta = read_plan(plan_dir)
    served: list[tuple[Any, ...]] = []
    with Executor(plan_dir, dask_client, constructors=1):
        for rank in range(meta.dp_size):
            with StreamClient(plan_dir, rank, retry_s=20) as stream:
                for b in stream:
                    arrays = (np.array(getattr(b, name), copy=True) for name in _ARRAYS)
                    served.append((rank, b.step, b.micro_batch, b.lane, *arrays))
    return served


def _indexed_first_shard(tmp_path: Path, prefix: str, dask_client: Client) -> tuple[Spec, pa.Table, str, int, int]:
    """Index the objects under `prefix` (verify: shard); the spec, its shards table and the first shard's URL, size
    and version stamp."""
    spec = _spec(tmp_path / "s3", f"s3://{BUCKET}/{prefix}/*.parquet", "shard")
    build_index(spec, dask_client)
    shards = IndexFiles.of(spec.workdir, "web").shard_table()
    return (
        spec,
        shards,
        shards["path"][0].as_py(),
        int(shards["size_bytes"][0].as_py()),
        int(shards["mtime_ns"][0].as_py()),
    )


def test_the_index_keeps_each_objects_footer_and_a_reader_holding_it_reads_no_footer(
    dask_client: Client, s3: S3Server, tmp_path: Path
) -> None:
    local_root = _upload(s3, tmp_path, "kept")
    spec = _spec(tmp_path / "s3", f"s3://{BUCKET}/kept/*.parquet")
    build_index(spec, dask_client)
    files = IndexFiles.of(spec.workdir, "web")
    layouts = read_table(files.root / LAYOUTS_FILE, TableKind.LAYOUTS)
    shards = files.shard_table()
    assert layouts.column("shard").to_pylist() == shards.column("shard").to_pylist() == [0, 1, 2]
    assert layouts.column("fingerprint").equals(shards.column("fingerprint"))

    # an incremental re-run reads no data and leaves the table as it was
    written = (files.root / LAYOUTS_FILE).stat().st_mtime_ns
    reset_request_stats()
    build_index(spec, dask_client)
    assert request_stats().get("get", 0) == 0, request_stats()
    assert (files.root / LAYOUTS_FILE).stat().st_mtime_ns == written

    paths = {int(s): location(p) for s, p in zip(shards["shard"].to_pylist(), shards["path"].to_pylist(), strict=True)}
    held = index_layouts(files.root, shards, paths)
    assert sorted(held) == sorted(str(p) for p in paths.values())
    url, size = str(paths[1]), int(shards["size_bytes"][1].as_py())
    assert held[url][0] == size

    reader = ParquetReader(spec.sources[0], spec.tokenizer, spec.images)
    reader.hold_layouts(held)
    reset_request_stats()
    reader.prepare(url, size)
    rows = np.array([0, 17, 95])
    assert reader.units(url, rows).tolist() == [0, 1, 5]
    assert request_stats() == {}, request_stats()  # no HEAD, no footer GET
    got = reader.read(url, rows)
    stats = request_stats()
    assert stats.get("head", 0) + stats.get("get", 0) <= 3 and stats.get("head", 0) <= 1, stats  # row groups only
    want = pq.read_table(local_root / "part-1.parquet").column("tokens").to_pylist()
    assert [s.tokens.tolist() for s in got] == [want[r] for r in rows.tolist()]
    reader.close()

    # a row of another fingerprint (a stale table) is not held: that object's footer is read from it
    stale = layouts.set_column(1, "fingerprint", pa.array(["0" * 32, *layouts["fingerprint"].to_pylist()[1:]]))
    write_table(stale, files.root / LAYOUTS_FILE, TableKind.LAYOUTS)
    assert sorted(index_layouts(files.root, shards, paths)) == sorted(str(paths[s]) for s in (1, 2))


def test_an_index_of_local_files_keeps_no_layouts(dask_client: Client, tmp_path: Path) -> None:
    for i in range(2):
        _parquet(tmp_path / "data" / f"part-{i}.parquet", seed=i)
    spec = _spec(tmp_path, str(tmp_path / "data" / "*.parquet"))
    build_index(spec, dask_client)
    files = IndexFiles.of(spec.workdir, "web")
    assert files.shards.exists() and not (files.root / LAYOUTS_FILE).exists()


def test_an_index_without_the_layouts_table_serves_the_same_batches(
    dask_client: Client, s3: S3Server, tmp_path: Path
) -> None:
    """An index written before layouts were kept: the loaders read each footer from its object, as they did, and
    serve byte for byte what loaders holding the kept footers serve."""
    _upload(s3, tmp_path, "old")
    spec = _spec(tmp_path / "s3", f"s3://{BUCKET}/old/*.parquet")
    build_index(spec, dask_client)
    files = IndexFiles.of(spec.workdir, "web")
    plan = make_plan(spec)
    shards = files.shard_table()
    paths = {int(s): location(p) for s, p in zip(shards["shard"].to_pylist(), shards["path"].to_pylist(), strict=True)}
    assert len(index_layouts(files.root, shards, paths)) == 3
    held = _serve_all(plan.plan_dir, dask_client)
    (files.root / LAYOUTS_FILE).unlink()
    assert index_layouts(files.root, shards, paths) == {}
    read = _serve_all(plan.plan_dir, dask_client)
    meta = read_plan(plan.plan_dir)
    assert len(held) == len(read) == meta.steps * meta.dp_size * meta.micro_batches
    assert sum(int((b[4] > 0).sum()) for b in held) > 0  # tokens were served, not only padding
    for a, b in zip(held, read, strict=True):
        assert a[:4] == b[:4]
        for name, x, y in zip(_ARRAYS, a[4:], b[4:], strict=True):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (a[:4], name)


@pytest.mark.parametrize("verify", ["off", "shard"])
def test_a_loader_holds_the_kept_layouts_only_when_it_checks_shards(
    dask_client: Client, s3: S3Server, tmp_path: Path, verify: str
) -> None:
    """`verify: off` reads no shard check: its loaders hold no footer the index kept (each is read from its object)."""
    _upload(s3, tmp_path, f"held-{verify}", shards=2)
    spec = _spec(tmp_path / "s3", f"s3://{BUCKET}/held-{verify}/*.parquet", verify)
    build_index(spec, dask_client)
    files = IndexFiles.of(spec.workdir, "web")
    assert (files.root / LAYOUTS_FILE).exists()
    plan_dir = make_plan(spec).plan_dir
    meta = read_plan(plan_dir)
    (part,) = partition_source(0, meta.sources[0], files.sample_shards().column("shard").to_numpy(), 1)
    loader = SourceLoader(str(plan_dir), part)
    try:
        known = set(loader._reader._layouts._known)  # type: ignore[attr-defined]
        versions = dict(loader._verifier.versions)
    finally:
        asyncio.run(loader.close())
    urls = {f"s3://{BUCKET}/held-{verify}/part-{i}.parquet" for i in range(2)}
    assert known == (set() if verify == "off" else urls)
    # the whole ETags the index recorded, for the one-GET check (none where shards are not checked)
    memo = load_objects(files.root)
    assert versions == ({} if verify == "off" else {s: memo[u].version for s, u in loader._paths.items()})


@pytest.mark.parametrize("verify", ["sample", "shard"])
def test_a_rewritten_object_is_refused_while_its_kept_footer_is_held(
    dask_client: Client, s3: S3Server, tmp_path: Path, verify: str
) -> None:
    """The kept footer is the old object's: the shard check (size, ETag, fingerprint) refuses the new one, by URL."""
    root = _upload(s3, tmp_path, f"rewrite-{verify}", shards=1)
    spec = _spec(tmp_path / "s3", f"s3://{BUCKET}/rewrite-{verify}/*.parquet", verify)
    build_index(spec, dask_client)
    files = IndexFiles.of(spec.workdir, "web")
    assert (files.root / LAYOUTS_FILE).exists()
    plan_dir = make_plan(spec).plan_dir
    url = f"s3://{BUCKET}/rewrite-{verify}/part-0.parquet"
    _parquet(root / "part-0.parquet", seed=7, rows=120)  # another size, ETag and content
    s3.boto3().upload_file(str(root / "part-0.parquet"), BUCKET, f"rewrite-{verify}/part-0.parquet")

    shards = files.shard_table()
    verifier = Verifier.of("web", VerifyMode(verify), spec.sources[0].format, shards, 0, 1)
    with pytest.raises(LoomError, match="size"):
        verifier.open_shard(0, url)  # what every read waits for before it uses a byte of the shard

    with pytest.raises(LoomError) as err, Executor(plan_dir, dask_client, constructors=1):
        for rank in range(2):
            with StreamClient(plan_dir, rank, retry_s=20) as stream:
                list(stream)
    assert url in str(err.value), str(err.value)


def test_the_open_check_of_an_unchanged_object_is_one_tiny_get(
    dask_client: Client, s3: S3Server, tmp_path: Path
) -> None:
    """Size and ETag from a 1-byte GET's response stand for the edge reads of an object under `ARROW_MIN_READ` (read
    through s3fs: no pyarrow handle to open); a same-size rewrite (new ETag) is told apart and takes the full check,
    which reports it."""
    _upload(s3, tmp_path, "quick", shards=1)
    spec, shards, url, size, stamp = _indexed_first_shard(tmp_path, "quick", dask_client)
    fmt = spec.sources[0].format
    memo = load_objects(IndexFiles.of(spec.workdir, "web").root)
    etag = memo[url].version  # the whole ETag the index recorded
    assert version_stamp(etag) == stamp
    reset_request_stats()
    assert unchanged_object(url, fmt, None, size, stamp, etag)
    assert request_stats() == {"get": 1, "get_bytes": 1}, request_stats()
    # an ETag that is not the recorded one is never taken for it, even where its CRC-32 (the stamp) agrees
    assert not unchanged_object(url, fmt, None, size, stamp, etag + "-other")
    assert not unchanged_object(url, fmt, None, size, stamp, None)  # no recorded string: the full check
    verifier = Verifier.of("web", VerifyMode.SHARD, fmt, shards, 0, 1)
    verifier.hold_versions(memo, {0: url})
    assert verifier.versions == {0: etag} and not verifier.opens_handle(0, url)
    reset_request_stats()
    verifier.open_shard(0, url)
    assert request_stats() == {"get": 1, "get_bytes": 1}, request_stats()

    body = bytearray(s3.boto3().get_object(Bucket=BUCKET, Key="quick/part-0.parquet")["Body"].read())
    assert len(body) == size
    # the same bytes written again (one part, no KMS, an unversioned bucket): the same ETag, accepted as unchanged
    s3.boto3().put_object(Bucket=BUCKET, Key="quick/part-0.parquet", Body=bytes(body))
    assert s3.boto3().head_object(Bucket=BUCKET, Key="quick/part-0.parquet")["ContentLength"] == size
    assert unchanged_object(url, fmt, None, size, stamp, etag)
    body[size // 2] ^= 0xFF  # same size, edges unchanged: only the ETag tells
    s3.boto3().put_object(Bucket=BUCKET, Key="quick/part-0.parquet", Body=bytes(body))
    assert not unchanged_object(url, fmt, None, size, stamp, etag)
    with pytest.raises(LoomError, match="ETag/version changed"):
        Verifier.of("web", VerifyMode.SHARD, fmt, shards, 0, 1).open_shard(0, url)


def test_the_open_check_of_a_large_object_is_the_head_that_opens_its_read_handle(
    dask_client: Client, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object read through a pyarrow handle: size and ETag from the HEAD that opens it (kept for the reads), so a
    shard's check and open are one request, and a loader opens no second handle beside it; a same-size rewrite is
    still told apart. With `LOOMDATA_S3_TRANSPORT=fsspec` (no handle) the check is the 1-byte GET."""
    _parquet(tmp_path / "large" / "part-0.parquet", seed=7, rows=6000)
    s3.upload_dir(tmp_path / "large", BUCKET, "large")
    spec, shards, url, size, stamp = _indexed_first_shard(tmp_path, "large", dask_client)
    assert size >= ARROW_MIN_READ
    fmt = spec.sources[0].format
    memo = load_objects(IndexFiles.of(spec.workdir, "web").root)
    etag = memo[url].version
    drop_handle(url)
    reset_request_stats()
    assert unchanged_object(url, fmt, None, size, stamp, etag)
    assert request_stats() == {"head": 1}, request_stats()
    reset_request_stats()
    assert len(read_range(url, 0, ARROW_MIN_READ, size=size)) == ARROW_MIN_READ  # through the kept handle: no HEAD
    assert request_stats() == {"get": 1, "get_bytes": ARROW_MIN_READ}, request_stats()
    with monkeypatch.context() as m:
        m.setenv(TRANSPORT_ENV, "fsspec")
        reset_request_stats()
        assert unchanged_object(url, fmt, None, size, stamp, etag)
        assert request_stats() == {"get": 1, "get_bytes": 1}, request_stats()
    verifier = Verifier.of("web", VerifyMode.SHARD, fmt, shards, 0, 1)
    verifier.hold_versions(memo, {0: url})
    assert verifier.opens_handle(0, url)  # a loader's shard open runs the check alone, no `open_ahead` beside it
    reset_request_stats()
    verifier.open_shard(0, url)
    assert request_stats() == {"head": 1} and verifier.opened == {0}, request_stats()
    body = bytearray(s3.boto3().get_object(Bucket=BUCKET, Key="large/part-0.parquet")["Body"].read())
    body[size // 2] ^= 0xFF  # same size, edges unchanged: only the ETag tells
    s3.boto3().put_object(Bucket=BUCKET, Key="large/part-0.parquet", Body=bytes(body))
    assert not unchanged_object(url, fmt, None, size, stamp, etag)
    with pytest.raises(LoomError, match="ETag/version changed"):
        Verifier.of("web", VerifyMode.SHARD, fmt, shards, 0, 1).open_shard(0, url)


def test_a_loader_turns_only_its_own_shards_layouts_into_bytes(tmp_path: Path) -> None:
    """A loader of one shard among many: the other shards' layouts stay in Arrow memory, never Python bytes."""
    n, each = 64, 256 * 1024
    urls = [f"s3://{BUCKET}/many/part-{i}.parquet" for i in range(n)]
    fps = [f"{i:032x}" for i in range(n)]
    write_table(
        pa.table(
            {
                "shard": pa.array(range(n), pa.uint32()),
                "fingerprint": pa.array(fps),
                "layout": pa.array([bytes([i]) * each for i in range(n)], pa.binary()),
            }
        ).cast(LAYOUTS_SCHEMA),
        tmp_path / LAYOUTS_FILE,
        TableKind.LAYOUTS,
    )
    shards = pa.table({"shard": range(n), "fingerprint": fps, "size_bytes": [1000 + i for i in range(n)]})
    tracemalloc.start()
    try:
        held = index_layouts(tmp_path, shards, {5: urls[5]})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held == {urls[5]: (1005, bytes([5]) * each)}
    assert peak < 4 * each, peak  # the whole column as bytes would be n * each (16 MiB)


class _RangeIgnoringS3(http.server.BaseHTTPRequestHandler):
    """An S3-like endpoint that ignores Range: every GET answers 200 with the whole (large) object."""

    size = 64 << 20
    etag = "0123456789abcdef0123456789abcdef"
    sent: ClassVar[list[int]] = []
    done: ClassVar[threading.Event] = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(self.size))
        self.send_header("ETag", f'"{self.etag}"')
        self.end_headers()
        chunk, sent = b"\0" * (1 << 20), 0
        try:
            while sent < self.size:
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the client closed the body
            pass
        finally:
            _RangeIgnoringS3.sent.append(sent)
            _RangeIgnoringS3.done.set()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_ignoring_the_range_is_not_downloaded_and_cannot_pass_the_quick_check() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeIgnoringS3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    options = {"s3": {"endpoint_url": f"http://127.0.0.1:{server.server_port}", "key": "k", "secret": "s"}}
    url = f"s3://{BUCKET}/whole.parquet"
    try:
        _RangeIgnoringS3.sent.clear()
        _RangeIgnoringS3.done.clear()
        assert read_range_identity(url, 0, 1, options) is None  # a 200 longer than asked: cannot tell
        assert _RangeIgnoringS3.done.wait(30)
        assert _RangeIgnoringS3.sent[0] < _RangeIgnoringS3.size // 2, _RangeIgnoringS3.sent  # the body was closed
        stamp = version_stamp(_RangeIgnoringS3.etag)  # the size and ETag it answers with: only the Range is wrong
        etag = _RangeIgnoringS3.etag
        assert not unchanged_object(url, SourceFormat.PARQUET, options, _RangeIgnoringS3.size, stamp, etag)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)


class _SlowRangeS3(http.server.BaseHTTPRequestHandler):
    """An S3-like endpoint that honours Range but sends a range's bytes in two parts, a pause between them (as a
    slow or congested link delivers them): a stream's read(n) returns the first part alone."""

    size = 1 << 20
    etag = "fedcba9876543210fedcba9876543210"

    def do_GET(self) -> None:
        first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        body = bytes(i % 251 for i in range(first, last + 1))
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {first}-{last}/{self.size}")
        self.send_header("ETag", f'"{self.etag}"')
        self.end_headers()
        half = len(body) // 2
        self.wfile.write(body[:half])
        self.wfile.flush()
        time.sleep(0.2)
        self.wfile.write(body[half:])

    def log_message(self, *args: Any) -> None:
        pass


def test_a_range_that_arrives_in_parts_is_read_whole() -> None:
    """The identity GET reads its range to the end, not only what arrived first (the 64 KiB edge a shard check
    hashes would otherwise come back short and be read again)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowRangeS3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    options = {"s3": {"endpoint_url": f"http://127.0.0.1:{server.server_port}", "key": "k", "secret": "s"}}
    try:
        got = read_range_identity(f"s3://{BUCKET}/parts.parquet", 0, 64 * 1024, options)
        assert got is not None
        data, ident = got
        assert data == bytes(i % 251 for i in range(64 * 1024))
        assert ident.size == _SlowRangeS3.size
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)


def test_a_large_objects_check_falls_back_to_the_1_byte_get_where_its_head_fails_or_names_no_version(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HEAD that opens a large object's handle stands for its check only where it answers with the recorded
    version: a HEAD that fails, or that names no VersionId in a versioned bucket, is followed by the 1-byte GET, which
    accepts the unchanged object; a missing object's error names its URL."""
    bucket = "loom-layouts-versioned"
    c = s3.boto3()
    c.create_bucket(Bucket=bucket)
    c.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    size = ARROW_MIN_READ + 10
    c.put_object(Bucket=bucket, Key="x.parquet", Body=np.random.default_rng(1).bytes(size))
    url, fmt = f"s3://{bucket}/x.parquet", SourceFormat.PARQUET
    head = head_identity(url, size)
    assert head is not None and head.size == size and head.version
    version, stamp = head.version, version_stamp(head.version)  # the version id, as the index records it
    reset_request_stats()
    assert unchanged_object(url, fmt, None, size, stamp, version)
    assert request_stats() == {"head": 1}, request_stats()  # the HEAD alone

    real = _fs.arrow_head

    def no_version(url: str, kwargs: Any, on_open: Any) -> Any:
        n, headers = real(url, kwargs, on_open)
        headers.pop("VersionId", None)
        return n, headers

    def failing(url: str, kwargs: Any, on_open: Any) -> Any:
        on_open()
        raise OSError("simulated HEAD failure")

    for head_of in (no_version, failing):
        monkeypatch.setattr(_fs, "arrow_head", head_of)
        reset_request_stats()
        assert unchanged_object(url, fmt, None, size, stamp, version), head_of.__name__
        assert request_stats() == {"head": 1, "get": 1, "get_bytes": 1}, (head_of.__name__, request_stats())
    monkeypatch.setattr(_fs, "arrow_head", real)
    missing = f"s3://{bucket}/missing.parquet"
    with pytest.raises(ObjectNotFoundError, match=missing):
        unchanged_object(missing, fmt, None, size, stamp, version)
