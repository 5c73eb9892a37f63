"""Per-sample checksums: every path equals the definition (low 32 bits of XXH3-64 of the token ids, little-endian,
in the shard's checksum dtype), and a reader's scan records what verifying its own reads computes."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from loomdata.schemas.spec import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import make_reader
from loomdata.sources._integrity import CHECKSUM, checksums, checksums_flat, prefixed_checksums, span_checksums
from loomdata.testing import write_megatron

_BLOCK = 1 << 18
_LENGTHS = [0, 1, 5, 1000, _BLOCK - 1, _BLOCK, _BLOCK + 1, 2 * _BLOCK + 7, 0, 2]


def _definition(arrays: list[np.ndarray], dtype: str = "<i4") -> np.ndarray:
    digests = [xxhash.xxh3_64_intdigest(a.astype(dtype).tobytes()) & 0xFFFFFFFF for a in arrays]
    return np.array(digests, dtype=np.uint32)


def _samples(dtype: np.dtype, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.array(_LENGTHS * 3))
    flat = rng.integers(0, 250, int(lengths.sum())).astype(dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return flat, offsets, [flat[a:b] for a, b in itertools.pairwise(offsets)]


@pytest.mark.parametrize(
    ("dtype", "le"), [("<i4", "<i4"), ("u1", "u1"), ("<u2", "<u2"), ("<i8", "<i8"), (">i4", "<i4")]
)
def test_flat_and_listed_checksums_equal_the_definition(dtype: str, le: str) -> None:
    flat, offsets, arrays = _samples(np.dtype(dtype))
    want = _definition(arrays, le)  # the ids in their stored dtype, little-endian
    assert np.array_equal(checksums_flat(flat, offsets), want)  # hashed in place (big-endian: swapped first)
    as_read = [a.astype(np.int32) for a in arrays]  # what a reader returns, cast back to the stored dtype
    assert np.array_equal(checksums(as_read, le), want)
    assert np.array_equal(checksums(arrays, le), want)
    strided = [a[::2] for a in as_read]  # views that cannot be hashed in place
    assert np.array_equal(checksums(strided, le), _definition(strided, le))
    assert np.array_equal(checksums_flat(flat, offsets[4:11]), want[4:10])  # offsets need not start at 0
    assert len(set(want.tolist())) > len(want) // 2  # the data differ, so must most checksums
    if le != "<i4":  # the dtype is part of the definition: the same ids hashed as int32 differ
        assert not np.array_equal(checksums(as_read), want)


def test_definition_is_named() -> None:
    assert CHECKSUM.startswith("xxh3_64")


def test_prefixed_checksums_hash_the_placeholders_first() -> None:
    _, _, arrays = _samples(np.dtype("<i4"), seed=1)
    k = np.random.default_rng(2).integers(0, 300, len(arrays))
    streams = [np.concatenate([np.full(int(n), 7, dtype="<i4"), a]) for n, a in zip(k, arrays, strict=True)]
    assert np.array_equal(prefixed_checksums(7, k, arrays), _definition(streams))
    assert np.array_equal(prefixed_checksums(7, np.zeros(len(arrays), np.int64), arrays), _definition(arrays))


def test_empty_inputs() -> None:
    assert len(checksums([])) == 0 and len(prefixed_checksums(7, np.zeros(0, np.int64), [])) == 0
    assert len(checksums_flat(np.zeros(0, np.uint16), np.array([0]))) == 0
    assert checksums([np.zeros(0, np.int32)]).tolist() == [xxhash.xxh3_64_intdigest(b"") & 0xFFFFFFFF]


def _scan_and_read(source: SourceSpec, path: Path) -> tuple[np.ndarray, np.ndarray]:
    reader = make_reader(source, TokenizerSpec(), ImageSpec())
    rows = reader.scan(path, 0, 1).rows
    read = reader.read(path, rows.column("row").to_numpy())
    return rows.column("checksum").to_numpy(), checksums([s.tokens for s in read], reader.checksum_dtype(path))


def test_megatron_scan_records_what_verify_computes(tmp_path: Path) -> None:
    _, _, docs = _samples(np.dtype("<u2"), seed=3)
    write_megatron(tmp_path / "ds", docs, np.uint16)  # sequences of up to 2**19 tokens, hashed in place
    src = SourceSpec(name="mg", format=SourceFormat.MEGATRON, paths=["x"])
    scanned, verified = _scan_and_read(src, tmp_path / "ds")
    assert np.array_equal(scanned, verified) and np.array_equal(scanned, _definition(docs, "<u2"))  # the .bin's dtype


def test_byte_text_scan_records_what_verify_computes(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    texts = ["", "é", *("".join(rng.choice(list("abcdé xyz"), int(n))) for n in rng.integers(0, 3 * _BLOCK, 12))]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=5)
    src = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["x"], text_field="text")
    scanned, verified = _scan_and_read(src, tmp_path / "t.parquet")
    assert np.array_equal(scanned, verified)
    assert np.array_equal(scanned, _definition([np.frombuffer(t.encode(), np.uint8) for t in texts], "u1"))  # raw


@pytest.mark.parametrize("value_type", [pa.int32(), pa.int64(), pa.uint16()])
def test_parquet_tokens_are_hashed_in_the_columns_own_type(tmp_path: Path, value_type: pa.DataType) -> None:
    _, _, docs = _samples(np.dtype("<i4"), seed=5)
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"ids": pa.array([d.tolist() for d in docs], pa.list_(value_type))}), path)
    src = SourceSpec(name="p", format=SourceFormat.PARQUET, paths=["x"], tokens_field="ids")
    scanned, verified = _scan_and_read(src, path)
    stored = np.dtype(value_type.to_pandas_dtype())
    assert np.array_equal(scanned, verified) and np.array_equal(scanned, _definition(docs, stored.str))


def test_jsonl_byte_text_is_hashed_as_its_utf8_bytes(tmp_path: Path) -> None:
    import json

    texts = ["", "é", "hello", "naïve 🙂 text" * 50]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    src = SourceSpec(name="j", format=SourceFormat.JSONL, paths=["x"], text_field="text")
    scanned, verified = _scan_and_read(src, path)
    assert np.array_equal(scanned, verified)
    assert np.array_equal(scanned, _definition([np.frombuffer(t.encode(), np.uint8) for t in texts], "u1"))


def test_span_checksums_hash_every_buffer_as_int32() -> None:
    """Spans in int32 buffers (hashed in place) and in uint16 ones (a unit kept narrow: only its samples widened), in
    any order and mix, give each sample's int32 checksum (the definition through `checksums`)."""
    rng = np.random.default_rng(7)
    buffers = [
        rng.integers(0, 60_000, size=n).astype(dt) for n, dt in ((500, np.int32), (300, np.uint16), (80, np.int32))
    ]
    buffers.append(rng.integers(0, 60_000, size=200).astype(np.uint16)[::2])  # a strided narrow view
    k = 40
    buffer = rng.integers(0, len(buffers), size=k)
    sizes = np.array([len(buffers[b]) for b in buffer])
    start = (rng.random(k) * sizes).astype(np.int64)
    stop = start + (rng.random(k) * (sizes - start + 1)).astype(np.int64)  # empty samples too
    want = checksums([buffers[b][a:z].astype(np.int32) for b, a, z in zip(buffer, start, stop, strict=True)])
    np.testing.assert_array_equal(span_checksums(buffers, buffer, start, stop), want)
    only_narrow = buffer % 2 == 1
    np.testing.assert_array_equal(
        span_checksums(buffers, buffer[only_narrow], start[only_narrow], stop[only_narrow]), want[only_narrow]
    )
