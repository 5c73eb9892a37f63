"""Range reads through fsspec's in-memory filesystem (a real fsspec filesystem, no network)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.storage import ObjectView, RangeFile, identity, read_range, request_stats, reset_request_stats

_DATA = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture
def mem() -> Iterator[str]:
    fs = fsspec.filesystem("memory")
    fs.pipe("/loomtest/blob.bin", _DATA)
    reset_request_stats()
    yield "memory://loomtest/blob.bin"
    fs.rm("/loomtest", recursive=True)


def test_read_range_and_identity(mem: str) -> None:
    assert read_range(mem, 10, 20) == _DATA[10:20]
    assert read_range(mem, 5, 5) == b""
    assert identity(mem).size == len(_DATA)
    stats = request_stats()
    assert stats["get"] == 1 and stats["get_bytes"] == 10 and stats["head"] == 1


def test_range_file_seeks_reads_and_buffers(mem: str) -> None:
    f = RangeFile(mem, len(_DATA))
    assert f.read(4) == _DATA[:4]
    f.seek(100)
    assert f.read(50) == _DATA[100:150]  # inside the first 256 KiB buffer: no new request
    assert request_stats()["get"] == 1
    f.seek(-10, io.SEEK_END)
    assert f.read() == _DATA[-10:] and f.read(5) == b""
    assert f.tell() == len(_DATA)


def test_object_view_is_sliceable_like_an_mmap(mem: str) -> None:
    v = ObjectView(mem, len(_DATA))
    assert len(v) == len(_DATA) and v[3] == 3 and v[-1] == 255
    assert v[262_140:262_150] == _DATA[262_140:262_150]  # across a page boundary
    assert v.find(b"\xff\x00", 0) == 255 and v.find(b"\x05", 262_144) == 262_149
    assert v.find(b"not there") == -1
    with pytest.raises(IndexError):
        v[len(_DATA)]


def test_pyarrow_reads_a_parquet_footer_and_row_groups_through_a_range_file() -> None:
    fs = fsspec.filesystem("memory")
    buf = io.BytesIO()
    tokens = [np.arange(i, i + 5, dtype=np.int32) for i in range(1000)]
    pq.write_table(pa.table({"tokens": pa.array(tokens, pa.list_(pa.int32()))}), buf, row_group_size=100)
    fs.pipe("/loomtest/t.parquet", buf.getvalue())
    try:
        url = "memory://loomtest/t.parquet"
        pf = pq.ParquetFile(RangeFile(url, identity(url).size))
        assert pf.metadata.num_row_groups == 10
        got = pf.read_row_groups([7], columns=["tokens"]).column(0).to_pylist()
        assert got[0] == list(range(700, 705))
    finally:
        fs.rm("/loomtest", recursive=True)


def test_range_file_hands_out_views_of_the_range_fetched_and_bytes_to_read(
    mem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`read_buffer` (what pyarrow reads through) slices the range fetched without a copy, whether the GET gave
    bytes or a pyarrow.Buffer (pyarrow's S3 client); `read` and `readinto` give the same bytes; a read past the
    range held fetches the next one."""
    from loomdata.storage import _fs

    arrow = pa.py_buffer(_DATA)
    monkeypatch.setattr(_fs, "_read_view", lambda _url, a, b, *_args, **_kw: arrow.slice(a, b - a))
    f = RangeFile(mem, len(_DATA))
    f.preload(1000, 400_000)
    view = f.read_buffer(1000)  # before the span held: a fetch of its own from the position
    assert bytes(view) == _DATA[:1000] and view.obj is f._buf
    f.seek(5000)
    view = f.read_buffer(3000)
    assert bytes(view) == _DATA[5000:8000] and view.obj is f._buf  # the range fetched, not a copy
    out = bytearray(10)
    assert f.readinto(out) == 10 and bytes(out) == _DATA[8000:8010]
    got = f.read(20)
    assert type(got) is bytes and got == _DATA[8010:8030]
    f.seek(len(_DATA) - 5)
    assert f.read_buffer(100).tobytes() == _DATA[-5:] and f.read() == b"" and f.read_buffer().nbytes == 0
    monkeypatch.undo()
    g = RangeFile(mem, len(_DATA))
    first = g.read(len(_DATA))
    assert first == _DATA and first is g._buf  # the whole range fetched, as fetched (bytes): returned as is


def test_pyarrow_decodes_a_coalesced_span_through_views_without_holding_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row groups decoded from a preloaded span arrive through `read_buffer` (never `read`: no copy) and do not
    point into the span (its memory is freed at `release`, not held by the arrays the unit cache keeps)."""
    calls = {"read_buffer": 0, "read": 0}
    for name in calls:
        real = getattr(RangeFile, name)

        def counted(self: RangeFile, *a: object, _real: Any = real, _name: str = name, **kw: object) -> Any:
            calls[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(RangeFile, name, counted)
    fs = fsspec.filesystem("memory")
    buf = io.BytesIO()
    tokens = [np.arange(i, i + 50, dtype=np.int32) for i in range(2000)]
    table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int32()))})
    pq.write_table(table, buf, row_group_size=500, compression="none")
    fs.pipe("/loomtest/t.parquet", buf.getvalue())
    try:
        url = "memory://loomtest/t.parquet"
        f = RangeFile(url, identity(url).size)
        md = pq.read_metadata(io.BytesIO(buf.getvalue()))
        pf = pq.ParquetFile(f, metadata=md, pre_buffer=False)
        f.preload(0, f.size())
        span = memoryview(f._buf)
        lo, hi = np.frombuffer(span, np.uint8).ctypes.data, np.frombuffer(span, np.uint8).ctypes.data + span.nbytes
        calls.update(read_buffer=0, read=0)
        col = pf.read_row_group(2, columns=["tokens"]).column(0).combine_chunks()
        assert calls["read_buffer"] >= 1 and calls["read"] == 0  # pyarrow took views of the span
        f.release()
        assert col.to_pylist()[0] == list(range(1000, 1050))
        addresses = [b.address for b in (*col.buffers(), *col.values.buffers()) if b is not None]
        assert not any(lo <= a < hi for a in addresses)
    finally:
        fs.rm("/loomtest", recursive=True)
