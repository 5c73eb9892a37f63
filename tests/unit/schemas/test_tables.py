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
