"""Object footers fetched once and shared by sibling readers; a loader's objects opened concurrently.

Through fsspec's in-memory filesystem (a real fsspec filesystem, no network), counted by `request_stats`.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._loader_cache import CachePolicy
from loomdata.execution._prefetch import run_concurrently
from loomdata.schemas import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.schemas.errors import SourceDataError
from loomdata.sources.parquet import ParquetReader
from loomdata.storage import request_stats, reset_request_stats

SRC = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids")
URL = "memory://loomfooters/a.parquet"


@pytest.fixture
def obj() -> Iterator[str]:
    buf = io.BytesIO()
    pq.write_table(
        pa.table({"ids": pa.array([[r, r + 1] for r in range(40)], pa.list_(pa.int32()))}), buf, row_group_size=4
    )
    fs = fsspec.filesystem("memory")
    fs.pipe("/loomfooters/a.parquet", buf.getvalue())
    reset_request_stats()
    yield URL
    fs.rm("/loomfooters", recursive=True)


def test_a_sibling_opens_a_prepared_object_without_a_request(obj: str) -> None:
    main = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    main.prepare(obj)
    fetched = request_stats()
    assert fetched["head"] == 1 and fetched["get"] >= 1, fetched
    other = main.sibling()
    reset_request_stats()
    assert other.units(obj, np.array([0, 5, 39])).tolist() == [0, 1, 9]  # opened from the shared footer
    assert request_stats() == {}
    arr, _ = other.load_unit(obj, 2)  # the row group itself: one range GET, no HEAD
    assert arr.to_pylist() == [[r, r + 1] for r in range(8, 12)]
    assert request_stats().get("head", 0) == 0 and request_stats()["get"] == 1
    assert [s.tokens.tolist() for s in main.read(obj, np.array([9, 8]))] == [[9, 10], [8, 9]]
    unrelated = ParquetReader(SRC, TokenizerSpec(), ImageSpec())  # not a sibling: fetches its own footer
    reset_request_stats()
    unrelated.units(obj, np.array([0]))
    assert request_stats()["head"] == 1


def test_concurrent_prepares_fetch_one_footer(obj: str) -> None:
    main = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    start = threading.Barrier(4)

    def job() -> None:
        start.wait(5)
        main.prepare(obj)

    assert run_concurrently([job] * 4) == 0
    assert request_stats()["head"] == 1


def test_a_missing_object_fails_prepare_naming_it_and_is_not_kept(obj: str) -> None:
    main = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    missing = "memory://loomfooters/none.parquet"
    with pytest.raises(SourceDataError, match=r"none\.parquet"):
        main.prepare(missing)
    with pytest.raises(SourceDataError, match=r"none\.parquet"):  # asked again, not a cached failure
        main.read(missing, np.array([0]))


def test_run_concurrently_runs_every_job_and_counts_failures() -> None:
    done: list[int] = []

    def ok(i: int) -> None:
        done.append(i)

    def bad() -> None:
        raise OSError("gone")

    assert run_concurrently([lambda: ok(1), bad, lambda: ok(2), bad]) == 2
    assert sorted(done) == [1, 2]
    assert run_concurrently([bad]) == 1 and run_concurrently([]) == 0


def test_cache_policy_carries_the_start_step() -> None:
    assert CachePolicy.of(1 << 20, window=4, prefetch=2, start_step=9).start_step == 9
    with pytest.raises(ValueError, match="start_step"):
        CachePolicy(worker_bytes=1, horizon_steps=1, start_step=-1)
