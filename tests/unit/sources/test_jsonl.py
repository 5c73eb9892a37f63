"""JsonlReader on files written with json + gzip + zstandard: counts, rows, exact reads, bad input."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import zstandard
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers, trainers

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec, OnError, SourceFormat, SourceSpec, TokenizerKind, TokenizerSpec
from loomdata.sources import jsonl, make_reader
from loomdata.sources.jsonl import JsonlReader


def _reader(tokenizer: TokenizerSpec | None = None, on_error: OnError = OnError.ERROR) -> JsonlReader:
    spec = SourceSpec(name="books", format=SourceFormat.JSONL, paths=["x"], text_field="text", on_error=on_error)
    r = make_reader(spec, tokenizer or TokenizerSpec(), ImageSpec())
    assert isinstance(r, JsonlReader)
    return r


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["the", "héllo", "wörld", "日本", "🙂", "a\tb", 'quote"d', "back\\slash", "line\nbreak"]
    return [" ".join(rng.choice(words, size=int(k))) for k in rng.integers(0, 80, size=n)]


def _lines(texts: list[str]) -> list[str]:
    """JSON lines with extra fields, some escaped non-ASCII, and blank lines in between."""
    out = []
    for i, t in enumerate(texts):
        obj = {"id": i, "text": t, "meta": {"tags": [1, 2, {"x": None}]}}
        out.append(json.dumps(obj, ensure_ascii=bool(i % 2)))
        if i % 5 == 0:
            out.append("")
        if i % 7 == 0:
            out.append("   ")
    return out


def _write(path: Path, lines: list[str]) -> None:
    data = ("\n".join(lines) + "\n").encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    elif path.suffix == ".zst":
        cctx = zstandard.ZstdCompressor()
        half = len(data) // 2  # two frames, to cover multi-frame files
        path.write_bytes(cctx.compress(data[:half]) + cctx.compress(data[half:]))
    else:
        path.write_bytes(data)


def _scan_all(r: JsonlReader, path: Path, target: int) -> tuple[np.ndarray, np.ndarray, list]:
    n = r.num_parts(path, target)
    results = [r.scan(path, p, n) for p in range(n)]
    rows = np.concatenate([res.rows.column("row").to_numpy() for res in results])
    counts = np.concatenate([res.rows.column("num_tokens").to_numpy() for res in results])
    return rows, counts, [e for res in results for e in res.errors]


def test_plain_byte_ranges_rows_are_line_offsets(tmp_path: Path) -> None:
    texts = _texts(300)
    path = tmp_path / "books.jsonl"
    lines = _lines(texts)
    _write(path, lines)
    offsets, pos = [], 0
    for line in lines:
        if line.strip():
            offsets.append(pos)
        pos += len(line.encode()) + 1
    r = _reader()
    assert r.num_parts(path, 4096) > 3
    rows, counts, errors = _scan_all(r, path, 4096)
    assert rows.tolist() == offsets
    assert counts.tolist() == [len(t.encode()) for t in texts]
    assert errors == []
    pick = np.random.default_rng(3).permutation(len(texts))[:60]
    samples = r.read(path, rows[pick])
    for i, s in zip(pick, samples, strict=True):
        assert s.tokens.dtype == np.int32
        assert s.tokens.tolist() == list(texts[i].encode())
    r.close()


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_compressed_one_part_rows_are_line_numbers(tmp_path: Path, suffix: str) -> None:
    texts = _texts(200, seed=1)
    lines = _lines(texts)
    path = tmp_path / f"books{suffix}"
    _write(path, lines)
    line_numbers = [i for i, line in enumerate(lines) if line.strip()]
    r = _reader()
    assert r.num_parts(path, 100) == 1
    rows, counts, errors = _scan_all(r, path, 100)
    assert errors == []
    assert rows.tolist() == line_numbers
    assert counts.tolist() == [len(t.encode()) for t in texts]
    pick = np.array([150, 0, 199, 42, 42])
    for i, s in zip(pick, r.read(path, rows[pick]), strict=True):
        assert s.tokens.tolist() == list(texts[i].encode())
    # A fresh reader (no cached decode) reads the same.
    assert [s.tokens.tolist() for s in _reader().read(path, rows[pick])] == [list(texts[i].encode()) for i in pick]


def test_lines_longer_than_a_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small blocks force lines across chunk boundaries; results must not change."""
    texts = _texts(80, seed=2)
    for suffix in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
        path = tmp_path / f"b{suffix}"
        _write(path, _lines(texts))
        expected = _scan_all(_reader(), path, 1000)
        monkeypatch.setattr(jsonl, "_BLOCK", 64)
        got = _scan_all(_reader(), path, 1000)
        monkeypatch.undo()
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
        assert got[1].tolist() == [len(t.encode()) for t in texts]


def test_huggingface_counts(tmp_path: Path) -> None:
    texts = [f"chapter {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(100)]
    hf = HFTok(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(texts, trainer=trainer)
    tok_path = tmp_path / "tok.json"
    hf.save(str(tok_path))
    path = tmp_path / "b.jsonl.zst"
    _write(path, [json.dumps({"text": t}) for t in texts])
    r = _reader(TokenizerSpec(kind=TokenizerKind.HUGGINGFACE, path=tok_path))
    rows, counts, _ = _scan_all(r, path, 1 << 20)
    expected = [hf.encode(t, add_special_tokens=False).ids for t in texts]
    assert counts.tolist() == [len(e) for e in expected]
    assert [s.tokens.tolist() for s in r.read(path, rows[[9, 3]])] == [expected[9], expected[3]]


BAD_LINES = [
    ('{"text": "ok"', "not valid JSON"),
    ('{"title": "no text"}', "no field 'text'"),
    ('{"text": 42}', "field 'text' is int, expected a string"),
    ('{"text": null}', "field 'text' is NoneType"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"text": "\\ud800"}', "unpaired surrogate"),
]


@pytest.mark.parametrize(("bad", "why"), BAD_LINES)
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_bad_line_names_file_and_line(tmp_path: Path, bad: str, why: str, suffix: str) -> None:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(50)]
    lines.insert(30, bad)
    path = tmp_path / f"bad{suffix}"
    _write(path, lines)
    r = _reader()
    with pytest.raises(SourceDataError, match=rf"bad\.jsonl.*line 31\b.*{re.escape(why)}") as ei:
        _scan_all(r, path, 256)  # several parts for the plain file: the bad line is in a later one
    expected_row = 30 if suffix != ".jsonl" else sum(len(x.encode()) + 1 for x in lines[:30])
    assert ei.value.row == expected_row


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_bad_lines_skipped_and_counted(tmp_path: Path, suffix: str) -> None:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(40)]
    for k, (bad, _) in enumerate(BAD_LINES):
        lines.insert(3 + 6 * k, bad)
    path = tmp_path / f"skip{suffix}"
    _write(path, lines)
    r = _reader(on_error=OnError.SKIP)
    rows, counts, errors = _scan_all(r, path, 200)
    assert len(rows) == 40
    assert counts.tolist() == [len(f"doc {i}".encode()) for i in range(40)]
    assert len(errors) == len(BAD_LINES)
    for (row, msg), (_, why), k in zip(errors, BAD_LINES, range(len(BAD_LINES)), strict=True):
        assert why in msg
        assert f"line {3 + 6 * k + 1}" in msg
        assert row is not None
    got = r.read(path, rows[[0, 39]])
    assert [bytes(s.tokens.astype(np.uint8)).decode() for s in got] == ["doc 0", "doc 39"]


@pytest.mark.parametrize("on_error", [OnError.ERROR, OnError.SKIP])
def test_truncated_and_corrupt_compressed_files(tmp_path: Path, on_error: OnError) -> None:
    lines = [json.dumps({"text": "x" * 200 + str(i)}) for i in range(500)]
    for suffix in (".jsonl.gz", ".jsonl.zst"):
        full = tmp_path / f"full{suffix}"
        _write(full, lines)
        data = full.read_bytes()
        trunc = tmp_path / f"trunc{suffix}"
        trunc.write_bytes(data[: len(data) * 2 // 3])
        garbage = tmp_path / f"garbage{suffix}"
        garbage.write_bytes(b"definitely not compressed data " * 20)
        for p in (trunc, garbage):
            r = _reader(on_error=on_error)
            with pytest.raises(SourceDataError, match=re.escape(p.name) + ".*(truncated or corrupt)"):
                r.scan(p, 0, 1)
            with pytest.raises(SourceDataError, match=re.escape(p.name)):
                r.read(p, np.array([0]))


def test_read_stale_rows(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    _write(path, [json.dumps({"text": "abc"}), json.dumps({"text": "de"})])
    r = _reader()
    with pytest.raises(SourceDataError, match=r"b\.jsonl, row 3: byte offset 3 is not the start of a line"):
        r.read(path, np.array([3]))
    with pytest.raises(SourceDataError, match="row 10000"):
        r.read(path, np.array([10000]))
    gz = tmp_path / "b.jsonl.gz"
    _write(gz, [json.dumps({"text": "abc"})])
    with pytest.raises(SourceDataError, match=r"line 6 does not exist \(the file has 1 lines\)"):
        r.read(gz, np.array([5]))


def test_empty_files(tmp_path: Path) -> None:
    for name in ("e.jsonl", "e.jsonl.gz", "e.jsonl.zst"):
        p = tmp_path / name
        _write(p, [])  # a single newline
        r = _reader()
        assert r.num_parts(p, 10) == 1
        res = r.scan(p, 0, 1)
        assert res.rows.num_rows == 0 and res.errors == []
    (tmp_path / "zero.jsonl").write_bytes(b"")
    assert _reader().scan(tmp_path / "zero.jsonl", 0, 1).rows.num_rows == 0


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceDataError, match=r"nope\.jsonl"):
        _reader().num_parts(tmp_path / "nope.jsonl", 100)
    with pytest.raises(SourceDataError, match=r"nope\.jsonl\.gz"):
        _reader().scan(tmp_path / "nope.jsonl.gz", 0, 1)


# ---- metadata ---------------------------------------------------------------------------------

META = ["url", "lang", "quality", "flag", "info", "never", "text"]


def _meta_reader(on_error: OnError = OnError.ERROR, metadata: list[str] | None = None) -> JsonlReader:
    spec = SourceSpec(
        name="web",
        format=SourceFormat.JSONL,
        paths=["x"],
        text_field="text",
        metadata=META if metadata is None else metadata,
        on_error=on_error,
    )
    r = make_reader(spec, TokenizerSpec(), ImageSpec())
    assert isinstance(r, JsonlReader)
    return r


def _meta_objs(n: int, seed: int = 0) -> list[dict[str, object]]:
    """Objects whose metadata fields mix ints and floats, go missing or null, and nest."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, object]] = []
    for i in range(n):
        obj: dict[str, object] = {"text": f"doc {i} " + "x" * int(rng.integers(0, 40)), "url": f"https://e.x/{i}?q=é"}
        if i % 3:
            obj["lang"] = ["en", "de", "日本"][i % 3]
        if i >= n // 2:  # the first half has no quality at all: parts there infer nothing
            obj["quality"] = i if i % 2 else i / 7  # ints and floats
        if i % 4 == 0:
            obj["quality"] = None
        obj["flag"] = bool(i % 5)
        if i % 6 == 0:
            obj["info"] = {"tags": ["a", i], "ok": True}
        elif i % 6 == 1:
            obj["info"] = [1, "two", None]
        elif i % 6 == 2:
            obj["info"] = "plain"
        obj["never"] = None
        out.append(obj)
    return out


def _carried(v: object) -> object:
    """What the index holds for a JSON value (the documented rule)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int | float):
        return float(v)
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _expected_meta(objs: list[dict[str, object]]) -> dict[str, list[object]]:
    return {m: [_carried(o.get(m)) for o in objs] for m in META}


def _scan_table(r: JsonlReader, path: Path, target: int) -> pa.Table:
    n = r.num_parts(path, target)
    return pa.concat_tables([r.scan(path, p, n).rows for p in range(n)], promote_options="permissive")


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_metadata_carried_with_one_type_everywhere(tmp_path: Path, suffix: str) -> None:
    objs = _meta_objs(400)
    path = tmp_path / f"web{suffix}"
    _write(path, [json.dumps(o, ensure_ascii=bool(i % 2)) for i, o in enumerate(objs)])
    r = _meta_reader()
    n = r.num_parts(path, 2048)
    assert (n > 5) == (suffix == ".jsonl")  # plain files split into byte ranges
    parts = [r.scan(path, p, n).rows for p in range(n)]
    assert all(t.column_names[:4] == ["row", "num_tokens", "num_image_tokens", "checksum"] for t in parts)
    assert all(t.column_names[4:] == META for t in parts)
    for t in parts:  # each part types a column by the kinds it saw: the rule, or null when it saw none
        assert t.schema.field("quality").type in (pa.float64(), pa.null())
        assert t.schema.field("never").type == pa.null()
    if suffix == ".jsonl":
        assert {t.schema.field("quality").type for t in parts} == {pa.float64(), pa.null()}
    table = pa.concat_tables(parts, promote_options="permissive")
    types = {m: table.schema.field(m).type for m in META}
    assert types == {
        "url": pa.string(),
        "lang": pa.string(),
        "quality": pa.float64(),
        "flag": pa.bool_(),
        "info": pa.string(),
        "never": pa.null(),
        "text": pa.string(),
    }
    assert {m: table.column(m).to_pylist() for m in META} == _expected_meta(objs)
    assert table.column("num_tokens").to_pylist() == [len(str(o["text"]).encode()) for o in objs]


def test_metadata_fast_and_per_line_paths_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = _meta_objs(300, seed=4)
    scalars = ["url", "lang", "quality", "flag", "never", "text"]
    for suffix in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
        path = tmp_path / f"w{suffix}"
        _write(path, [json.dumps({**o, "other": {"x": [1, {"y": None}]}}) for o in objs])  # plus an ignored field
        for metadata in (scalars, META):
            fast = _scan_table(_meta_reader(metadata=metadata), path, 1500)
            with monkeypatch.context() as mp:
                mp.setattr(JsonlReader, "_fast_block", lambda *a, **k: None)
                slow = _scan_table(_meta_reader(metadata=metadata), path, 1500)
            with monkeypatch.context() as mp:
                mp.setattr(jsonl, "_BLOCK", 64)  # lines across chunk boundaries, many blocks
                small = _scan_table(_meta_reader(metadata=metadata), path, 1500)
            assert fast.equals(slow) and fast.equals(small), (suffix, metadata)


def test_metadata_scalars_stay_on_the_columnar_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scalar metadata costs no per-line json.loads: only a bounded probe of a block's first lines."""
    objs = _meta_objs(3000, seed=5)  # `quality` is absent from the first half
    path = tmp_path / "w.jsonl"
    _write(path, [json.dumps(o) for o in objs])
    calls = 0
    real = json.loads

    def counting(*a: object, **k: object) -> object:
        nonlocal calls
        calls += 1
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(jsonl.json, "loads", counting)
    table = _meta_reader(metadata=["url", "lang", "quality", "flag"]).scan(path, 0, 1).rows
    assert table.num_rows == 3000
    assert calls <= jsonl._PROBE_LINES
    assert table.column("quality").to_pylist() == [_carried(o.get("quality")) for o in objs]


@pytest.mark.parametrize("on_error", [OnError.ERROR, OnError.SKIP])
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_metadata_kind_clash_names_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_error: OnError, suffix: str
) -> None:
    lines = [json.dumps({"text": f"doc {i}", "quality": i * 0.5}) for i in range(60)]
    lines[41] = json.dumps({"text": "doc 41", "quality": "high"})
    path = tmp_path / f"clash{suffix}"
    _write(path, lines)
    r = _meta_reader(on_error, metadata=["quality"])
    pattern = (
        r"clash\.jsonl.*line 42\b.*metadata field 'quality' holds text \(strings, objects or arrays\), "
        r"but earlier lines hold numbers.*drop it from the source's `metadata`"
    )
    with pytest.raises(SourceDataError, match=pattern):
        r.scan(path, 0, 1)
    monkeypatch.setattr(jsonl, "_BLOCK", 128)  # the clash is between blocks: the columnar check names it
    with pytest.raises(SourceDataError, match=pattern):
        _meta_reader(on_error, metadata=["quality"]).scan(path, 0, 1)


def test_metadata_with_skipped_lines_and_bad_values(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"doc {i}", "lang": f"l{i}", "n": i}) for i in range(20)]
    lines[3] = '{"text": "unclosed'
    lines[8] = r'{"text": "ok", "lang": "\ud800", "n": 8}'  # an unpaired surrogate cannot be carried
    lines[12] = '{"lang": "l12"}'
    path = tmp_path / "s.jsonl.zst"
    _write(path, lines)
    res = _meta_reader(OnError.SKIP, metadata=["lang", "n"]).scan(path, 0, 1)
    kept = [i for i in range(20) if i not in (3, 8, 12)]
    assert res.rows.column("row").to_pylist() == kept
    assert res.rows.column("lang").to_pylist() == [f"l{i}" for i in kept]
    assert res.rows.column("n").to_pylist() == [float(i) for i in kept]
    assert [row for row, _ in res.errors] == [3, 8, 12]
    assert "line 9: metadata field 'lang' holds an unpaired surrogate" in res.errors[1][1]
    _write(path, lines[4:12])
    with pytest.raises(SourceDataError, match=r"s\.jsonl\.zst, row 4: line 5: metadata field 'lang' holds an unp"):
        _meta_reader(metadata=["lang"]).scan(path, 0, 1)


def test_metadata_empty_and_absent(tmp_path: Path) -> None:
    p = tmp_path / "e.jsonl"
    _write(p, [])
    t = _meta_reader(metadata=["url"]).scan(p, 0, 1).rows
    assert t.column_names == ["row", "num_tokens", "num_image_tokens", "checksum", "url"] and t.num_rows == 0
    p2 = tmp_path / "a.jsonl.gz"
    _write(p2, [json.dumps({"text": "x"})] * 3)
    t = _meta_reader(metadata=["url"]).scan(p2, 0, 1).rows
    assert t.column("url").type == pa.null() and t.column("url").to_pylist() == [None] * 3


@pytest.mark.parametrize("field", ["text", "lang"])
def test_invalid_utf8_is_a_bad_line_on_both_paths(tmp_path: Path, field: str) -> None:
    """Arrow's reader passes invalid UTF-8 through; the scan must reject the line as `read` would."""
    lines = [json.dumps({"text": f"doc {i}", "lang": "en"}).encode() for i in range(10)]
    lines[6] = lines[6].replace(b'"en"' if field == "lang" else b"doc 6", b'"e\xffn"' if field == "lang" else b"d\xffc")
    path = tmp_path / "u.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(SourceDataError, match=r"u\.jsonl, row \d+: line 7 \(byte \d+\): not valid JSON"):
        _meta_reader(metadata=["lang"]).scan(path, 0, 1)
    res = _meta_reader(OnError.SKIP, metadata=["lang"]).scan(path, 0, 1)
    assert res.rows.num_rows == 9 and res.rows.column("lang").to_pylist() == ["en"] * 9
