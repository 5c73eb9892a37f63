"""Megatron .bin/.idx: files written by megatron-core's IndexedDatasetBuilder, checked against its reader."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import make_reader
from loomdata.sources import megatron as mg
from loomdata.sources.megatron import MegatronReader
from loomdata.testing import write_megatron

with warnings.catch_warnings():  # megatron-core warns that Transformer Engine / Apex are absent
    warnings.simplefilter("ignore")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def make_docs(seed: int, n: int, vocab: int) -> list[np.ndarray]:
    """Documents of varied lengths (including an empty one) with ids across the whole vocabulary."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 400, size=n)
    if n > 2:
        lengths[n // 2] = 0
    docs = [rng.integers(0, vocab, size=int(k), dtype=np.int64) for k in lengths]
    if n:
        docs[0][:2] = [0, vocab - 1]
    return docs


def build_with_megatron(prefix: Path, docs: list[list[np.ndarray]], dtype: type[np.integer]) -> None:
    """Each document is a list of sequences (sentences), written the way preprocess_data.py does."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sentences in docs:
        for s in sentences:
            builder.add_item(torch.from_numpy(s))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def reader(metadata: list[str] | None = None) -> MegatronReader:
    src = SourceSpec(name="mg", format=SourceFormat.MEGATRON, paths=["x"], metadata=metadata or [])
    r = make_reader(src, TokenizerSpec(), ImageSpec())
    assert isinstance(r, MegatronReader)
    return r


@pytest.mark.parametrize(("dtype", "vocab"), [(np.uint16, 65_000), (np.int32, 2_000_000), (np.uint8, 256)])
@pytest.mark.parametrize("n", [0, 1, 37])
def test_writer_is_byte_identical_to_megatron_builder(
    tmp_path: Path, dtype: type[np.integer], vocab: int, n: int
) -> None:
    docs = make_docs(n, n, vocab)
    build_with_megatron(tmp_path / "ref", [[d] for d in docs], dtype)
    assert write_megatron(tmp_path / "ours", iter(docs), dtype=dtype) == n
    for ext in (".bin", ".idx"):
        ref = (tmp_path / f"ref{ext}").read_bytes()
        ours = (tmp_path / f"ours{ext}").read_bytes()
        assert ours == ref, ext
    assert not list(tmp_path.glob("*.tmp"))


def test_scan_and_read_match_megatron_reader_with_multi_sequence_documents(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    # 20 documents of 0..4 sentences each: sequences != documents, as with --split-sentences.
    docs = [
        [rng.integers(0, 50_000, size=int(rng.integers(1, 60))) for _ in range(int(rng.integers(0, 5)))]
        for _ in range(20)
    ]
    build_with_megatron(tmp_path / "ds", docs, np.uint16)
    ref = IndexedDataset(str(tmp_path / "ds"))
    r = reader(metadata=["document"])
    assert r.num_parts(tmp_path / "ds", 1 << 20) == 1
    res = r.scan(tmp_path / "ds", 0, 1)
    assert res.errors == []
    t = res.rows
    assert t.column_names == ["row", "num_tokens", "num_image_tokens", "checksum", "document"]
    assert t.column("row").to_pylist() == list(range(len(ref)))
    assert t.column("num_tokens").to_numpy().tolist() == ref.sequence_lengths.tolist()
    assert t.column("num_image_tokens").to_numpy().sum() == 0
    want_doc = [d for d, sentences in enumerate(docs) for _ in sentences]
    assert t.column("document").to_pylist() == want_doc
    # read: exact int32 tokens, any order, with repeats.
    rows = np.array([5, 0, len(ref) - 1, 5, 3], dtype=np.uint64)
    samples = r.read(tmp_path / "ds", rows)
    for row, s in zip(rows.tolist(), samples, strict=True):
        assert type(s.tokens) is np.ndarray and s.tokens.dtype == np.int32  # no memmap leaks out
        assert s.images == []
        np.testing.assert_array_equal(s.tokens, ref[row].astype(np.int32))
    assert r.read(tmp_path / "ds", np.array([], dtype=np.uint64)) == []
    r.close()


def test_parts_cover_every_sequence_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = make_docs(3, 101, 30_000)
    write_megatron(tmp_path / "ds", docs)
    r = reader()
    monkeypatch.setattr(mg, "_ROWS_PER_PART_MIN", 10)
    idx_size = (tmp_path / "ds.idx").stat().st_size
    assert r.num_parts(tmp_path / "ds", idx_size // 3 + 1) == 3
    assert r.num_parts(tmp_path / "ds", 1) == 10  # bounded by the minimum rows per part
    parts = [r.scan(tmp_path / "ds", p, 3).rows for p in range(3)]
    rows = np.concatenate([p.column("row").to_numpy() for p in parts])
    counts = np.concatenate([p.column("num_tokens").to_numpy() for p in parts])
    assert rows.tolist() == list(range(101))
    assert counts.tolist() == [len(d) for d in docs]
    with pytest.raises(ValueError, match="out of range"):
        r.scan(tmp_path / "ds", 3, 3)


def test_multimodal_idx_with_modes_is_accepted(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.int32, multimodal=True)
    for k in (3, 5):
        builder.add_item(torch.arange(k, dtype=torch.int32), mode=1)
        builder.end_document()
    builder.finalize(str(tmp_path / "mm.idx"))
    r = reader()
    assert r.scan(tmp_path / "mm", 0, 1).rows.column("num_tokens").to_pylist() == [3, 5]
    assert r.read(tmp_path / "mm", np.array([1]))[0].tokens.tolist() == [0, 1, 2, 3, 4]


def test_reader_sees_a_rewritten_dataset(tmp_path: Path) -> None:
    write_megatron(tmp_path / "ds", [np.arange(4)])
    r = reader()
    assert r.read(tmp_path / "ds", np.array([0]))[0].tokens.tolist() == [0, 1, 2, 3]
    write_megatron(tmp_path / "ds", [np.arange(7, 10), np.arange(2)])
    assert r.scan(tmp_path / "ds", 0, 1).rows.column("num_tokens").to_pylist() == [3, 2]
    assert r.read(tmp_path / "ds", np.array([0]))[0].tokens.tolist() == [7, 8, 9]


def test_int64_tokens_beyond_int32_are_refused_on_read(tmp_path: Path) -> None:
    write_megatron(tmp_path / "ds", [np.array([1, 2]), np.array([3, 2**40])], dtype=np.int64)
    r = reader()
    assert r.read(tmp_path / "ds", np.array([0]))[0].tokens.tolist() == [1, 2]
    with pytest.raises(SourceDataError, match=r"ds\.bin, row 1: token id outside"):
        r.read(tmp_path / "ds", np.array([0, 1]))


def test_writer_refuses_ids_that_do_not_fit_and_bad_dtypes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="document 1: token ids outside the range of uint16"):
        write_megatron(tmp_path / "ds", [np.array([1]), np.array([70_000])])
    with pytest.raises(ValueError, match="unsupported Megatron token dtype float32"):
        write_megatron(tmp_path / "ds", [np.array([1])], dtype=np.dtype(np.float32))
    with pytest.raises(ValueError, match="1-D integer"):
        write_megatron(tmp_path / "ds", [np.array([[1, 2]])])
    assert not list(tmp_path.iterdir())  # nothing half-written is left behind


# ---- bad input ------------------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path: Path) -> Path:
    write_megatron(tmp_path / "ds", make_docs(5, 10, 1000))
    return tmp_path / "ds"


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _expect(prefix: Path, file_suffix: str, pattern: str) -> None:
    with pytest.raises(SourceDataError, match=pattern) as e:
        reader().scan(prefix, 0, 1)
    assert e.value.path == f"{prefix}{file_suffix}"


def test_missing_bin_or_idx(good: Path) -> None:
    Path(f"{good}.bin").unlink()
    _expect(good, ".bin", r"missing or unreadable Megatron \.bin file .*needs both PREFIX\.idx and PREFIX\.bin")
    write_megatron(good, [np.arange(3)])
    Path(f"{good}.idx").unlink()
    _expect(good, ".idx", r"missing or unreadable Megatron \.idx")


def test_bad_magic(good: Path) -> None:
    _patch(Path(f"{good}.idx"), 0, b"NOTMEGAT\x00")
    _expect(good, ".idx", r"not a Megatron \.idx file .*rebuild it")


def test_unsupported_version(good: Path) -> None:
    _patch(Path(f"{good}.idx"), 9, struct.pack("<Q", 2))
    _expect(good, ".idx", r"unsupported \.idx version 2")


def test_float_and_unknown_dtype_codes(good: Path) -> None:
    _patch(Path(f"{good}.idx"), 17, bytes([7]))
    _expect(good, ".idx", r"dtype is float32, not token ids")
    _patch(Path(f"{good}.idx"), 17, bytes([42]))
    _expect(good, ".idx", r"unknown dtype code 42")


@pytest.mark.parametrize("cut", [1, 8, 100])
def test_truncated_idx(good: Path, cut: int) -> None:
    idx = Path(f"{good}.idx")
    idx.write_bytes(idx.read_bytes()[:-cut])
    _expect(good, ".idx", r"truncated or corrupt \.idx: \d+ bytes, but the header's 10 sequences")


def test_idx_shorter_than_header(good: Path) -> None:
    Path(f"{good}.idx").write_bytes(b"MMIDIDX\x00")
    _expect(good, ".idx", r"shorter than the 34-byte header")


@pytest.mark.parametrize("change", ["truncate", "extend"])
def test_bin_size_inconsistent_with_pointers(good: Path, change: str) -> None:
    b = Path(f"{good}.bin")
    raw = b.read_bytes()
    b.write_bytes(raw[:-2] if change == "truncate" else raw + b"\x00\x00")
    _expect(good, ".bin", r"\.bin is \d+ bytes, but its \.idx \(ds\.idx\) says \d+ .*rebuild the pair")


def test_corrupt_pointers_and_document_indices(good: Path) -> None:
    idx = Path(f"{good}.idx")
    original = idx.read_bytes()
    n = 10
    _patch(idx, 34 + 4 * n + 8 * 3, struct.pack("<q", 2))  # pointer of sequence 3
    with pytest.raises(SourceDataError, match=r"ds\.idx, row 3: corrupt \.idx: sequence pointer 2"):
        reader().scan(good, 0, 1)
    idx.write_bytes(original)
    _patch(idx, 34 + 12 * n, struct.pack("<q", 1))  # first document index must be 0
    _expect(good, ".idx", r"document indices must rise from 0")
    idx.write_bytes(original)
    _patch(idx, 34 + 4 * 2, struct.pack("<i", -1))  # negative length (breaks the pointers too)
    with pytest.raises(SourceDataError, match=r"row 2: corrupt \.idx: negative sequence length"):
        reader().scan(good, 0, 1)


def test_read_out_of_range_and_unknown_metadata(good: Path) -> None:
    with pytest.raises(SourceDataError, match=r"row 10: sequence out of range \(dataset has 10\).*re-run `loom index`"):
        reader().read(good, np.array([0, 10]))
    with pytest.raises(SourceDataError, match=r"<source mg>: `metadata` 'lang': a megatron source carries only"):
        reader(metadata=["lang"])


def test_scan_checksums_bin_content(good: Path) -> None:
    before = reader().scan(good, 0, 1).rows
    b = Path(f"{good}.bin")
    b.write_bytes(b"\xff" * b.stat().st_size)  # same size, different tokens
    after = reader().scan(good, 0, 1).rows
    assert after.drop_columns(["checksum"]).equals(before.drop_columns(["checksum"]))  # lengths from the .idx
    changed = before.column("checksum").to_numpy() != after.column("checksum").to_numpy()
    assert changed[before.column("num_tokens").to_numpy() > 0].all()
    assert set(reader().read(good, np.array([0]))[0].tokens.tolist()) == {0xFFFF}
