"""JsonlReader on files written with json + gzip + zstandard: counts, rows, exact reads, bad input."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
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


def test_missing_file_and_unsupported_metadata(tmp_path: Path) -> None:
    with pytest.raises(SourceDataError, match=r"nope\.jsonl"):
        _reader().num_parts(tmp_path / "nope.jsonl", 100)
    with pytest.raises(SourceDataError, match=r"nope\.jsonl\.gz"):
        _reader().scan(tmp_path / "nope.jsonl.gz", 0, 1)
    spec = SourceSpec(name="b", format=SourceFormat.JSONL, paths=["x"], text_field="text", metadata=["lang"])
    with pytest.raises(SourceDataError, match="parquet sources only"):
        make_reader(spec, TokenizerSpec(), ImageSpec())
