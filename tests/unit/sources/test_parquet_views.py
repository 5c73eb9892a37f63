"""ParquetReader.read's zero-copy path (tokens as views into the held row group) against the take path it replaces.

The oracle is the reader with `_token_views` switched off (every group through `take`, `concat_arrays` and
`_tokens_of`, the implementation before the views), and an independent pyarrow read of the whole file.
Random row sets over whole kept units, `KeptRows` (some rows kept, some decoded again), fresh decodes, empty
documents, duplicates, unsorted rows and every list type a tokens column may have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import KeptRows, make_reader, parquet
from loomdata.sources._base import UnitKey
from loomdata.sources.parquet import ParquetReader


class _RowsCache:
    """A unit cache that wants every `every`-th row of each group (so `_keep` keeps `KeptRows`), or all (None)."""

    def __init__(self, every: int | None, rg_rows: int) -> None:
        self.every, self.rg_rows = every, rg_rows
        self.items: dict[UnitKey, Any] = {}

    def get(self, key: UnitKey) -> Any | None:
        return self.items.get(key)

    def put(self, key: UnitKey, value: Any, nbytes: int) -> None:
        self.items[key] = value

    def wanted(self, key: UnitKey) -> np.ndarray | None:
        if self.every is None:
            return None
        lo = key[1] * self.rg_rows
        return np.arange(lo, lo + self.rg_rows, self.every, dtype=np.int64)


def _reader(cache: _RowsCache | None) -> ParquetReader:
    spec = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["x"], tokens_field="ids")
    r = make_reader(spec, TokenizerSpec(), ImageSpec())
    assert isinstance(r, ParquetReader)
    if cache is not None:
        r.use_unit_cache(cache)
    return r


def _write(path: Path, typ: pa.DataType, n: int, rg: int, seed: int, high: int = 30_000) -> list[list[int]]:
    """`n` documents of ids in [0, `high`) (ids under 65,536: a unit kept with under half its rows wanted is uint16)."""
    rng = np.random.default_rng(seed)
    if pa.types.is_fixed_size_list(typ):
        docs = [rng.integers(0, high, size=typ.list_size).tolist() for _ in range(n)]
    else:  # a quarter of the documents empty, one far longer than the rest
        lens = np.where(rng.random(n) < 0.25, 0, rng.integers(1, 200, size=n))
        lens[n // 2] = 5_000
        docs = [rng.integers(0, high, size=int(k)).tolist() for k in lens]
    pq.write_table(pa.table({"ids": pa.array(docs, type=typ)}), path, row_group_size=rg)
    return docs


def _read(
    r: ParquetReader, path: Path, rows: np.ndarray, views: bool, monkeypatch: pytest.MonkeyPatch
) -> list[np.ndarray]:
    with monkeypatch.context() as m:
        if not views:
            m.setattr(parquet, "_token_views", lambda *a: None)
        return [s.tokens for s in r.read(path, rows)]


_TYPES = [
    pa.list_(pa.int32()),
    pa.large_list(pa.int32()),
    pa.list_(pa.int64()),
    pa.list_(pa.int16()),
    pa.list_(pa.int32(), 3),
]


_CASES = [(t, h) for t in _TYPES for h in (30_000, 100_000) if h < 32_768 or t.value_type != pa.int16()]


@pytest.mark.parametrize(("typ", "high"), _CASES, ids=[f"{t}-ids<{h}" for t, h in _CASES])
@pytest.mark.parametrize("every", [None, 1, 3], ids=["whole", "kept-all", "kept-third"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_views_equal_the_take_path_and_the_file(
    tmp_path: Path, typ: pa.DataType, every: int | None, seed: int, high: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rg, n = 16, 200
    path = tmp_path / "t.parquet"
    docs = _write(path, typ, n, rg, seed, high)
    rng = np.random.default_rng(100 + seed)
    fast = _reader(_RowsCache(every, rg) if every else None)
    slow = _reader(_RowsCache(every, rg) if every else None)
    requests = [
        rng.integers(0, n, size=60),  # unsorted, duplicates, many groups
        np.sort(rng.choice(n, size=30, replace=False)),
        np.array([n // 2]),  # the long document alone
        np.arange(0, n, 7),  # after the first reads: kept rows hit, rows not kept decoded again
        np.zeros(0, dtype=np.int64),
        rng.integers(0, n, size=60),
    ]
    zero_copy = not pa.types.is_fixed_size_list(typ) and typ.value_type == pa.int32()
    for rows in requests:
        got = _read(fast, path, rows, True, monkeypatch)
        want = _read(slow, path, rows, False, monkeypatch)
        assert len(got) == len(want) == len(rows)
        for i, g, w in zip(rows.tolist(), got, want, strict=True):
            assert g.dtype == w.dtype == np.int32
            if high > 65_536 or not zero_copy or every != 3:  # list<int32>: views of the held group; the rest converted
                assert g.flags.writeable != zero_copy
            # (ids under 65,536 with a third of the rows wanted: views of a fresh decode, int32 copies of a unit kept
            # narrow; every row wanted keeps the group int32, `_NARROW_SHARE`)
            np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(g, np.asarray(docs[i], dtype=np.int32))
    if every is not None:  # the caches kept the same rows
        assert fast.unit_cache.items.keys() == slow.unit_cache.items.keys()  # type: ignore[attr-defined]
        for k, v in fast.unit_cache.items.items():  # type: ignore[attr-defined]
            assert isinstance(v, KeptRows) == isinstance(slow.unit_cache.items[k], KeptRows)  # type: ignore[attr-defined]


def test_a_null_row_still_raises_with_its_row_and_other_rows_read(tmp_path: Path) -> None:
    vals = [[1, 2, 3], None, [4], [5, None], [], [7, 8]]
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"ids": pa.array(vals, pa.list_(pa.int32()))}), path, row_group_size=2)
    r = _reader(None)
    assert [s.tokens.tolist() for s in r.read(path, np.array([5, 0, 4]))] == [[7, 8], [1, 2, 3], []]
    with pytest.raises(SourceDataError, match=r"row 1: column 'ids': null value"):
        r.read(path, np.array([0, 1]))


def test_views_share_the_held_group_and_are_read_only(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    _write(path, pa.list_(pa.int32()), 40, 8, seed=3)
    r = _reader(None)
    a, b = r.read(path, np.array([1, 2]))
    assert not a.tokens.flags.writeable  # the loader copies segments out; nothing may write into a held unit
    if len(a.tokens) and len(b.tokens):
        assert np.shares_memory(np.asarray(a.tokens.base), np.asarray(b.tokens.base)) or a.tokens.base is b.tokens.base
