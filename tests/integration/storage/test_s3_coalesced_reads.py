"""Neighbouring row groups of an object read ahead in one range GET, on a real S3-protocol server (moto on loopback).

Counted, never timed: the tokens equal a local read of the same file, one GET carries several row groups, the
size bound splits a run, and a connection reset in the middle of a coalesced GET is retried.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._loader_cache import CachePolicy, PlanUnitCache, split_key, unit_key
from loomdata.execution._prefetch import Prefetcher, coalesce
from loomdata.schemas import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources.parquet import ParquetReader
from loomdata.storage import request_stats, reset_request_stats
from loomtest.s3 import DroppingProxy, S3Server

BUCKET = "loom-coalesce"
SRC = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids", metadata=["tag"])
WIDTH = 9000  # random token ids per row, 8 rows per row group: ~288 KiB, more than one plain range read fetches


def _rows(n: int) -> list[list[int]]:
    return np.random.default_rng(7).integers(0, 2**31 - 1, size=(n, WIDTH), dtype=np.int32).tolist()  # type: ignore[no-any-return]


def _parquet(n: int) -> bytes:
    """`n` rows in row groups of 8, an `ids` column and a `tag` column (whose chunks lie between the ids')."""
    buf = io.BytesIO()
    table = pa.table({"ids": pa.array(_rows(n), pa.list_(pa.int32())), "tag": pa.array([f"t{r}" for r in range(n)])})
    pq.write_table(table, buf, row_group_size=8)
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


def _tokens(got: tuple[object, int] | None) -> list[list[int]]:
    assert got is not None
    return got[0].to_pylist()  # type: ignore[attr-defined]


def test_neighbouring_row_groups_come_from_one_get_with_the_tokens_of_a_local_read(
    s3: S3Server, tmp_path: Path
) -> None:
    body = _parquet(64)
    url = _put(s3, "eight.parquet", body)
    local = tmp_path / "eight.parquet"
    local.write_bytes(body)
    reader = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    reader.prepare(url, len(body))
    spans = [reader.unit_span(url, g) for g in range(8)]
    assert all(s is not None for s in spans) and reader.unit_span(local, 0) is None  # a local file: no range read
    assert reader.unit_span(url, 8) is None
    reset_request_stats()
    got = reader.load_units(url, [2, 3, 4, 5], [None, np.array([25, 30]), None, None])
    stats = request_stats()
    assert stats["get"] == 1, stats  # four row groups, one range GET (and pyarrow's one HEAD for its handle)
    lo, hi = spans[2][0], spans[5][1]  # type: ignore[index]
    assert stats["get_bytes"] == hi - lo, (stats, lo, hi)  # the span from group 2's ids to group 5's
    rows = _rows(64)
    assert _tokens(got[0]) == rows[16:24] and _tokens(got[2]) == rows[32:40] and _tokens(got[3]) == rows[40:48]
    plain = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    for g, want in ((2, None), (3, np.array([25, 30])), (4, None)):  # kept as load_unit keeps it (rows or whole)
        ref, got_g = plain.load_unit(local, g, want), got[g - 2]
        assert ref is not None and got_g is not None and got_g[1] == ref[1]
        assert got_g[0].to_pylist() == ref[0].to_pylist()  # type: ignore[attr-defined]
    reset_request_stats()
    for g in range(2, 6):
        reader.load_unit(url, g)
    assert request_stats()["get"] == 4  # one at a time: four GETs


def test_the_read_ahead_joins_pending_neighbours_within_the_size_bound(s3: S3Server) -> None:
    body = _parquet(64)
    url = _put(s3, "ahead.parquet", body)
    main = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    main.prepare(url, len(body))
    policy = CachePolicy(worker_bytes=1 << 22, horizon_steps=6, prefetch=2)
    cache = PlanUnitCache("p", steps=50, policy=policy, shard_of={url: 3})
    pf = Prefetcher(cache, main.sibling, {3: url}, 2, "t", assumed_steps_per_s=0.0)
    main.use_unit_cache(pf)
    order = [4, 1, 6, 0, 2, 5]  # step s reads row group order[s]; group 7 first at step 20 (beyond the horizon)
    rows = np.array([8 * g + i for g in order for i in (0, 5)] + [60])
    steps = np.array([s for s in range(len(order)) for _ in (0, 1)] + [20])
    cache.plan(unit_key(3, main.units(url, rows)), steps, None)
    reset_request_stats()
    pf.pump(np.array([0]))
    assert pf.settle(10)
    assert pf.counters.reads == 2 and pf.counters.issued == 6 and pf.counters.prefetched == 6  # [4, 5, 6], [0, 1, 2]
    assert request_stats()["get"] == 2, request_stats()
    reference = _rows(64)
    for s in range(len(order)):
        sel = steps == s
        assert [x.tokens.tolist() for x in main.read(url, rows[sel])] == [reference[r] for r in rows[sel].tolist()]
        cache.served(unit_key(3, main.units(url, rows[sel])), steps[sel])
    assert pf.counters.hits == 6 and pf.counters.misses == 0 and request_stats()["get"] == 2
    pf.close()
    cache.close()

    def span(k: int) -> tuple[int, int] | None:
        return main.unit_span(url, split_key(k)[1])

    keys = [int(k) for k in unit_key(3, np.arange(8))]
    first, third = span(keys[0]), span(keys[2])
    assert first is not None and third is not None
    bound = third[1] - first[0]  # three row groups' ids and the tag chunks between them
    runs = coalesce(keys, set(keys), span, reads=8, max_bytes=bound)
    assert sorted(k for r in runs for k in r) == keys and max(len(r) for r in runs) >= 2
    for run, after in zip(runs, [*runs[1:], None], strict=True):
        assert run == list(range(run[0], run[0] + len(run)))  # neighbours only
        lo, hi = span(run[0]), span(run[-1])
        assert lo is not None and hi is not None and hi[1] - lo[0] <= bound  # the bound holds
        if after is not None:  # and each run is as long as it allows: its next neighbour would break it
            nxt = span(after[0])
            assert nxt is not None and nxt[1] - lo[0] > bound


def test_a_reset_in_the_middle_of_a_coalesced_get_is_retried(s3: S3Server) -> None:
    """The endpoint is set only in the source's storage_options (a proxy that cuts its first responses)."""
    body = _parquet(128)  # a coalesced GET of 8 groups (2.3 MB) is cut mid-body
    url = _put(s3, "reset.parquet", body)
    proxy = DroppingProxy(s3.port, drops=2, cut=4096)
    try:
        footer = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
        footer.prepare(url, len(body))  # straight to the server: the proxy's first connection is the coalesced GET
        src = SRC.model_copy(update={"storage_options": {"s3": {"endpoint_url": proxy.endpoint}}})
        reader = ParquetReader(src, TokenizerSpec(), ImageSpec())
        reader._layouts = footer._layouts  # the footer held, as a loader's read-ahead readers share it
        reset_request_stats()
        got = reader.load_units(url, list(range(4, 12)), [None] * 8)
        assert proxy.dropped >= 1, (proxy.dropped, proxy.connections)
        assert request_stats()["get"] == 1, request_stats()  # one GET counted; its retries are underneath
        rows = _rows(128)
        assert [_tokens(g) for g in got] == [rows[8 * g : 8 * g + 8] for g in range(4, 12)]
    finally:
        proxy.close()
