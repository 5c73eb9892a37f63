"""The round trips of a serve's start on a real S3-protocol server (moto on loopback), counted, never timed.

A footer read at the indexed size issues no HEAD; the shard check's HEAD and edge reads are in flight together
(a barrier they must all reach); an object rewritten since indexing is still read and hashed at its real size;
`warm_client` makes the storage client without sending a request, and the first read then makes none.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._verify import ShardCheck, Verifier
from loomdata.schemas import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec, VerifyMode
from loomdata.sources import _integrity
from loomdata.sources._integrity import stat_shard
from loomdata.sources.parquet import ParquetReader
from loomdata.storage import read_range, request_stats, reset_request_stats, warm_client
from loomtest.s3 import DroppingProxy, S3Server

BUCKET = "loom-start"
SRC = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids")


def _parquet(rows: int, width: int) -> bytes:
    """A Parquet file of `rows` rows of `width` token ids in row groups of 8 (over 64 KiB: a real tail read)."""
    ids = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    buf = io.BytesIO()
    pq.write_table(pa.table({"ids": pa.array(list(ids), pa.list_(pa.int32()))}), buf, row_group_size=8)
    return buf.getvalue()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3cache")).start()
    server.boto3().create_bucket(Bucket=BUCKET)
    try:
        yield server
    finally:
        server.stop()


def _put(s3: S3Server, key: str, body: bytes) -> str:
    s3.boto3().put_object(Bucket=BUCKET, Key=key, Body=body)
    return f"s3://{BUCKET}/{key}"


def test_a_footer_read_at_the_indexed_size_issues_no_head(s3: S3Server) -> None:
    body = _parquet(64, 400)
    assert len(body) > 2 * 64 * 1024
    url = _put(s3, "footer.parquet", body)
    reset_request_stats()
    reader = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    reader.prepare(url, len(body))
    assert request_stats().get("head", 0) == 0 and request_stats()["get"] == 1, request_stats()
    assert reader.units(url, np.array([0, 9, 63])).tolist() == [0, 1, 7]
    other = ParquetReader(SRC, TokenizerSpec(), ImageSpec())  # size unknown: HEAD, then the footer
    reset_request_stats()
    other.prepare(url)
    assert request_stats()["head"] == 1 and request_stats()["get"] == 1, request_stats()


@pytest.mark.parametrize("rows", [16, 96], ids=["shrunk", "grown"])
def test_a_footer_read_at_a_stale_size_reads_the_object_as_it_is_now(s3: S3Server, rows: int) -> None:
    """Rewritten since indexing with another size: the read at the old size fails, a HEAD finds the real one."""
    old = _parquet(64, 400)
    url = _put(s3, f"rewritten-{rows}.parquet", _parquet(rows, 400))
    reset_request_stats()
    reader = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    reader.prepare(url, len(old))
    assert request_stats()["head"] == 1, request_stats()
    assert reader.units(url, np.array([rows - 1, rows])).tolist() == [(rows - 1) // 8, -1]  # the new file's rows


class _Together:
    """Wraps a function so that `n` calls must be in flight at once (a barrier; broken if they run in turn)."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=20)
        self.calls: list[str] = []

    def wrap(self, name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            self.barrier.wait()  # BrokenBarrierError (the test fails) unless the others are in flight too
            return fn(*args, **kwargs)

        return run


def test_the_shard_check_sends_its_two_edge_reads_together_and_no_head(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On S3 the first edge's GET answers for the HEAD (size and ETag from its response): two requests, together."""
    body = _parquet(64, 400)
    url = _put(s3, "check.parquet", body)
    plain = stat_shard(url)  # as the index job computes it (size unknown: HEAD, then the edges)
    together = _Together(2)
    monkeypatch.setattr(_integrity, "identity", together.wrap("head", _integrity.identity))
    monkeypatch.setattr(_integrity, "read_range", together.wrap("get", _integrity.read_range))
    monkeypatch.setattr(_integrity, "read_range_identity", together.wrap("get+id", _integrity.read_range_identity))
    reset_request_stats()
    known = stat_shard(url, size=len(body))  # as a loader checks it
    assert sorted(together.calls) == ["get", "get+id"]
    assert request_stats().get("head", 0) == 0 and request_stats()["get"] == 2, request_stats()
    assert known == plain  # the same size, version stamp and fingerprint as the HEAD path gives


def test_the_check_sees_a_rewrite_through_the_get_alone(s3: S3Server) -> None:
    """A same-size rewrite with the same edges changes the ETag: the GET-only check's stat differs, as the HEAD's."""
    body = bytearray(_parquet(64, 400))
    url = _put(s3, "same-size.parquet", bytes(body))
    before = stat_shard(url, size=len(body))
    mid = len(body) // 2
    body[mid] ^= 0xFF  # outside both 64 KiB edges
    _put(s3, "same-size.parquet", bytes(body))
    after = stat_shard(url, size=len(body))
    assert after.fingerprint == before.fingerprint and after.size_bytes == before.size_bytes
    assert after.version != before.version and after.mtime_ns != before.mtime_ns
    assert after == stat_shard(url)


def test_a_check_of_an_object_now_empty_takes_the_head_path(s3: S3Server) -> None:
    """An object rewritten empty: the ranged GET is refused (416), the HEAD path hashes what is there."""
    url = _put(s3, "emptied.parquet", b"")
    got = stat_shard(url, size=200_000)
    assert got.size_bytes == 0 and got == stat_shard(url)


def test_without_a_known_size_the_edge_reads_run_together_after_the_head(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _put(s3, "check-unknown.parquet", _parquet(64, 400))
    together = _Together(2)
    monkeypatch.setattr(_integrity, "read_range", together.wrap("get", _integrity.read_range))
    assert stat_shard(url).size_bytes > 0 and together.calls == ["get", "get"]


def test_a_check_at_a_stale_size_hashes_the_object_as_it_is_now(s3: S3Server) -> None:
    """The edges read beside the HEAD at the indexed size are read again at the real one: the same stat as without."""
    old = _parquet(64, 400)
    for rows in (16, 96):
        url = _put(s3, f"check-{rows}.parquet", _parquet(rows, 400))
        got = stat_shard(url, size=len(old))
        assert got == stat_shard(url) and got.size_bytes != len(old)


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The aiobotocore clients made in this process from now on (s3fs's instance cache cleared first)."""
    import s3fs
    from aiobotocore.session import AioSession

    s3fs.S3FileSystem.clear_instance_cache()
    made: list[str] = []
    real = AioSession.create_client

    def create_client(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(str(args[0] if args else kwargs.get("service_name")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AioSession, "create_client", create_client)
    return made


def test_warm_client_makes_the_client_without_a_request(s3: S3Server, clients: list[str], tmp_path: Path) -> None:
    url = _put(s3, "warm.bin", bytes(range(256)) * 64)
    proxy = DroppingProxy(s3.port, drops=0)
    try:
        opts = {"s3": {"endpoint_url": proxy.endpoint}}
        warm_client(tmp_path / "local.parquet")  # a path: nothing made
        assert clients == []
        reset_request_stats()
        warm_client(url, opts)
        assert clients == ["s3"] and proxy.connections == 0 and request_stats() == {}
        assert read_range(url, 10, 20, opts) == bytes(range(10, 20))
        assert clients == ["s3"] and proxy.connections >= 1
    finally:
        proxy.close()


def test_a_loaders_shard_check_uses_the_sources_storage_options(s3: S3Server) -> None:
    """A source whose endpoint is set only in the spec: its check goes there, not to the environment's store."""
    body = _parquet(16, 400)
    url = _put(s3, "checked.parquet", body)
    indexed = stat_shard(url)
    want = ShardCheck(indexed.size_bytes, indexed.mtime_ns, indexed.fingerprint)
    proxy = DroppingProxy(s3.port, drops=0)
    try:
        opts = {"s3": {"endpoint_url": proxy.endpoint}}
        verifier = Verifier("s", VerifyMode.SHARD, SourceFormat.PARQUET, {0: want}, opts)
        verifier.open_shard(0, url)
        assert verifier.opened == {0} and proxy.connections >= 1  # through the spec's endpoint
    finally:
        proxy.close()
