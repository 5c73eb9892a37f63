"""Assemble a source's index tables from per-shard scans, columnar (concat + arange, no row loops).

Shard ids are dense over the shards that were indexed, in sorted path order; `sample` is dense
0..n-1 in (shard, row) order; metadata columns follow the required ones in the spec's order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from loomdata.indexing._cache import ShardScan, checksum_dtype_of, layout_of
from loomdata.indexing._fingerprint import ShardStat
from loomdata.schemas.errors import IndexBuildError
from loomdata.schemas.tables import CHECKSUM_FIELD, ERRORS_SCHEMA, INDEX_SCHEMA, SHARDS_SCHEMA, TableKind, write_table
from loomdata.sources._integrity import CHECKSUM
from loomdata.sources._layouts import layouts_table, write_layouts

__all__ = ["IndexTables", "assemble", "write_tables"]


@dataclass(frozen=True, slots=True)
class IndexTables:
    """The three tables of one source's index (errors is None when nothing was skipped), and the dtypes its
    shards' checksums were computed in (sorted, distinct)."""

    samples: pa.Table
    shards: pa.Table
    errors: pa.Table | None
    checksum_dtypes: tuple[str, ...] = ()
    layouts: pa.Table | None = None  # object shards' footers (`sources._layouts`); None: none kept


def concat_scans(tables: list[pa.Table], where: str, what: str = "shards") -> pa.Table:
    """Concatenate scan tables (parts or shards); a metadata type clash is an IndexBuildError naming `where`."""
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise IndexBuildError(
            f"{where}: {what} disagree on a metadata column's type ({e}); make the column's type the same "
            "in every file or drop it from the source's `metadata`"
        ) from None


def _metadata_column(rows: pa.Table, name: str, n: int) -> pa.ChunkedArray | pa.Array:
    if name in rows.column_names:
        return rows.column(name)
    return pa.nulls(n)


def assemble(
    source: str, stats: Sequence[ShardStat], scans: Sequence[ShardScan], metadata: Sequence[str]
) -> IndexTables:
    """The index tables of one source from its shards' stats and scans (both in path order)."""
    kept = [i for i, s in enumerate(scans) if not s.skipped]
    counts = np.array([scans[i].rows.num_rows for i in kept], dtype=np.int64)
    total = int(counts.sum())
    if kept:
        rows = concat_scans([scans[i].rows for i in kept], f"source {source!r}")
    else:
        rows = pa.table({"row": pa.array([], pa.uint64())})
    columns: list[pa.Array | pa.ChunkedArray] = [
        pa.array(np.arange(total, dtype=np.uint64)),
        pa.array(np.repeat(np.arange(len(kept), dtype=np.uint32), counts)),
        rows.column("row").cast(pa.uint64()),
        (rows.column("num_tokens") if kept else pa.array([], pa.uint32())).cast(pa.uint32()),
        (rows.column("num_image_tokens") if kept else pa.array([], pa.uint32())).cast(pa.uint32()),
        (rows.column("checksum") if kept else pa.array([], pa.uint32())).cast(pa.uint32()),
    ]
    fields = [*INDEX_SCHEMA, CHECKSUM_FIELD]
    for m in metadata:
        col = _metadata_column(rows, m, total)
        columns.append(col)
        fields.append(pa.field(m, col.type))
    samples = pa.Table.from_arrays(columns, schema=pa.schema(fields))

    shards = pa.Table.from_arrays(
        [
            pa.array(np.arange(len(kept), dtype=np.uint32)),
            pa.array([str(stats[i].path) for i in kept], pa.string()),
            pa.array([stats[i].size_bytes for i in kept], pa.uint64()),
            pa.array([stats[i].mtime_ns for i in kept], pa.int64()),
            pa.array([stats[i].fingerprint for i in kept], pa.string()),
            pa.array(counts, pa.uint64()),
        ],
        schema=SHARDS_SCHEMA,
    )

    err_path: list[str] = []
    err_row: list[int | None] = []
    err_msg: list[str] = []
    for stat, scan in zip(stats, scans, strict=True):
        ordered = sorted(scan.errors, key=lambda e: -1 if e[0] is None else e[0])
        for row, msg in ordered:
            err_path.append(str(stat.path))
            err_row.append(row)
            err_msg.append(msg)
    errors = None
    if err_path:
        errors = pa.Table.from_arrays(
            [pa.array(err_path, pa.string()), pa.array(err_row, pa.int64()), pa.array(err_msg, pa.string())],
            schema=ERRORS_SCHEMA,
        )
    dtypes = tuple(sorted({d for i in kept if (d := checksum_dtype_of(scans[i])) is not None}))
    layouts = layouts_table(
        list(range(len(kept))), [stats[i].fingerprint for i in kept], [layout_of(scans[i]) for i in kept]
    )
    return IndexTables(samples=samples, shards=shards, errors=errors, checksum_dtypes=dtypes, layouts=layouts)


def _write_atomic(table: pa.Table, path: Path, kind: TableKind, meta: dict[str, str] | None = None) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_table(table, tmp, kind, extra_metadata=meta)
    os.replace(tmp, path)


def write_tables(
    tables: IndexTables,
    samples: Path,
    shards: Path,
    errors: Path,
    fingerprint: str,
    extra: dict[str, str] | None = None,
) -> None:
    """Write the tables (each atomically); remove a stale errors table when nothing was skipped.

    `extra` goes into samples.parquet's metadata beside the fingerprint (the scan settings), and `checksum`
    names the definition of the per-sample checksums (`sources._integrity.CHECKSUM`), which loaders check, and
    `checksum_dtype` the dtype(s) the shards' ids were hashed in (comma-separated)."""
    write_layouts(shards.parent, tables.layouts)
    if tables.errors is not None:
        _write_atomic(tables.errors, errors, TableKind.ERRORS)
    else:
        errors.unlink(missing_ok=True)
    _write_atomic(tables.shards, shards, TableKind.SHARDS, {"fingerprint": fingerprint})
    meta = {"fingerprint": fingerprint, "checksum": CHECKSUM, "checksum_dtype": ",".join(tables.checksum_dtypes)}
    meta.update(extra or {})
    _write_atomic(tables.samples, samples, TableKind.INDEX, meta)
