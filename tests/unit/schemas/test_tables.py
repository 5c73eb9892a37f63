"""Stored tables are stamped with kind and version; readers reject the wrong ones by file name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.schemas import (
    MANIFEST_SCHEMA,
    ContractError,
    TableKind,
    read_table,
    table_metadata,
    write_table,
)
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.tables import open_table, synthetic_index, synthetic_shards


def _manifest(n: int = 3) -> pa.Table:
    return pa.table({f.name: pa.array(range(n), f.type) for f in MANIFEST_SCHEMA}, schema=MANIFEST_SCHEMA)


def test_round_trip_with_metadata(tmp_path: Path) -> None:
    p = tmp_path / "m.parquet"
    write_table(_manifest(), p, TableKind.MANIFEST, extra_metadata={"plan_id": "abc"})
    assert read_table(p, TableKind.MANIFEST).equals(_manifest())
    meta = table_metadata(p)
    assert meta["kind"] == "manifest" and meta["version"] == "1" and meta["plan_id"] == "abc"


def test_wrong_kind_version_and_schema_are_named(tmp_path: Path) -> None:
    p = tmp_path / "m.parquet"
    write_table(_manifest(), p, TableKind.MANIFEST)
    with pytest.raises(ContractError, match=r"m\.parquet: expected a loomdata index table, found kind 'manifest'"):
        read_table(p, TableKind.INDEX)
    t = pq.read_table(p)
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"loomdata.version": b"99"}), p)
    with pytest.raises(ContractError, match="format version 99 is not supported"):
        read_table(p, TableKind.MANIFEST)
    bad = _manifest().drop_columns(["lane"]).cast(MANIFEST_SCHEMA.remove(MANIFEST_SCHEMA.get_field_index("lane")))
    with pytest.raises(ContractError, match="missing column 'lane'"):
        write_table(bad, tmp_path / "x.parquet", TableKind.MANIFEST)
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1]}), plain)
    with pytest.raises(ContractError, match="found kind 'none'"):
        read_table(plain, TableKind.MANIFEST)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ContractError, match="not a readable Parquet file"):
        read_table(tmp_path / "junk.parquet", TableKind.MANIFEST)


def test_errors_survive_pickling() -> None:
    """Errors raised in Dask tasks or actors reach the client intact."""
    import pickle

    from loomdata.schemas import SourceDataError, SpecError

    e = SourceDataError("/d/a.parquet", "null tokens", row=7, hint="fix it")
    back = pickle.loads(pickle.dumps(e))
    assert (back.path, back.row, back.reason, str(back)) == (e.path, e.row, e.reason, str(e))
    s = SpecError(["a: b", "c: d"], "spec.yaml")
    assert str(pickle.loads(pickle.dumps(s))) == str(s)


def _index(tmp_path: Path, groups: int = 4, per: int = 50) -> Path:
    n = groups * per
    t = pa.table(
        {
            "sample": pa.array(range(n), pa.uint64()),
            "shard": pa.array([i // per for i in range(n)], pa.uint32()),
            "row": pa.array([i % per for i in range(n)], pa.uint64()),
            "num_tokens": pa.array([1 + i % 7 for i in range(n)], pa.uint32()),
            "num_image_tokens": pa.array([0] * n, pa.uint32()),
            "lang": pa.array([None if i % 5 == 0 else f"l{i % 3}" for i in range(n)], pa.string()),
        }
    )
    path = tmp_path / "samples.parquet"
    write_table(t, path, TableKind.INDEX)
    stamped = pq.read_table(path)  # rewritten in row groups of `per` rows, with the stamp
    pq.write_table(stamped, path, row_group_size=per)
    return path


@pytest.mark.parametrize(
    "columns, filters",
    [
        (None, None),
        (["shard"], None),
        (["sample", "row"], [("shard", ">=", 1), ("shard", "<", 3)]),
        (["sample"], [("shard", "==", 2)]),
        (["sample"], [("shard", ">", 9)]),  # no row group can match: an empty table of the columns
        (None, [("num_tokens", "<=", 2), ("shard", "!=", 0)]),
        (["sample"], [("shard", "in", [0, 3])]),  # another operator: through pyarrow.parquet.read_table
        (["sample"], [("lang", "==", "l1")]),  # a string column: through pyarrow.parquet.read_table
    ],
)
def test_read_table_filters_as_pyarrow_does(
    tmp_path: Path, columns: list[str] | None, filters: list[tuple[str, str, object]] | None
) -> None:
    path = _index(tmp_path)
    got = read_table(path, TableKind.INDEX, columns=columns, filters=filters)
    want = pq.read_table(path, columns=columns, filters=filters)
    assert got.equals(want), (got, want)


def test_manifest_and_report_steps_are_byte_stream_split_and_read_back(tmp_path: Path) -> None:
    """The planner's two big tables: every column BYTE_STREAM_SPLIT and zstd, no dictionary, step statistics kept
    (step-range reads prune by them); kinds outside the split ones keep dictionaries. The values read back are the
    table's."""
    import numpy as np

    from loomdata.schemas.tables import ERRORS_SCHEMA, PLAN_STEPS_SCHEMA, step_span

    rng = np.random.default_rng(0)
    n = 5000
    m = pa.table(
        {
            f.name: pa.array(np.sort(rng.integers(0, 50, n)) if f.name == "step" else rng.integers(0, 200, n), f.type)
            for f in MANIFEST_SCHEMA
        },
        schema=MANIFEST_SCHEMA,
    )
    steps = pa.table(
        {
            **{
                f.name: pa.array(np.arange(n) if f.name == "step" else (rng.random(n) * 1e6).round(), f.type)
                for f in PLAN_STEPS_SCHEMA
            },
            "tokens__web": pa.array(rng.integers(0, 9000, n), pa.int64()),
            "weight__web": pa.array(np.full(n, 0.25)),
        }
    )
    for table, kind in ((m, TableKind.MANIFEST), (steps, TableKind.PLAN_STEPS)):
        p = tmp_path / f"{kind.value}.parquet"
        write_table(table, p, kind, row_group_size=2048)
        assert read_table(p, kind).equals(table)
        md = pq.ParquetFile(p).metadata
        for g in range(md.num_row_groups):
            for c in range(md.num_columns):
                col = md.row_group(g).column(c)
                assert col.compression == "ZSTD"
                assert "BYTE_STREAM_SPLIT" in col.encodings and "RLE_DICTIONARY" not in col.encodings, col
        assert step_span(p, kind) == (int(table["step"][0].as_py()), int(table["step"][-1].as_py()))
        assert md.row_group(1).column(0).statistics.has_min_max
    errors = pa.table(
        {"path": ["a.jsonl"] * n, "row": pa.array(rng.integers(0, 5, n), pa.int64()), "message": ["bad"] * n},
        schema=ERRORS_SCHEMA,
    )
    write_table(errors, tmp_path / "e.parquet", TableKind.ERRORS)
    assert "RLE_DICTIONARY" in pq.ParquetFile(tmp_path / "e.parquet").metadata.row_group(0).column(1).encodings


def test_index_tables_split_their_numbers_and_keep_dictionaries_for_the_rest(tmp_path: Path) -> None:
    """An index's number columns (required, checksum, carried) are BYTE_STREAM_SPLIT without a dictionary (their
    values barely repeat); a carried string column keeps its dictionary, a bool is written plain; every value reads
    back the same."""
    import numpy as np

    from loomdata.schemas.tables import INDEX_SCHEMA

    rng = np.random.default_rng(1)
    n = 5000
    index = pa.table(
        {
            **{f.name: pa.array(rng.integers(0, 1 << 20, n), f.type) for f in INDEX_SCHEMA},
            "checksum": pa.array(rng.integers(0, 1 << 32, n, dtype=np.uint32)),
            "lang": pa.array(rng.choice(["en", "de", "fr"], n)),
            "score": pa.array(rng.random(n)),
            "kept": pa.array(rng.random(n) > 0.5),
        }
    )
    p = tmp_path / "samples.parquet"
    write_table(index, p, TableKind.INDEX, row_group_size=2048)
    assert read_table(p, TableKind.INDEX).equals(index)
    md = pq.ParquetFile(p).metadata
    for g in range(md.num_row_groups):
        enc = {
            md.row_group(g).column(c).path_in_schema: md.row_group(g).column(c).encodings for c in range(md.num_columns)
        }
        for name in (*INDEX_SCHEMA.names, "checksum", "score"):
            assert "BYTE_STREAM_SPLIT" in enc[name] and "RLE_DICTIONARY" not in enc[name], (name, enc[name])
        assert "RLE_DICTIONARY" in enc["lang"]
        assert "BYTE_STREAM_SPLIT" not in enc["kept"] and "RLE_DICTIONARY" not in enc["kept"]


def test_a_split_kind_writes_an_extra_column_parquet_cannot_split(tmp_path: Path) -> None:
    """BYTE_STREAM_SPLIT takes only numbers: an extra column of another type (the report's steps table accepts
    extra columns) is written plain beside the split ones, never refused."""
    import numpy as np

    from loomdata.schemas.tables import PLAN_STEPS_SCHEMA

    n = 300
    steps = pa.table(
        {
            **{f.name: pa.array(np.arange(n), f.type) for f in PLAN_STEPS_SCHEMA},
            "note": pa.array([f"step {i}" for i in range(n)]),
            "flag": pa.array(np.arange(n) % 2 == 0),
        }
    )
    p = tmp_path / "steps.parquet"
    write_table(steps, p, TableKind.PLAN_STEPS)
    assert read_table(p, TableKind.PLAN_STEPS).equals(steps)
    md = pq.ParquetFile(p).metadata.row_group(0)
    encodings = {md.column(c).path_in_schema: md.column(c).encodings for c in range(md.num_columns)}
    assert "BYTE_STREAM_SPLIT" in encodings["step"]
    assert all(
        "BYTE_STREAM_SPLIT" not in encodings[k] and "RLE_DICTIONARY" not in encodings[k] for k in ("note", "flag")
    )


def test_a_table_refused_by_open_table_is_closed_and_an_index_opening_closes_its_shards_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """open_table closes the file it refuses (the caller never gets the handle), and IndexFiles.open_samples closes
    the shards table it opens only to check its footer (both were left to the garbage collector)."""
    opened: list[pq.ParquetFile] = []
    init = pq.ParquetFile.__init__

    def spy(self: pq.ParquetFile, *a: object, **kw: object) -> None:
        init(self, *a, **kw)  # type: ignore[arg-type]
        opened.append(self)

    monkeypatch.setattr(pq.ParquetFile, "__init__", spy)
    p = tmp_path / "m.parquet"
    write_table(_manifest(), p, TableKind.MANIFEST)
    with pytest.raises(ContractError, match="expected a loomdata index table"):
        open_table(p, TableKind.INDEX)
    assert len(opened) == 1 and opened[0].closed
    files = IndexFiles.of(tmp_path, "s")
    files.root.mkdir(parents=True)
    write_table(synthetic_index(np.full(10, 7, dtype=np.uint32)), files.samples, TableKind.INDEX, {"fingerprint": "f"})
    write_table(synthetic_shards(10), files.shards, TableKind.SHARDS)
    opened.clear()
    pf, _ = files.open_samples()
    shards = [f for f in opened if f is not pf]
    assert len(shards) == 1 and shards[0].closed and not pf.closed
    pf.close()
