"""A decoded Parquet row group kept as the reader's own chunk (`_decode_row_group`, `_unmasked`: no
`combine_chunks` copy) against the copy it replaced (review29): arrays whose values start past 0 or whose
offsets do not start at 0 (list and large_list), float ids, nulls in the lists or in their values, other types,
and what a kept unit holds on Arrow's pool against its `nbytes` (what the loaders' memory budget counts)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.schemas import ImageSpec, SourceDataError, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import make_reader, parquet
from loomdata.sources.parquet import ParquetReader


def _reader() -> ParquetReader:
    spec = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["x"], tokens_field="ids")
    r = make_reader(spec, TokenizerSpec(), ImageSpec())
    assert isinstance(r, ParquetReader)
    return r


def _copy(arr: pa.Array) -> pa.Array:
    return pa.chunked_array([arr]).combine_chunks()


@pytest.mark.parametrize("list_type", [pa.list_, pa.large_list])
@pytest.mark.parametrize(("values_from", "offsets"), [(2, [1, 3, 5, 8]), (0, [3, 5, 7, 10]), (1, [2, 4, 9, 9])])
def test_values_sliced_or_offsets_not_from_zero_are_the_same_array(
    list_type: Callable[[pa.DataType], pa.DataType], values_from: int, offsets: list[int]
) -> None:
    """Values with an (all-valid) bitmap that start past 0, and offsets whose first is not 0: the rebuilt array
    is the copy's (lists, type, `nbytes`) on the same id buffer, with no validity bitmaps."""
    data = np.array([9, 9, 9, 1, 2, 3, 4, 5, 6, 7], np.int32)
    bitmap = pa.py_buffer(np.full(2, 255, np.uint8))
    values = pa.Array.from_buffers(pa.int32(), 10, [bitmap, pa.py_buffer(data)], null_count=-1).slice(values_from)
    odt = np.int32 if list_type is pa.list_ else np.int64
    arr = pa.Array.from_buffers(
        list_type(pa.int32()), len(offsets) - 1, [None, pa.py_buffer(np.array(offsets, odt))], children=[values]
    )
    arr.validate(full=True)
    assert arr.buffers()[2] is not None and arr.values.offset == values_from  # (a bitmap: rebuilt, not kept as is)
    got = parquet._unmasked(arr)
    assert got is not None
    got.validate(full=True)
    assert got.type == arr.type and got.to_pylist() == arr.to_pylist() == _copy(arr).to_pylist()
    assert got.nbytes == _copy(arr).nbytes
    assert got.buffers()[0] is None and got.buffers()[2] is None
    assert got.buffers()[3].address == arr.buffers()[3].address


def _write(path: Path, rows: list, typ: pa.DataType) -> Path:
    pq.write_table(pa.table({"ids": pa.array(rows, type=typ)}), path, row_group_size=len(rows) // 3)
    return path


@pytest.mark.parametrize(
    ("rows", "typ", "kept"),
    [
        ([[1, 2], [70_000], [3, 4, 5]] * 30, pa.large_list(pa.int64()), True),
        ([[1, 2], None, [3]] * 30, pa.list_(pa.int32()), False),  # a null list: combined, nulls kept
        ([[1, None], [2], [3]] * 30, pa.list_(pa.int32()), False),  # a null id: combined, nulls kept
        ([[1, 2], [3], [4]] * 30, pa.list_(pa.dictionary(pa.int8(), pa.int64())), False),
    ],
)
def test_a_decoded_group_is_the_files_rows(tmp_path: Path, rows: list, typ: pa.DataType, kept: bool) -> None:
    """Each row group read through the reader is pyarrow's own read of it (value, type, nulls); validity bitmaps
    dropped exactly where `_unmasked` keeps the chunk."""
    path = _write(tmp_path / "f.parquet", rows, typ)
    r = _reader()
    for g in range(3):
        got = r.load_unit(path, g)
        assert got is not None
        want = pq.ParquetFile(path).read_row_group(g).column("ids").combine_chunks()
        assert got[0].type == want.type and got[0].equals(want)
        assert got[0].null_count == want.null_count
        if kept:
            assert got[0].buffers()[0] is None and got[0].buffers()[2] is None


@pytest.mark.parametrize("typ", [pa.list_(pa.int32()), pa.large_list(pa.int32()), pa.list_(pa.int64())])
def test_a_kept_group_holds_no_more_of_the_pool_than_its_nbytes(tmp_path: Path, typ: pa.DataType) -> None:
    """What a decoded row group keeps allocated on Arrow's pool once the read's table is gone is its `nbytes`
    (plus the pool's 64-byte padding of each buffer), as the copy's was: the reader's buffers are not larger than
    their sizes say (measured: 1.9 MB groups, 1.000x either way)."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50_000, int(n)).tolist() for n in rng.integers(50, 2000, 600)]
    path = _write(tmp_path / "m.parquet", rows, typ)
    r = _reader()
    r.load_unit(path, 0)  # the file's footer and schema read once (not counted below)
    gc.collect()
    base = pa.total_allocated_bytes()
    got = r.load_unit(path, 1)
    assert got is not None
    arr = got[0]
    gc.collect()
    held = pa.total_allocated_bytes() - base
    assert arr.nbytes > 500_000
    assert arr.nbytes <= held <= arr.nbytes + 64 * len(arr.buffers())


@pytest.mark.parametrize(
    ("rows", "typ"),
    [([[0.5, 2.0], [1.0], []] * 30, pa.list_(pa.float32())), ([["a"], ["c"], []] * 30, pa.list_(pa.string()))],
)
def test_ids_that_are_not_integers_are_refused_by_column(tmp_path: Path, rows: list, typ: pa.DataType) -> None:
    """Lists of other values never reach `_unmasked` from a file: the read names the file and the column."""
    path = _write(tmp_path / "f.parquet", rows, typ)
    with pytest.raises(SourceDataError, match=r"f\.parquet.*column 'ids' \(tokens_field\)"):
        _reader().load_unit(path, 0)
