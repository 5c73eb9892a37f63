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


def _random_table(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """A random index's shard, image and sample columns and the row counts of its row groups (0-row groups among
    them at times): shard changes inside groups, exactly at their bounds or nowhere, ids dense, sparse, dense in
    some groups only or offset, image tokens nowhere, here and there, in the last rows only or 2^31 and over."""
    n = int(rng.choice([0, 1, 2, int(rng.integers(3, 200)), int(rng.integers(200, 5001))]))
    sizes: list[int] = []
    left = n
    size = int(rng.integers(1, max(2, n // int(rng.choice([1, 2, 3, 7, 40])) + 2)))
    while left:
        rows = min(left, size if rng.random() < 0.8 else int(rng.integers(1, size + 1)))
        sizes.append(rows)
        left -= rows
        if rng.random() < 0.1:
            sizes.append(0)
    if rng.random() < 0.2:
        sizes.insert(0, 0)
    layout = rng.integers(5)
    if layout == 0:  # one shard
        shard = np.full(n, rng.integers(0, 50), dtype=np.uint64)
    elif layout == 1:  # sorted random shards: changes anywhere
        shard = np.sort(rng.integers(0, int(rng.integers(1, 40)), n))
    elif layout == 2:  # one shard a row group (or a run of them): changes exactly at group bounds
        per = int(rng.integers(1, 4))
        shard = np.repeat(np.arange(len(sizes)) // per, sizes)
    elif layout == 3:  # changes at group bounds and inside
        shard = np.repeat(np.arange(len(sizes)), sizes) * 2 + (np.arange(n) % 7 == 3)
        shard = np.maximum.accumulate(shard)
    else:  # shards at and past 2^31 (statistics of unsigned values kept in signed order would read negative)
        shard = np.sort(rng.integers(0, 4, n)) + (2**31 - 2)
    kind = rng.integers(5)
    images = np.zeros(n, dtype=np.uint64)
    if n and kind == 1:
        images[rng.integers(0, n, int(rng.integers(1, 5)))] = rng.integers(1, 1000)
    elif n and kind == 2:  # in the last rows only
        images[-int(rng.integers(1, min(n, 5) + 1)) :] = rng.integers(1, 2**32)
    elif n and kind == 3:
        images[:] = rng.integers(0, 3, n)
    ids = rng.integers(5)
    sample = np.arange(n, dtype=np.uint64)
    if ids == 1:
        sample = np.sort(rng.choice(10 * n + 1, n, replace=False)).astype(np.uint64)
    elif ids == 2 and n:  # dense up to a row, past it not
        sample[int(rng.integers(0, n)) :] += np.uint64(rng.integers(1, 10))
    elif ids == 3:
        sample += np.uint64(1)
    elif ids == 4 and n > 1:  # two rows swapped
        i, j = sorted(rng.choice(n, 2, replace=False).tolist())
        sample[[i, j]] = sample[[j, i]]
    return shard.astype(np.uint32), images.astype(np.uint32), sample, sizes


def test_every_part_count_reads_the_table_that_pq_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Randomized: many index tables (0-5000 rows, random row groups with 0-row ones among them, the layouts of
    _random_table, statistics for every column, none or some), each written by pyarrow's writer and read in 1-5
    parts (READ_PART_ROWS 1, small batches at times): the arrays equal those worked out from pq.read_table of the
    whole file, None where dense or without image tokens."""
    monkeypatch.setattr(_index_read, "READ_PART_ROWS", 1)
    monkeypatch.setenv(PLAN_THREADS_ENV, "5")
    rng = np.random.default_rng(20261207)
    for case in range(120):
        shard, images, sample, sizes = _random_table(rng)
        n = len(shard)
        name = f"s{case}"
        _write(tmp_path, name, np.zeros(n, np.uint32), images, sample, max(1, n))  # (a shards table of 1 shard)
        path = IndexFiles.of(tmp_path, name).samples
        table = pq.read_table(path)  # its schema carries the kind, version and fingerprint stamped
        table = table.set_column(table.schema.get_field_index("shard"), "shard", pa.array(shard, pa.uint32()))
        stats = [True, False, ["shard"], ["num_image_tokens"], ["sample", "num_tokens"]][case % 5]
        if not n and rng.random() < 0.5:
            sizes = []  # no row groups at all
        with pq.ParquetWriter(path, table.schema, compression="zstd", write_statistics=stats) as w:
            at = 0
            for rows in sizes:
                w.write_table(table.slice(at, rows), row_group_size=max(1, rows))
                at += rows
        md = pq.read_metadata(path)
        assert [md.row_group(g).num_rows for g in range(md.num_row_groups)] == sizes
        whole = pq.read_table(path)
        ids = whole.column("sample").to_numpy()
        img = whole.column("num_image_tokens").to_numpy()
        sh = whole.column("shard").to_numpy().astype(np.int64)
        want_runs = np.concatenate([[0], np.flatnonzero(sh[1:] != sh[:-1]) + 1, [n]]) if n else np.zeros(1)
        monkeypatch.setattr(_index_read, "BATCH", int(rng.choice([3, 64, 1 << 16])))
        for parts in range(1, 6):
            got = _index_read.read_index(tmp_path, name, parts=parts)
            where = f"case {case} ({n} rows, groups {sizes}, stats {stats}) in {parts} parts"
            assert np.array_equal(got.num_tokens, whole.column("num_tokens").to_numpy()), where
            assert got.num_tokens.dtype == np.uint32, where
            if np.array_equal(ids, np.arange(n)):
                assert got.sample is None, where
            else:
                assert got.sample is not None and np.array_equal(got.sample, ids), where
            if img.any():
                assert got.images is not None and np.array_equal(got.images, img), where
            else:
                assert got.images is None, where
            assert got.runs.dtype == np.int64 and np.array_equal(got.runs, want_runs), where
            assert got.fingerprint == f"fp-{name}", where


def _groups_of(rows: list[int]) -> list[_index_read._Group]:
    firsts = np.concatenate([[0], np.cumsum(rows)]).tolist()
    return [_index_read._Group(g, firsts[g], r, None, False) for g, r in enumerate(rows)]


@pytest.mark.parametrize(
    ("rows", "parts", "want"),
    [
        ([0, 0, 10], 2, [3]),  # a part of 0-row groups only would be read on a thread of its own
        ([11, 9], 2, [1, 1]),  # the first group past the middle row: one part only, by the first group's end
        ([10] * 8, 4, [2, 2, 2, 2]),
        ([10, 0, 10, 0], 2, [1, 3]),
        ([5, 0, 0], 3, [3]),
        ([0, 0], 3, [2]),
        ([100], 4, [1]),
        ([], 4, []),
    ],
)
def test_cut_parts_hold_rows_and_about_equal_ones(rows: list[int], parts: int, want: list[int]) -> None:
    """_cut's parts (their group counts): a group goes to the part its middle row falls in; no part holds no rows."""
    assert [len(c) for c in _index_read._cut(_groups_of(rows), parts)] == want


def test_cut_randomized() -> None:
    """Random row groups (0-row ones among them) in 1-9 parts: the parts are the groups in order, at most `parts`,
    each holding rows (a table of none: one part), none further than a group's rows from its share."""
    rng = np.random.default_rng(7)
    for _ in range(2000):
        rows = rng.integers(0, 50, int(rng.integers(1, 30)))
        rows[rng.random(len(rows)) < (1.0 if rng.random() < 0.05 else 0.2)] = 0
        parts = int(rng.integers(1, 10))
        groups = _groups_of(rows.tolist())
        cut = _index_read._cut(groups, parts)
        assert [g for c in cut for g in c] == groups
        assert 1 <= len(cut) <= parts
        sums = [sum(g.rows for g in c) for c in cut]
        if sum(sums):
            assert min(sums) > 0, (rows, parts, sums)
        assert max(sums) <= -(-sum(sums) // parts) + 2 * max(rows.tolist()), (rows, parts, sums)


@pytest.mark.parametrize("fault", ["short", "long"])
@pytest.mark.parametrize("parts", [1, 3])
def test_rows_read_other_than_the_footers_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, parts: int
) -> None:
    """A row group read short (or long) of the footer's rows raises, whatever the parts, rather than leave rows of
    num_tokens unwritten (np.empty) or write past a part's rows."""
    n = 1000
    _write(tmp_path, "s", np.repeat(np.arange(4, dtype=np.uint32), 250), np.zeros(n, np.uint32), np.arange(n), 100)
    monkeypatch.setattr(_index_read, "READ_PART_ROWS", 1)
    monkeypatch.setattr(_index_read, "BATCH", 50)
    iter_batches = pq.ParquetFile.iter_batches

    def faulty(self: pq.ParquetFile, *a: object, **kw: object) -> object:
        batches = list(iter_batches(self, *a, **kw))  # type: ignore[arg-type]
        return batches[:-1] if fault == "short" else [*batches, batches[-1]]

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", faulty)
    with pytest.raises(AssertionError, match="rows read in row groups"):
        _index_read.read_index(tmp_path, "s", parts=parts)


def test_a_parts_error_is_raised_and_every_handle_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handles a read opens (one a part) are closed when it returns and when a part's thread raises; that
    part's error is what the read raises."""
    n = 1000
    _write(tmp_path, "s", np.repeat(np.arange(4, dtype=np.uint32), 250), np.zeros(n, np.uint32), np.arange(n), 100)
    monkeypatch.setattr(_index_read, "READ_PART_ROWS", 1)
    opened: list[pq.ParquetFile] = []
    init = pq.ParquetFile.__init__

    def track(self: pq.ParquetFile, *a: object, **kw: object) -> None:
        init(self, *a, **kw)  # type: ignore[arg-type]
        opened.append(self)

    monkeypatch.setattr(pq.ParquetFile, "__init__", track)
    _index_read.read_index(tmp_path, "s", parts=3)
    assert len(opened) == 1 + 3  # the shards table's (its footer checked: dropped), then one a part
    assert all(pf.closed for pf in opened[1:])
    opened.clear()
    read_part = _index_read._read_part

    def fail_second(pf: pq.ParquetFile, groups: list[_index_read._Group], *a: object) -> object:
        if groups[0].first:
            raise OSError(f"part at {groups[0].first}")
        return read_part(pf, groups, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(_index_read, "_read_part", fail_second)
    with pytest.raises(OSError, match="part at 3"):
        _index_read.read_index(tmp_path, "s", parts=3)
    assert all(pf.closed for pf in opened[1:])
