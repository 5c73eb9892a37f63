"""Kept rows narrowed to uint16: the `KeptRows` of a `list<int32>` unit whose ids all fit [0, 65535] are held as uint16,
counted as such; a unit kept whole stays as decoded (int32).

Oracles: an independent pyarrow read of the file (tokens), `checksums` of the int32 tokens (the index's checksum of
an int32 column), and the same reads with narrowing switched off (`_narrowed` the identity: the code before it).
A unit with one id of 65536 (or a type that is not a plain int32 list) is kept as today.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._loader import REQUEST_DTYPE, _read
from loomdata.execution._partition import LoaderPartition
from loomdata.execution._sample_index import SampleIndex
from loomdata.execution._verify import ShardCheck, Verifier
from loomdata.schemas import ImageSpec, SourceDataError, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.schemas.spec import VerifyMode
from loomdata.sources import KeptRows, LruUnitCache, make_reader, parquet
from loomdata.sources._base import UnitKey
from loomdata.sources._integrity import checksums, stat_shard
from loomdata.sources.parquet import ParquetReader

RG = 40
EVERY = 20  # a `wanted` of every 20th row: 2 of 40 rows, under `_WHOLE_SHARE`: kept as `KeptRows`


class _Cache:
    """A unit cache that keeps everything offered, records `nbytes`, and wants every `every`-th row (None: all)."""

    def __init__(self, every: int | None = None) -> None:
        self.every = every
        self.items: dict[UnitKey, tuple[Any, int]] = {}

    def get(self, key: UnitKey) -> Any | None:
        hit = self.items.get(key)
        return None if hit is None else hit[0]

    def put(self, key: UnitKey, value: Any, nbytes: int) -> None:
        self.items[key] = (value, nbytes)

    def wanted(self, key: UnitKey) -> np.ndarray | None:
        if self.every is None:
            return None
        return np.arange(key[1] * RG, (key[1] + 1) * RG, self.every, dtype=np.int64)


def _reader(cache: Any = None) -> ParquetReader:
    spec = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["x"], tokens_field="ids")
    r = make_reader(spec, TokenizerSpec(), ImageSpec())
    assert isinstance(r, ParquetReader)
    if cache is not None:
        r.use_unit_cache(cache)
    return r


def _docs(seed: int, n: int, high: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = np.where(rng.random(n) < 0.2, 0, rng.integers(1, 120, size=n))  # empty documents too
    return [rng.integers(0, high, size=int(k)).tolist() for k in lens]


def _write(path: Path, docs: list[list[int]], typ: pa.DataType | None = None) -> Path:
    pq.write_table(pa.table({"ids": pa.array(docs, type=typ or pa.list_(pa.int32()))}), path, row_group_size=RG)
    return path


def _file(path: Path) -> list[list[int]]:
    return pq.read_table(path).column("ids").to_pylist()


@pytest.mark.parametrize("typ", [pa.list_(pa.int32()), pa.large_list(pa.int32())], ids=str)
@pytest.mark.parametrize("every", [None, EVERY], ids=["whole", "kept-rows"])
def test_a_narrow_unit_is_uint16_counted_narrow_and_reads_the_same_tokens(
    tmp_path: Path, typ: pa.DataType, every: int | None
) -> None:
    docs = _docs(0, 160, 50_000)
    docs[5] = [0, 65_535, 7]  # the bounds of uint16: still narrow
    path = _write(tmp_path / "n.parquet", docs, typ)
    r = _reader()
    for g in range(160 // RG):
        rows = None if every is None else np.arange(g * RG, (g + 1) * RG, every)
        got = r.load_unit(path, g, rows)
        assert got is not None
        value, nbytes = got
        arr = value.values if isinstance(value, KeptRows) else value
        assert isinstance(value, KeptRows) == (every is not None)
        assert pa.types.is_large_list(arr.type) == pa.types.is_large_list(typ)
        if every is None:  # whole: kept as decoded, read many times a byte (no widening a read)
            assert arr.type == typ and nbytes == arr.nbytes
            continue
        assert arr.type.value_type == pa.uint16()
        extra = value.rows.nbytes if isinstance(value, KeptRows) else 0
        assert nbytes == arr.nbytes + extra  # what is kept is what is counted
        want = _file(path)[g * RG : (g + 1) * RG] if rows is None else [docs[i] for i in rows.tolist()]
        assert arr.to_pylist() == want
        wide = pa.array(want, type=typ)
        assert arr.nbytes < 0.6 * wide.nbytes  # offsets aside, half the bytes


@pytest.mark.parametrize(
    ("docs", "typ"),
    [
        ([[1, 2], [65_536], [3]] * 27, pa.list_(pa.int32())),  # one id past uint16 in every group
        ([[1, 2], [3], [4, 5]] * 27, pa.list_(pa.int64())),  # not int32: `read` checks and converts as before
        ([[1, 2], [3], [4, 5]] * 27, pa.list_(pa.uint16())),  # stored narrow: its own type, checksummed as uint16
        ([[1, 2], None, [4, 5]] * 27, pa.list_(pa.int32())),  # a null list: kept as is (the read names the row)
        ([[1, None], [3], [4, 5]] * 27, pa.list_(pa.int32())),  # a null id
    ],
    ids=["id-65536", "int64", "uint16-stored", "null-list", "null-id"],
)
def test_what_cannot_be_narrowed_is_kept_as_today(tmp_path: Path, docs: list[Any], typ: pa.DataType) -> None:
    path = _write(tmp_path / "w.parquet", docs, typ)
    r = _reader()
    for g in range(2):
        got = r.load_unit(path, g)
        assert got is not None
        decoded = pq.ParquetFile(path).read_row_group(g).column("ids").combine_chunks()
        assert got[0].type == decoded.type and got[0].equals(decoded) and got[1] == decoded.nbytes


def test_the_negative_and_the_sliced(tmp_path: Path) -> None:
    """`_narrowed` directly: a negative id keeps int32; a slice keeps only the values it covers, rebased."""
    neg = pa.array([[3, -1], [2]], pa.list_(pa.int32()))
    assert parquet._narrowed(neg) is neg
    big = pa.array([[i, i + 1] for i in range(0, 400, 2)], pa.list_(pa.int32()))
    part = big.slice(50, 20)
    n = parquet._narrowed(part)
    assert n.type.value_type == pa.uint16() and n.to_pylist() == part.to_pylist()
    assert len(n.values) == 40 and n.offsets[0].as_py() == 0  # not the 400 values of the whole array
    empty = pa.array([[], []], pa.list_(pa.int32()))
    assert parquet._narrowed(empty) is empty


def test_the_byte_counts_are_of_what_is_held(tmp_path: Path) -> None:
    """Rows kept narrow are counted at their narrow bytes (about half a wide file's rows), and what is held is what is
    counted; the default LRU cache keeps whole units, as decoded (int32)."""
    narrow = _write(tmp_path / "n.parquet", _docs(1, 96, 40_000))
    wide = _write(tmp_path / "w.parquet", [[*d, 70_000] for d in _docs(1, 96, 40_000)])
    held = {}
    for name, path in (("narrow", narrow), ("wide", wide)):
        rows_cache = _Cache(EVERY)
        _reader(rows_cache).read(path, np.arange(96))
        kept = [v for v, _ in rows_cache.items.values() if isinstance(v, KeptRows)]  # (a short last group: whole)
        held[name] = sum(v.values.nbytes + v.rows.nbytes for v in kept)
        assert sum(n for v, n in rows_cache.items.values() if isinstance(v, KeptRows)) == held[name]
        want = "uint16" if name == "narrow" else "int32"
        assert len(kept) >= 2 and {str(v.values.type.value_type) for v in kept} == {want}
        lru = LruUnitCache(max_bytes=1 << 30)
        _reader(lru).read(path, np.arange(96))
        assert lru.nbytes == sum(n for _, n in lru._items.values()) == sum(v.nbytes for v, _ in lru._items.values())
        assert {str(v.type.value_type) for v, _ in lru._items.values()} == {"int32"}
    assert held["narrow"] < 0.7 * held["wide"]


@pytest.mark.parametrize("every", [None, EVERY], ids=["whole", "kept-rows"])
def test_reads_over_narrow_units_equal_the_file_and_the_wide_reads(
    tmp_path: Path, every: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`read` and `token_spans` through a cache of narrow units (hits), fresh decodes and both mixed in a request."""
    docs = _docs(2, 80, 50_000)
    path = _write(tmp_path / "n.parquet", docs)
    rng = np.random.default_rng(3)
    r = _reader(_Cache(every))
    requests = [
        np.arange(0, 40),  # groups 0..4 decoded (wide views), kept narrow
        np.arange(0, 80, 2),  # hits on the narrow units, fresh decodes of 5..9
        np.sort(rng.choice(80, size=25, replace=False)),  # all held now (or some rows not kept: decoded again)
        np.arange(0, 80, EVERY),  # rows every cache keeps: hits only
        rng.integers(0, 80, size=30),  # `read` only: unsorted, duplicates
    ]
    narrow_seen = False
    for rows in requests:
        got = [s.tokens for s in r.read(path, rows)]
        for i, t in zip(rows.tolist(), got, strict=True):
            assert t.dtype == np.int32
            assert t.tolist() == docs[i]
        if (np.diff(rows) > 0).all():
            spans = r.token_spans(path, rows)
            assert spans is not None
            for k, i in enumerate(rows.tolist()):
                buf = spans.buffers[int(spans.buffer[k])]
                assert buf.dtype in (np.int32, np.uint16)
                narrow_seen |= buf.dtype == np.uint16
                assert buf[spans.start[k] : spans.stop[k]].tolist() == docs[i]
    assert narrow_seen == (every is not None)  # whole units stay int32
    with monkeypatch.context() as m:  # the oracle: no narrowing at all
        m.setattr(parquet, "_narrowed", lambda arr: arr)
        w = _reader(_Cache(every))
        for rows in requests:
            np.testing.assert_array_equal(
                np.concatenate([s.tokens for s in w.read(path, rows)]),
                np.concatenate([s.tokens for s in r.read(path, rows)]),
            )


# -- the loader's span path over narrow units: segments and checksums ----------------------------------------------


def _corpus(tmp_path: Path) -> tuple[dict[int, Path], list[list[int]], np.ndarray, np.ndarray]:
    """Two shards (ids 0, 1): the first narrow (ids < 50,000), the second wide (one id of 70,000 per group)."""
    paths, docs, shard, row = {}, [], [], []
    for s, n in enumerate((120, 80)):
        d = _docs(10 + s, n, 50_000)
        if s == 1:
            for g in range(0, n, RG):
                d[g] = [*d[g], 70_000]
        paths[s] = _write(tmp_path / f"part-{s}.parquet", d)
        docs += d
        shard += [s] * n
        row += list(range(n))
    return paths, docs, np.array(shard), np.array(row)


def _verifier(paths: dict[int, Path]) -> Verifier:
    shards = {}
    for s, p in paths.items():
        st = stat_shard(p, SourceFormat.PARQUET)
        shards[s] = ShardCheck(st.size_bytes, st.mtime_ns, st.fingerprint)
    return Verifier("s", VerifyMode.SAMPLE, SourceFormat.PARQUET, shards)


def _requests(rng: np.random.Generator, docs: list[list[int]], n: int) -> np.ndarray:
    req = np.zeros(n, dtype=REQUEST_DTYPE)
    pick = rng.integers(0, len(docs), size=n)
    lens = np.array([len(docs[i]) for i in pick])
    offset = (rng.random(n) * (lens + 1)).astype(np.int64).clip(0, lens)
    req["sample"] = pick
    req["offset"] = offset
    req["length"] = (rng.random(n) * (lens - offset + 1)).astype(np.int64).clip(0, lens - offset)
    return req


@pytest.mark.parametrize("every", [None, EVERY], ids=["whole", "kept-rows"])
def test_the_loader_serves_and_checks_narrow_units_like_wide_ones(tmp_path: Path, every: int | None) -> None:
    """Requests over one reader (its cache fills with narrow units of shard 0, wide ones of shard 1), checked
    with `verify: sample` against the index's int32 checksums; a changed checksum of a narrow sample still fails."""
    paths, docs, shard, row = _corpus(tmp_path)
    sums = checksums([np.asarray(d, dtype=np.int32) for d in docs])
    index = SampleIndex.of(np.arange(len(docs), dtype=np.uint64), shard, row, sums)
    part = LoaderPartition(
        source_id=0, source="s", part=0, first_shard=0, stop_shard=2, first_sample=0, stop_sample=len(docs)
    )
    cache = _Cache(every)
    reader, verifier = _reader(cache), _verifier(paths)
    rng = np.random.default_rng(5)
    kept = np.zeros(8, dtype=REQUEST_DTYPE)  # whole samples every cache keeps, of both shards: hits after the first
    kept["sample"] = [0, 20, 40, 60, 80, 100, 120, 140]
    kept["length"] = [len(docs[i]) for i in kept["sample"].tolist()]
    for req in (kept, *(_requests(rng, docs, n) for n in (1, 7, 60, 60, 120)), kept):
        want = np.concatenate(
            [np.asarray(docs[s], dtype=np.int32)[o : o + ln] for s, o, ln in req[["sample", "offset", "length"]]]
        )
        got, keys, _ = _read(reader, req, index, paths, 14, part, verifier)
        assert keys is not None  # the span path served it
        assert got.tokens.dtype == np.int32
        np.testing.assert_array_equal(got.tokens, want)
    kinds = {k[0]: set() for k in cache.items}
    for (p, _), (v, _) in cache.items.items():
        kinds[p].add(str((v.values if isinstance(v, KeptRows) else v).type.value_type))
    assert kinds == {str(paths[0]): {"uint16" if every else "int32"}, str(paths[1]): {"int32"}}  # whole: as decoded
    bad = sums.copy()
    bad[20] ^= 1  # shard 0 (narrow), row 20: held narrow now
    req = np.zeros(2, dtype=REQUEST_DTYPE)
    req["sample"] = [20, 140]
    req["length"] = [len(docs[20]), len(docs[140])]
    index = SampleIndex.of(np.arange(len(docs), dtype=np.uint64), shard, row, bad)
    with pytest.raises(SourceDataError, match=r"sample 20 of source 's'") as e:
        _read(reader, req, index, paths, 14, part, verifier)
    assert e.value.row == 20


def _one_shard(tmp_path: Path, docs: list[Any], typ: pa.DataType) -> tuple[dict[int, Path], LoaderPartition]:
    paths = {0: _write(tmp_path / "part-0.parquet", docs, typ)}
    part = LoaderPartition(source_id=0, source="s", part=0, first_shard=0, stop_shard=1, first_sample=0, stop_sample=0)
    return paths, part


def _whole(rows: list[int], docs: list[Any]) -> np.ndarray:
    req = np.zeros(len(rows), dtype=REQUEST_DTYPE)
    req["sample"] = np.arange(len(rows))
    req["length"] = [len(docs[r]) for r in rows]
    return req


@pytest.mark.parametrize("every", [None, EVERY], ids=["whole", "kept-rows"])
def test_a_narrow_unit_joins_a_group_with_a_null_row(tmp_path: Path, every: int | None) -> None:
    """A group holding a null row (left out of the index with `on_error: skip`) is read through the take path;
    a narrowed kept unit read in the same request joins it in the file's type (review of session 19)."""
    docs: list[Any] = _docs(20, 80, 50_000)
    docs[45] = None  # group 1: no token spans for it, the whole request takes
    paths, part = _one_shard(tmp_path, docs, pa.list_(pa.int32()))
    r = _reader(_Cache(every))
    r.read(paths[0], np.array([0, 1]))  # group 0 decoded and kept narrow
    for rows in ([1, 41], [41, 0, 1], [20, 60, 0]):
        got = r.read(paths[0], np.array(rows))
        assert [s.tokens.tolist() for s in got] == [docs[i] for i in rows]
        assert all(s.tokens.dtype == np.int32 for s in got)
    rows = [0, 1, 20, 41, 60]  # the loader, `verify: sample`: the null group sends it to the per-shard read
    sums = checksums([np.asarray(docs[i], dtype=np.int32) for i in rows])
    index = SampleIndex.of(
        np.arange(len(rows), dtype=np.uint64), np.zeros(len(rows), dtype=np.int64), np.array(rows), sums
    )
    got, _, _ = _read(r, _whole(rows, docs), index, paths, 14, part, _verifier(paths))
    np.testing.assert_array_equal(got.tokens, np.concatenate([np.asarray(docs[i], dtype=np.int32) for i in rows]))


def test_a_column_stored_as_uint16_is_checked_as_uint16(tmp_path: Path) -> None:
    """Only a column stored as int32 gives narrowed spans (hashed as int32); a stored `list<uint16>` column is read
    and checked in its own type, through a cache, twice (the second from the cache)."""
    docs = _docs(21, 80, 60_000)
    paths, part = _one_shard(tmp_path, docs, pa.list_(pa.uint16()))
    rows = list(range(0, 80, 3))
    sums = checksums([np.asarray(docs[i], dtype=np.uint16) for i in rows], np.uint16)
    index = SampleIndex.of(
        np.arange(len(rows), dtype=np.uint64), np.zeros(len(rows), dtype=np.int64), np.array(rows), sums
    )
    r, verifier = _reader(_Cache()), _verifier(paths)
    want = np.concatenate([np.asarray(docs[i], dtype=np.int32) for i in rows])
    for _ in range(2):
        got, _, _ = _read(r, _whole(rows, docs), index, paths, 14, part, verifier)
        assert got.tokens.dtype == np.int32
        np.testing.assert_array_equal(got.tokens, want)


def test_a_decoded_group_is_the_readers_chunk_without_validity_bitmaps(tmp_path: Path) -> None:
    """`_decode_row_group` keeps the reader's own buffers (no `combine_chunks` copy) minus the all-valid bitmaps
    Parquet's reader allocates: the same array and `nbytes` as the copy; a column with nulls is still combined
    (`_unmasked` None)."""
    path = _write(tmp_path / "w.parquet", [[1, 2], [70_000], [3, 4, 5]] * 27, pa.list_(pa.int32()))
    chunk = pq.ParquetFile(path, pre_buffer=False).read_row_group(0, columns=["ids"]).column(0).chunk(0)
    assert chunk.buffers()[2] is not None  # the reader's values carry a validity bitmap though nothing is null
    got = parquet._unmasked(chunk)
    assert got is not None and got.equals(chunk) and got.type == chunk.type
    assert got.buffers()[0] is None and got.buffers()[2] is None
    assert got.buffers()[3].address == chunk.buffers()[3].address  # the ids themselves: not copied
    assert got.nbytes == pa.concat_arrays([chunk]).nbytes
    r = _reader()
    decoded = r.load_unit(path, 1)
    assert decoded is not None and decoded[0].buffers()[2] is None
    assert decoded[0].equals(pq.ParquetFile(path).read_row_group(1).column("ids").combine_chunks())
    with_null = pa.array([[1, None], [2]], type=pa.list_(pa.int32()))
    assert parquet._unmasked(with_null) is None and parquet._unmasked(pa.array([[1], None])) is None
