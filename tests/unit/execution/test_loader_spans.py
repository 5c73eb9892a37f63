"""The loader's vectorised read path (`token_spans`: one pass per request) against the per-shard path it bypasses.

The oracle is `read_segments` with the reader's `token_spans` switched off (every shard through `read` and the
per-segment copy), and an independent pyarrow read of each file. Random requests over several shards and row
groups: unsorted samples, duplicates, partial segments, empty documents; checksum checks and their errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._loader import REQUEST_DTYPE, _read, read_segments
from loomdata.execution._loader_cache import unit_key
from loomdata.execution._partition import LoaderPartition
from loomdata.execution._sample_index import SampleIndex
from loomdata.execution._verify import ShardCheck, Verifier
from loomdata.schemas import ExecutionError, ImageSpec, SourceDataError, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.schemas.spec import VerifyMode
from loomdata.sources import make_reader
from loomdata.sources._integrity import checksums, span_checksums, stat_shard
from loomdata.sources.parquet import ParquetReader

FIRST_SHARD = 2


def _docs(rng: np.random.Generator, n: int) -> list[list[int]]:
    lens = rng.integers(0, 40, size=n)  # empty documents too
    return [rng.integers(0, 50_000, size=int(k)).tolist() for k in lens]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[dict[int, Path], list[list[int]], np.ndarray, np.ndarray]:
    """Three shards (ids 2..4) of 30, 17 and 41 documents in row groups of 4: paths, docs, shard and row per sample."""
    rng = np.random.default_rng(7)
    paths, docs, shard, row = {}, [], [], []
    for k, n in enumerate((30, 17, 41)):
        d = _docs(rng, n)
        p = tmp_path / f"part-{k}.parquet"
        pq.write_table(pa.table({"ids": pa.array(d, pa.list_(pa.int32()))}), p, row_group_size=4)
        paths[FIRST_SHARD + k] = p
        docs += d
        shard += [FIRST_SHARD + k] * n
        row += list(range(n))
    return paths, docs, np.array(shard), np.array(row)


def _reader() -> ParquetReader:
    src = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids")
    reader = make_reader(src, TokenizerSpec(), ImageSpec())
    assert isinstance(reader, ParquetReader)
    return reader


def _part(n: int) -> LoaderPartition:
    return LoaderPartition(
        source_id=0, source="s", part=0, first_shard=FIRST_SHARD, stop_shard=FIRST_SHARD + 3, first_sample=100,
        stop_sample=100 + n,
    )  # fmt: skip


def _request(rng: np.random.Generator, docs: list[list[int]], n: int) -> np.ndarray:
    req = np.zeros(n, dtype=REQUEST_DTYPE)
    pick = rng.integers(0, len(docs), size=n)  # unsorted, with repeats
    lens = np.array([len(docs[i]) for i in pick])
    offset = (rng.random(n) * (lens + 1)).astype(np.int64).clip(0, lens)
    req["sample"] = pick + 100
    req["offset"] = offset
    req["length"] = (rng.random(n) * (lens - offset + 1)).astype(np.int64).clip(0, lens - offset)
    req["step"] = rng.integers(0, 9, size=n)
    return req


def _verifier(paths: dict[int, Path], mode: VerifyMode = VerifyMode.SAMPLE) -> Verifier:
    shards = {}
    for s, p in paths.items():
        st = stat_shard(p, SourceFormat.PARQUET)
        shards[s] = ShardCheck(st.size_bytes, st.mtime_ns, st.fingerprint)
    return Verifier("s", mode, SourceFormat.PARQUET, shards)


def _index(docs: list[list[int]], shard: np.ndarray, row: np.ndarray, sums: np.ndarray | None) -> SampleIndex:
    return SampleIndex.of(np.arange(100, 100 + len(docs), dtype=np.uint64), shard, row, sums)


@pytest.mark.parametrize("seed", range(6))
def test_spans_give_the_per_shard_paths_tokens(corpus: Any, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    paths, docs, shard, row = corpus
    rng = np.random.default_rng(seed)
    sums = checksums([np.asarray(d, dtype=np.int32) for d in docs])
    index, part, verifier = _index(docs, shard, row, sums), _part(len(docs)), _verifier(paths)
    for n in (1, 5, 60):
        req = _request(rng, docs, n)
        cols = zip(req["sample"].tolist(), req["offset"].tolist(), req["length"].tolist(), strict=True)
        want = np.concatenate([np.asarray(docs[s - 100], dtype=np.int32)[o : o + ln] for s, o, ln in cols])
        reader = _reader()
        got, keys, distinct = _read(reader, req, index, paths, 14, part, verifier)
        assert keys is not None and distinct == len(np.unique(req["sample"]))
        np.testing.assert_array_equal(got.tokens, want)
        # the unit key of each segment is the one the cache would tell (shard, row group of 4 rows)
        i = req["sample"].astype(np.int64) - 100
        np.testing.assert_array_equal(keys, unit_key(shard[i], row[i] // 4))
        with monkeypatch.context() as m:  # the oracle: the per-shard path
            m.setattr(ParquetReader, "token_spans", lambda *_: None)
            slow, no_keys, slow_distinct = _read(_reader(), req, index, paths, 14, part, verifier)
        assert no_keys is None and slow_distinct == distinct
        np.testing.assert_array_equal(got.tokens, slow.tokens)
        assert got.tokens.dtype == np.int32 and got.tokens.flags.writeable


def test_an_empty_request_reads_nothing(corpus: Any) -> None:
    paths, docs, shard, row = corpus
    index = _index(docs, shard, row, None)
    got, keys, distinct = _read(_reader(), np.zeros(0, REQUEST_DTYPE), index, paths, 14, _part(len(docs)), None)
    assert len(got.tokens) == 0 and got.tokens.dtype == np.int32 and keys is not None and distinct == 0


def test_token_spans_match_pyarrow_and_refuse_what_they_cannot_view(tmp_path: Path, corpus: Any) -> None:
    paths = corpus[0]
    reader = _reader()
    p = paths[FIRST_SHARD + 2]
    rows = np.array([0, 3, 4, 5, 17, 40])
    spans = reader.token_spans(p, rows)
    assert spans is not None
    table = pq.read_table(p).column("ids").to_pylist()
    for i, r in enumerate(rows.tolist()):
        got = spans.buffers[int(spans.buffer[i])][spans.start[i] : spans.stop[i]]
        assert got.tolist() == table[r]
    np.testing.assert_array_equal(spans.unit, rows // 4)
    sums = span_checksums(spans.buffers, spans.buffer, spans.start, spans.stop)
    np.testing.assert_array_equal(sums, checksums([np.asarray(table[r], dtype=np.int32) for r in rows.tolist()]))
    with pytest.raises(SourceDataError, match="row out of range"):
        reader.token_spans(p, np.array([3, 41]))
    wide = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1, 2], [3]], pa.list_(pa.int64()))}), wide)
    assert _reader().token_spans(wide, np.array([0, 1])) is None  # int64 ids: `read` checks and converts
    holes = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))}), holes)
    assert _reader().token_spans(holes, np.array([0, 2])) is None  # a null in the group: `read` names it


def test_a_changed_sample_fails_the_read_naming_file_sample_and_row(corpus: Any) -> None:
    paths, docs, shard, row = corpus
    sums = checksums([np.asarray(d, dtype=np.int32) for d in docs])
    bad = 30 + 17 + 9  # shard 4, row 9
    sums[bad] ^= 1
    index = _index(docs, shard, row, sums)
    req = np.zeros(3, dtype=REQUEST_DTYPE)
    req["sample"] = [101, 100 + bad, 101 + bad]  # two samples of shard 4, one of shard 2
    req["length"] = [len(docs[1]), len(docs[bad]), len(docs[bad + 1])]
    with pytest.raises(SourceDataError, match=rf"sample {100 + bad} of source 's'.*1 of 2 samples read differ") as e:
        read_segments(_reader(), req, index, paths, 14, _part(len(docs)), _verifier(paths))
    assert e.value.path == str(paths[FIRST_SHARD + 2]) and e.value.row == 9
    # verify: shard reads the same request without the sample checks
    out = read_segments(_reader(), req, index, paths, 14, _part(len(docs)), _verifier(paths, VerifyMode.SHARD))
    assert len(out.tokens) == int(req["length"].sum())
    # and it is the span path that read it (unit keys given back), not the per-shard fallback
    assert _read(_reader(), req, index, paths, 14, _part(len(docs)), _verifier(paths, VerifyMode.SHARD))[1] is not None


def test_a_segment_past_its_sample_is_named(corpus: Any) -> None:
    paths, docs, shard, row = corpus
    index = _index(docs, shard, row, None)
    i = next(k for k in range(len(docs)) if len(docs[k]) > 3)
    req = np.zeros(2, dtype=REQUEST_DTYPE)
    req["sample"], req["offset"], req["length"] = [100, 100 + i], [0, len(docs[i]) - 2], [0, 3]
    with pytest.raises(ExecutionError, match=rf"row {int(row[i])}: sample {100 + i} .* has {len(docs[i])} tokens"):
        read_segments(_reader(), req, index, paths, 14, _part(len(docs)))
