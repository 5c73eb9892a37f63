"""ParquetReader on files written by pyarrow: counts, metadata, exact reads, every bad-input case."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers, trainers

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec, OnError, SourceFormat, SourceSpec, TokenizerKind, TokenizerSpec
from loomdata.sources import make_reader
from loomdata.sources._base import ScanResult
from loomdata.sources.parquet import ParquetReader


def _spec(**kw: object) -> SourceSpec:
    return SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["x"], **kw)  # type: ignore[arg-type]


def _reader(tokenizer: TokenizerSpec | None = None, **kw: object) -> ParquetReader:
    r = make_reader(_spec(**kw), tokenizer or TokenizerSpec(), ImageSpec())
    assert isinstance(r, ParquetReader)
    return r


def _docs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, size=int(k)) for k in rng.integers(0, 300, size=n)]


def _write_tokens(path: Path, docs: list[np.ndarray], typ: pa.DataType, rg: int = 37) -> None:
    n = len(docs)
    table = pa.table(
        {
            "input_ids": pa.array([d.tolist() for d in docs], type=typ),
            "quality": pa.array(np.linspace(0, 1, n, dtype=np.float32)),
            "lang": pa.array([["en", "de", "fr"][i % 3] for i in range(n)]),
        }
    )
    pq.write_table(table, path, row_group_size=rg)


def _scan_all(r: ParquetReader, path: Path, target_bytes: int) -> tuple[int, list[ScanResult]]:
    n = r.num_parts(path, target_bytes)
    return n, [r.scan(path, p, n) for p in range(n)]


@pytest.mark.parametrize("typ", [pa.list_(pa.int32()), pa.list_(pa.int64()), pa.large_list(pa.int64())])
def test_pretokenized_scan_counts_metadata_and_exact_read(tmp_path: Path, typ: pa.DataType) -> None:
    docs = _docs(400)
    path = tmp_path / "web.parquet"
    _write_tokens(path, docs, typ)
    r = _reader(tokens_field="input_ids", metadata=["quality", "lang"])
    n_parts, results = _scan_all(r, path, target_bytes=20_000)
    assert n_parts > 1
    rows = pa.concat_tables([res.rows for res in results])
    assert rows.column_names == ["row", "num_tokens", "num_image_tokens", "checksum", "quality", "lang"]
    assert rows.schema.field("row").type == pa.uint64()
    assert rows.schema.field("num_tokens").type == pa.uint32()
    assert rows.schema.field("quality").type == pa.float32()
    assert rows.column("row").to_pylist() == list(range(400))
    assert rows.column("num_tokens").to_pylist() == [len(d) for d in docs]
    assert set(rows.column("num_image_tokens").to_pylist()) == {0}
    assert rows.column("lang").to_pylist() == [["en", "de", "fr"][i % 3] for i in range(400)]
    assert all(not res.errors for res in results)

    order = np.random.default_rng(1).permutation(400)[:150]
    order = np.concatenate([order, order[:5]])  # duplicates are fine
    samples = r.read(path, order)
    assert len(samples) == len(order)
    for i, s in zip(order, samples, strict=True):
        assert s.tokens.dtype == np.int32
        np.testing.assert_array_equal(s.tokens, docs[i])
        assert s.images == []
    r.close()


def test_parts_cover_every_row_group_once(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    _write_tokens(path, _docs(1000), pa.list_(pa.int32()), rg=50)
    r = _reader(tokens_field="input_ids")
    for target in (1, 10_000, 100_000, 10**12):
        n, results = _scan_all(r, path, target)
        assert 1 <= n <= 20
        rows = np.concatenate([res.rows.column("row").to_numpy() for res in results])
        np.testing.assert_array_equal(rows, np.arange(1000))
    assert r.num_parts(path, 1) == 20  # never more parts than row groups
    assert r.num_parts(path, 10**12) == 1


def test_text_column_counted_with_byte_tokenizer(tmp_path: Path) -> None:
    texts = [f"def f{i}(x):\n    return 'héllo' * {i}\n" * (i % 7) for i in range(120)]
    path = tmp_path / "code.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=16)
    r = _reader(text_field="text")
    _, results = _scan_all(r, path, 2_000)
    counts = np.concatenate([res.rows.column("num_tokens").to_numpy() for res in results])
    assert counts.tolist() == [len(t.encode()) for t in texts]
    rows = np.array([119, 0, 57, 3])
    for i, s in zip(rows, r.read(path, rows), strict=True):
        assert s.tokens.tolist() == list(texts[i].encode())


def test_text_column_counted_with_huggingface_tokenizer(tmp_path: Path) -> None:
    hf = HFTok(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = [f"return value_{i} + other_{i % 5}" for i in range(200)]
    hf.train_from_iterator(texts, trainer=trainer)
    tok_path = tmp_path / "tokenizer.json"
    hf.save(str(tok_path))
    path = tmp_path / "code.parquet"
    pq.write_table(pa.table({"body": pa.array(texts, pa.large_string())}), path, row_group_size=64)
    spec = TokenizerSpec(kind=TokenizerKind.HUGGINGFACE, path=tok_path)
    r = _reader(spec, text_field="body")
    res = r.scan(path, 0, 1)
    expected = [hf.encode(t, add_special_tokens=False).ids for t in texts]
    assert res.rows.column("num_tokens").to_pylist() == [len(e) for e in expected]
    got = r.read(path, np.array([5, 150, 5]))
    assert [g.tokens.tolist() for g in got] == [expected[5], expected[150], expected[5]]


def test_missing_field_names_file_and_column(tmp_path: Path) -> None:
    path = tmp_path / "w.parquet"
    _write_tokens(path, _docs(10), pa.list_(pa.int32()))
    with pytest.raises(SourceDataError, match=r"w\.parquet.*'tokens'"):
        _reader(tokens_field="tokens").scan(path, 0, 1)
    with pytest.raises(SourceDataError, match=r"w\.parquet.*'score'"):
        _reader(tokens_field="input_ids", metadata=["score"]).num_parts(path, 1000)


def test_wrong_column_types(tmp_path: Path) -> None:
    path = tmp_path / "w.parquet"
    _write_tokens(path, _docs(10), pa.list_(pa.int32()))
    with pytest.raises(SourceDataError, match=r"'lang' \(tokens_field\) is string"):
        _reader(tokens_field="lang").scan(path, 0, 1)
    with pytest.raises(SourceDataError, match=r"'input_ids' \(text_field\) is list"):
        _reader(text_field="input_ids").scan(path, 0, 1)
    fl = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"t": pa.array([[1.0, 2.0]], pa.list_(pa.float32()))}), fl)
    with pytest.raises(SourceDataError, match=r"floats\.parquet"):
        _reader(tokens_field="t").scan(fl, 0, 1)


def _with_nulls(tmp_path: Path) -> tuple[Path, list[list[int] | None]]:
    vals: list[list[int] | None] = [[1, 2, 3], None, [4], [5, None, 6], [], [7, 8]]
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"ids": pa.array(vals, pa.list_(pa.int32()))}), path, row_group_size=2)
    return path, vals


def test_null_values_raise_with_row(tmp_path: Path) -> None:
    path, _ = _with_nulls(tmp_path)
    with pytest.raises(SourceDataError, match=r"nulls\.parquet, row 1: column 'ids': null value") as ei:
        _reader(tokens_field="ids").scan(path, 0, 1)
    assert ei.value.row == 1
    # The second part holds row 3, whose list holds a null id.
    r = _reader(tokens_field="ids")
    with pytest.raises(SourceDataError, match=r"row 3: column 'ids': null token id"):
        r.scan(path, 1, 3)


def test_null_values_skipped_and_counted(tmp_path: Path) -> None:
    path, _ = _with_nulls(tmp_path)
    r = _reader(tokens_field="ids", on_error=OnError.SKIP)
    res = r.scan(path, 0, 1)
    assert res.rows.column("row").to_pylist() == [0, 2, 4, 5]
    assert res.rows.column("num_tokens").to_pylist() == [3, 1, 0, 2]
    assert [row for row, _ in res.errors] == [1, 3]
    assert "null value" in res.errors[0][1] and "null token id" in res.errors[1][1]
    assert [s.tokens.tolist() for s in r.read(path, np.array([5, 0]))] == [[7, 8], [1, 2, 3]]
    with pytest.raises(SourceDataError, match="row 1"):
        r.read(path, np.array([1]))


def test_null_text_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["ab", None, "cde"]}), path)
    res = _reader(text_field="text", on_error=OnError.SKIP).scan(path, 0, 1)
    assert res.rows.column("num_tokens").to_pylist() == [2, 3]
    assert res.errors == [(1, "column 'text': null value")]


def test_token_ids_out_of_int32_range(tmp_path: Path) -> None:
    path = tmp_path / "big.parquet"
    vals = [[1, 2], [3, 2**40], [-5]]
    pq.write_table(pa.table({"ids": pa.array(vals, pa.list_(pa.int64()))}), path)
    with pytest.raises(SourceDataError, match=r"row 1: column 'ids': token id outside"):
        _reader(tokens_field="ids").scan(path, 0, 1)
    res = _reader(tokens_field="ids", on_error=OnError.SKIP).scan(path, 0, 1)
    assert res.rows.column("row").to_pylist() == [0]
    assert [row for row, _ in res.errors] == [1, 2]


@pytest.mark.parametrize("on_error", [OnError.ERROR, OnError.SKIP])
def test_truncated_and_garbage_files_raise_even_with_skip(tmp_path: Path, on_error: OnError) -> None:
    good = tmp_path / "good.parquet"
    _write_tokens(good, _docs(200), pa.list_(pa.int32()))
    data = good.read_bytes()
    trunc = tmp_path / "trunc.parquet"
    trunc.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all" * 10)
    for p in (trunc, garbage):
        with pytest.raises(SourceDataError, match=re.escape(p.name)):
            _reader(tokens_field="input_ids", on_error=on_error).num_parts(p, 1000)
    # Damaged page data inside an intact footer: the read of that row group fails, naming the file.
    damaged = tmp_path / "damaged.parquet"
    buf = bytearray(data)
    buf[8:2000] = bytes(1992)
    damaged.write_bytes(bytes(buf))
    with pytest.raises(SourceDataError, match=r"damaged\.parquet"):
        _reader(tokens_field="input_ids", on_error=on_error).scan(damaged, 0, 1)


def test_read_row_out_of_range(tmp_path: Path) -> None:
    path = tmp_path / "w.parquet"
    _write_tokens(path, _docs(10), pa.list_(pa.int32()))
    with pytest.raises(SourceDataError, match=r"w\.parquet, row 10: row out of range"):
        _reader(tokens_field="input_ids").read(path, np.array([0, 10]))
    assert _reader(tokens_field="input_ids").read(path, np.array([], dtype=np.uint64)) == []


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(SourceDataError, match=r"nope\.parquet"):
        _reader(tokens_field="input_ids").num_parts(tmp_path / "nope.parquet", 100)
    empty = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table({"input_ids": pa.array([], pa.list_(pa.int32())), "lang": pa.array([], pa.string())}), empty
    )
    r = _reader(tokens_field="input_ids", metadata=["lang"])
    assert r.num_parts(empty, 100) == 1
    res = r.scan(empty, 0, 1)
    assert res.rows.num_rows == 0
    assert res.rows.column_names == ["row", "num_tokens", "num_image_tokens", "checksum", "lang"]


def test_siblings_share_one_parsed_footer_and_units_open_no_file(tmp_path: Path) -> None:
    p = tmp_path / "a.parquet"
    docs = _docs(100)
    _write_tokens(p, docs, pa.list_(pa.int32()), rg=50)
    main = _reader(tokens_field="input_ids")
    other = main.sibling()
    assert other.units(p, np.array([0, 15, 99, 100])).tolist() == [0, 0, 1, -1]
    assert other.open_files() == 0  # row groups located from the footer alone: no handle opened
    assert main._layout(p) is other._layout(p)  # parsed once for both
    got = other.load_unit(p, 1, np.array([65, 62, 40]))  # only rows of group 1 are kept, in row order
    assert got is not None
    kept, nbytes = got
    assert kept.rows.tolist() == [62, 65] and nbytes == kept.values.nbytes + kept.rows.nbytes
    assert kept.values.to_pylist() == [docs[62].tolist(), docs[65].tolist()]
    assert other.load_unit(p, 1, np.array([40])) is None  # nothing of group 1 wanted: nothing kept
    whole = other.load_unit(p, 1, np.array([50, 51, 53, 70]))  # 4 of its 50 rows (>= 1/16): kept whole
    assert whole is not None and isinstance(whole[0], pa.Array) and len(whole[0]) == 50
    assert [s.tokens.tolist() for s in main.read(p, np.array([15, 3]))] == [docs[15].tolist(), docs[3].tolist()]
    unrelated = _reader(tokens_field="input_ids")  # not a sibling: reads the footer itself
    assert unrelated._layout(p) is not main._layout(p)


def test_files_past_the_process_limit_are_let_go_and_reopened_from_the_held_footer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from loomdata.sources import parquet

    monkeypatch.setattr(parquet._OPEN, "limit", 2)
    paths, docs = [], []
    for k in range(3):
        p = tmp_path / f"f{k}.parquet"
        d = _docs(60, seed=k)
        _write_tokens(p, d, pa.list_(pa.int32()), rg=20)
        paths.append(p)
        docs.append(d)
    fds = len(os.listdir("/proc/self/fd"))
    r = _reader(tokens_field="input_ids")
    for _ in range(2):  # the second round opens each file again from its held footer
        for p, d in zip(paths, docs, strict=True):
            got = r.read(p, np.array([59, 3, 25]))
            assert [s.tokens.tolist() for s in got] == [d[59].tolist(), d[3].tolist(), d[25].tolist()]
            assert r.open_files() <= 2
    assert isinstance(r._layout(paths[0]).footer, bytes) and len(r._layout(paths[0]).footer) < 4096
    r.close()
    assert r.open_files() == 0
    assert len(os.listdir("/proc/self/fd")) <= fds  # every handle it opened is closed


@pytest.mark.parametrize("typ", [pa.list_(pa.int32()), pa.large_list(pa.int64())])
def test_decodes_are_counted_per_row_group_for_the_reader_and_its_siblings(tmp_path: Path, typ: pa.DataType) -> None:
    p = tmp_path / "a.parquet"
    docs = _docs(100, seed=3)
    _write_tokens(p, docs, typ, rg=40)  # groups of rows 0-39, 40-79, 80-99
    main = _reader(tokens_field="input_ids")
    other = main.sibling()
    assert main.decoded is not None and other.decoded is main.decoded  # one count for a loader and its read-ahead
    assert main.decoded.snapshot() == (0, 0, 0)
    main.read(p, np.array([3, 85]))  # part of two groups: both decoded whole
    want = sum(len(d) for d in docs[:40]) + sum(len(d) for d in docs[80:])
    assert main.decoded.snapshot() == (2, 60, want)
    main.read(p, np.array([3]))  # held by the reader's (default) cache: not decoded again
    other.load_unit(p, 1, np.array([41]))  # a read ahead decodes the middle group
    assert main.decoded.snapshot() == (3, 100, sum(len(d) for d in docs))
    assert _reader(tokens_field="input_ids").decoded.snapshot() == (0, 0, 0)  # type: ignore[union-attr]


def test_decoded_text_groups_count_rows_not_tokens(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(30)]}), path, row_group_size=16)
    r = _reader(text_field="text")
    r.read(path, np.array([0, 20]))
    assert r.decoded is not None and r.decoded.snapshot() == (2, 30, None)  # a text row's tokens: known once tokenized
