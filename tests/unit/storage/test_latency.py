"""The storage latency a process sees: range GETs alone, per store, their recent median (read-ahead sizing)."""

from __future__ import annotations

from collections.abc import Iterator

import fsspec
import pytest

from loomdata.storage import StorageError, read_range, request_latency, reset_request_latency
from loomdata.storage._latency import RequestLatency, store_of
from loomdata.storage._retry import RetryPolicy


def test_a_url_store_is_its_scheme_and_bucket() -> None:
    assert store_of("s3://bucket/a/b.parquet") == store_of("S3://bucket/c") == "s3://bucket"
    assert store_of("https://host:8080/x/y.jsonl") == "https://host:8080"
    assert store_of("s3://other/a") != store_of("s3://bucket/a")
    assert (
        store_of(store_of("s3://bucket/a/b.parquet")) == "s3://bucket"
    )  # a store is its own store (Prefetcher keeps stores)


def test_latency_is_the_median_of_a_stores_recent_gets_the_largest_over_the_stores_asked() -> None:
    lat = RequestLatency(window=4)
    assert lat.latency(["s3://a/x"]) == 0.0  # nothing measured yet
    for s in (0.010, 0.012, 0.500, 0.011):  # one GET of a descheduled thread does not count as the store's latency
        lat.record("s3://a/x", s)
    lat.record("s3://b/y", 0.100)
    assert lat.latency(["s3://a/other-object"]) == pytest.approx(0.0115)
    assert lat.latency(["s3://a/x", "s3://b/y"]) == pytest.approx(0.100)
    assert lat.latency(["s3://c/z"]) == 0.0
    for _ in range(4):  # only the last `window` GETs count: the store got slower
        lat.record("s3://a/x", 0.2)
    assert lat.latency(["s3://a/x"]) == pytest.approx(0.2)


@pytest.fixture
def mem() -> Iterator[str]:
    fs = fsspec.filesystem("memory")
    fs.pipe("/loomlat/blob.bin", b"x" * 4096)
    reset_request_latency()
    yield "memory://loomlat/blob.bin"
    fs.rm("/loomlat", recursive=True)
    reset_request_latency()


def test_each_range_get_is_recorded_under_its_store_and_a_failed_one_is_not(mem: str) -> None:
    assert request_latency([mem]) == 0.0
    assert read_range(mem, 0, 100) == b"x" * 100
    got = request_latency([mem])
    assert 0.0 < got < 5.0  # the real GET's duration
    assert request_latency(["memory://elsewhere/blob.bin"]) == 0.0  # another store saw no GET
    with pytest.raises(StorageError, match=r"loomlat/none\.bin"):  # a missing object: no duration recorded
        read_range("memory://loomlat/none.bin", 0, 10, policy=RetryPolicy(attempts=1))
    assert request_latency([mem]) == got  # the store's one recorded GET is still its latency
