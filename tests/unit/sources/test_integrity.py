"""Per-sample checksums: every fast path equals the definition (CRC-32 of the int32 LE token stream), and a
reader's scan records what verifying its own reads computes."""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.schemas.spec import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import make_reader
from loomdata.sources._integrity import _BLOCK_TOKENS, checksums, checksums_flat, prefixed_checksums
from loomdata.testing import write_megatron

_LENGTHS = [0, 1, 5, 1000, _BLOCK_TOKENS - 1, _BLOCK_TOKENS, _BLOCK_TOKENS + 1, 2 * _BLOCK_TOKENS + 7, 0, 2]


def _definition(arrays: list[np.ndarray]) -> np.ndarray:
    return np.array([zlib.crc32(a.astype("<i4").tobytes()) for a in arrays], dtype=np.uint32)


def _samples(dtype: np.dtype, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.array(_LENGTHS * 3))
    flat = rng.integers(0, 250, int(lengths.sum())).astype(dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return flat, offsets, [flat[a:b] for a, b in itertools.pairwise(offsets)]


@pytest.mark.parametrize("dtype", ["<i4", "u1", "<u2", "<i8", ">i4"])
def test_flat_and_listed_checksums_equal_the_definition(dtype: str) -> None:
    flat, offsets, arrays = _samples(np.dtype(dtype))
    want = _definition(arrays)
    assert np.array_equal(checksums_flat(flat, offsets), want)  # in place (int32) or cast block by block
    assert np.array_equal(checksums(arrays), want)
    strided = [a[::2] for a in arrays]  # views that cannot be hashed in place
    assert np.array_equal(checksums(strided), _definition(strided))
    assert np.array_equal(checksums_flat(flat, offsets[4:11]), want[4:10])  # offsets need not start at 0
    assert len(set(want.tolist())) > len(want) // 2  # the data differ, so must most checksums


def test_prefixed_checksums_hash_the_placeholders_first() -> None:
    _, _, arrays = _samples(np.dtype("<i4"), seed=1)
    k = np.random.default_rng(2).integers(0, 300, len(arrays))
    streams = [np.concatenate([np.full(int(n), 7, dtype="<i4"), a]) for n, a in zip(k, arrays, strict=True)]
    assert np.array_equal(prefixed_checksums(7, k, arrays), _definition(streams))
    assert np.array_equal(prefixed_checksums(7, np.zeros(len(arrays), np.int64), arrays), _definition(arrays))


def test_empty_inputs() -> None:
    assert len(checksums([])) == 0 and len(prefixed_checksums(7, np.zeros(0, np.int64), [])) == 0
    assert len(checksums_flat(np.zeros(0, np.uint16), np.array([0]))) == 0
    assert checksums([np.zeros(0, np.int32)]).tolist() == [zlib.crc32(b"")]


def _scan_and_read(source: SourceSpec, path: Path) -> tuple[np.ndarray, np.ndarray]:
    reader = make_reader(source, TokenizerSpec(), ImageSpec())
    rows = reader.scan(path, 0, 1).rows
    read = reader.read(path, rows.column("row").to_numpy())
    return rows.column("checksum").to_numpy(), checksums([s.tokens for s in read])


def test_megatron_scan_records_what_verify_computes(tmp_path: Path) -> None:
    _, _, docs = _samples(np.dtype("<u2"), seed=3)
    write_megatron(tmp_path / "ds", docs, np.uint16)  # a sequence of 3 blocks and more: hashed in pieces
    src = SourceSpec(name="mg", format=SourceFormat.MEGATRON, paths=["x"])
    scanned, verified = _scan_and_read(src, tmp_path / "ds")
    assert np.array_equal(scanned, verified) and np.array_equal(scanned, _definition(docs))


def test_byte_text_scan_records_what_verify_computes(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    texts = ["", "é", *("".join(rng.choice(list("abcdé xyz"), int(n))) for n in rng.integers(0, 3 * _BLOCK_TOKENS, 12))]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=5)
    src = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["x"], text_field="text")
    scanned, verified = _scan_and_read(src, tmp_path / "t.parquet")
    assert np.array_equal(scanned, verified)
    assert np.array_equal(scanned, _definition([np.frombuffer(t.encode(), np.uint8) for t in texts]))
