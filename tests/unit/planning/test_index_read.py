"""Reading a source's index for planning (planning._index_read, through planning._plan._read_source): columns a row
group's statistics prove constant are not decoded, row groups read in parts on threads give the same arrays, and
what is read is what the table holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.planning import _index_read, _plan
from loomdata.planning._threads import PLAN_THREADS_ENV
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.tables import SHARDS_SCHEMA, TableKind, write_table


def _write(workdir: Path, name: str, shard: np.ndarray, images: np.ndarray, sample: np.ndarray, rows: int) -> None:
    n = len(shard)
    rng = np.random.default_rng(n)
    table = pa.table(
        {
            "sample": pa.array(sample, pa.uint64()),
            "shard": pa.array(shard, pa.uint32()),
            "row": pa.array(np.arange(n), pa.uint64()),
            "num_tokens": pa.array(rng.integers(1, 5000, n), pa.uint32()),
            "num_image_tokens": pa.array(images, pa.uint32()),
        }
    )
    files = IndexFiles.of(workdir, name)
    files.root.mkdir(parents=True, exist_ok=True)
    write_table(table, files.samples, TableKind.INDEX, {"fingerprint": f"fp-{name}"}, row_group_size=rows)
    n_shards = int(shard.max()) + 1 if n else 0
    shards = pa.table(
        {
            "shard": pa.array(np.arange(n_shards), pa.uint32()),
            "path": pa.array([f"s{i}" for i in range(n_shards)]),
            "size_bytes": pa.array([0] * n_shards, pa.uint64()),
            "mtime_ns": pa.array([0] * n_shards, pa.int64()),
            "fingerprint": pa.array(["x"] * n_shards),
            "num_rows": pa.array([0] * n_shards, pa.uint64()),
        },
        schema=SHARDS_SCHEMA,
    )
    write_table(shards, files.shards, TableKind.SHARDS)


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("case", range(12))
def test_an_index_read_with_columns_proven_by_statistics_is_the_table(
    tmp_path: Path, case: int, parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row groups of one shard and of several, image tokens in some groups only (and 2^31+ values, which statistics
    kept in signed order would read as negative), sparse sample ids, read in 1-3 parts: the arrays and shard runs
    equal those worked out from the whole table, and groups proven constant are read without those columns."""
    rng = np.random.default_rng(case)
    n, rows = int(rng.integers(1, 3000)), int(rng.integers(1, 400))
    shard = np.sort(rng.integers(0, int(rng.integers(1, 12)), n)).astype(np.uint32)
    images = np.zeros(n, dtype=np.uint32)
    if case % 3 == 1:
        images[rng.integers(0, n, 3)] = rng.integers(1, 2**32, 3, dtype=np.uint64).astype(np.uint32)
    sample = np.arange(n, dtype=np.uint64) if case % 2 else np.sort(rng.choice(10 * n, n, replace=False))
    _write(tmp_path, "s", shard, images, sample.astype(np.uint64), rows)
    monkeypatch.setattr(_index_read, "BATCH", int(rng.choice([7, 64, 1 << 16])))
    monkeypatch.setattr(_index_read, "READ_PART_ROWS", 1)
    monkeypatch.setenv(PLAN_THREADS_ENV, str(parts))
    read: list[list[str]] = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self: pq.ParquetFile, *a: object, **kw: object) -> object:
        read.append(list(kw["columns"]))  # type: ignore[arg-type]
        return iter_batches(self, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    src, fp = _plan._read_source(tmp_path, "s")
    assert fp == "fp-s"
    table = pq.read_table(IndexFiles.of(tmp_path, "s").samples)
    assert np.array_equal(src.num_tokens, table.column("num_tokens").to_numpy())
    assert np.array_equal(np.asarray(src.num_image_tokens), images)
    assert np.array_equal(np.asarray(src.sample[np.arange(n)] if case % 2 else src.sample), sample)
    want_runs = np.concatenate([[0], np.flatnonzero(shard[1:] != shard[:-1]) + 1, [n]])
    assert np.array_equal(src.runs, want_runs)
    one_shard = any(len(np.unique(shard[a : a + rows])) == 1 for a in range(0, n, rows))
    assert any("shard" not in c for c in read) == one_shard
    assert any("num_image_tokens" in c for c in read) == bool(images.any())


@pytest.mark.parametrize("layout", ["boundary", "inside", "sparse_late", "images_late", "empty_groups"])
def test_parts_join_where_the_table_changes_at_or_near_their_bounds(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard change exactly at a part's first row, one inside a part, ids dense in the first part only, image tokens
    in the last part only, and empty row groups: every part count reads the arrays one part reads, and a table of
    several parts is read through several handles (one iter_batches run each at least)."""
    n, rows = 1200, 100
    shard = np.repeat(np.arange(4, dtype=np.uint32), 300)  # changes at 300, 600, 900: part bounds of 4 parts
    if layout == "inside":
        shard = np.repeat(np.arange(5, dtype=np.uint32), [250, 250, 250, 250, 200])
    images = np.zeros(n, dtype=np.uint32)
    if layout == "images_late":
        images[-5:] = 7
    sample = np.arange(n, dtype=np.uint64)
    if layout == "sparse_late":
        sample[700:] += 10
    _write(tmp_path, "s", shard, images, sample, rows)
    if layout == "empty_groups":  # rewritten with empty row groups between full ones
        files = IndexFiles.of(tmp_path, "s")
        table = pq.read_table(files.samples)
        meta = pq.read_metadata(files.samples).metadata
        with pq.ParquetWriter(files.samples, table.schema.with_metadata(meta)) as w:
            for a in range(0, n, rows):
                w.write_table(table.slice(a, rows))
                w.write_table(table.slice(0, 0))
    monkeypatch.setattr(_index_read, "READ_PART_ROWS", 1)
    calls = 0
    iter_batches = pq.ParquetFile.iter_batches

    def count(self: pq.ParquetFile, *a: object, **kw: object) -> object:
        nonlocal calls
        calls += 1
        return iter_batches(self, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", count)
    got = []
    for parts in (1, 2, 3, 4, 7):
        monkeypatch.setenv(PLAN_THREADS_ENV, str(parts))
        calls = 0
        src, _ = _plan._read_source(tmp_path, "s")
        assert calls >= min(parts, n // rows)
        got.append(src)
    want_runs = np.concatenate([[0], np.flatnonzero(shard[1:] != shard[:-1]) + 1, [n]])
    for src in got:
        assert np.array_equal(src.runs, want_runs)
        assert np.array_equal(src.num_tokens, got[0].num_tokens)
        assert np.array_equal(np.asarray(src.num_image_tokens), images)
        assert np.array_equal(np.asarray(src.sample[np.arange(n)]), sample)
