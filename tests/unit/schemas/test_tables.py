"""Stored tables are stamped with kind and version; readers reject the wrong ones by file name."""

from __future__ import annotations

from pathlib import Path

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
