"""Cached scan results, one Parquet file per shard under `index/<source>/_parts/<key>.parquet`.

A cached file holds the shard's scan rows (`row, num_tokens, num_image_tokens, checksum`, metadata columns)
and, in its key-value metadata, whether the whole shard was skipped, the skipped samples and the checksum
definition its checksums follow (`sources._integrity.CHECKSUM`); the rows' own metadata carries the shard's
checksum dtype (`tag_checksum_dtype`, set by the scan task). An unreadable or foreign cache file, or
one of another checksum definition, counts as a miss (the shard is scanned again), never as an error: an
incremental `loom index` under a new definition rescans every shard.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.schemas.layout import ObjectMemo, load_objects, objects_file, store_objects
from loomdata.sources._integrity import CHECKSUM

__all__ = [
    "ObjectMemo",
    "ShardScan",
    "checksum_dtype_of",
    "layout_of",
    "load_objects",
    "load_scan",
    "objects_file",
    "parts_dir",
    "store_objects",
    "store_scan",
    "tag_checksum_dtype",
    "tag_layout",
]

_VERSION = b"2"
_K_VERSION = b"loomdata.scan_cache"
_K_SKIPPED = b"loomdata.skipped"
_K_ERRORS = b"loomdata.errors"
_K_CHECKSUM = b"loomdata.checksum"
_K_DTYPE = b"loomdata.checksum_dtype"
_K_LAYOUT = b"loomdata.layout"

SCAN_COLUMNS = ("row", "num_tokens", "num_image_tokens", "checksum")


@dataclass(frozen=True, slots=True)
class ShardScan:
    """The scan of one whole shard: its rows, its skipped samples, and whether it was skipped whole."""

    rows: pa.Table
    errors: list[tuple[int | None, str]] = field(default_factory=list)
    skipped: bool = False


def tag_checksum_dtype(rows: pa.Table, dtype: np.dtype) -> pa.Table:
    """`rows` (a scan's) tagged with the dtype its checksums were computed in (`FormatReader.checksum_dtype`)."""
    meta = dict(rows.schema.metadata or {})
    meta[_K_DTYPE] = np.dtype(dtype).name.encode()
    return rows.replace_schema_metadata(meta)


def tag_layout(rows: pa.Table, layout: bytes | None) -> pa.Table:
    """`rows` (a shard's first part's scan) carrying the shard's layout (`FormatReader.layout_of`), if it has one."""
    if layout is None:
        return rows
    return rows.replace_schema_metadata({**(rows.schema.metadata or {}), _K_LAYOUT: layout})


def layout_of(scan: ShardScan) -> bytes | None:
    """The layout a shard's scan carries (None: a local file, a skipped shard, a scan cached before layouts)."""
    return (scan.rows.schema.metadata or {}).get(_K_LAYOUT)


def checksum_dtype_of(scan: ShardScan) -> str | None:
    """The checksum dtype a shard's scan was tagged with (None: untagged, e.g. a shard skipped whole)."""
    value = (scan.rows.schema.metadata or {}).get(_K_DTYPE)
    return value.decode() if value is not None else None


def parts_dir(root: Path) -> Path:
    """Folder of a source's cached per-shard scans."""
    return root / "_parts"


def store_scan(path: Path, scan: ShardScan) -> None:
    """Write `scan` to `path` atomically (a crash leaves the old file or none, never half a file)."""
    meta = dict(scan.rows.schema.metadata or {})
    meta[_K_VERSION] = _VERSION
    meta[_K_SKIPPED] = b"1" if scan.skipped else b"0"
    meta[_K_ERRORS] = json.dumps([[r, m] for r, m in scan.errors]).encode()
    meta[_K_CHECKSUM] = CHECKSUM.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(scan.rows.replace_schema_metadata(meta), str(tmp), compression="zstd")
    os.replace(tmp, path)


def load_scan(path: Path) -> ShardScan | None:
    """The cached scan at `path`, or None when it is missing, unreadable, of another version or checksum."""
    if not path.is_file():
        return None
    try:
        table = pq.read_table(str(path))
        meta = table.schema.metadata or {}
        if meta.get(_K_VERSION) != _VERSION or meta.get(_K_CHECKSUM) != CHECKSUM.encode():
            return None
        if any(c not in table.column_names for c in SCAN_COLUMNS):
            return None
        errors = [(None if r is None else int(r), str(m)) for r, m in json.loads(meta[_K_ERRORS])]
        skipped = meta.get(_K_SKIPPED) == b"1"
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError):
        return None
    kept = {k: meta[k] for k in (_K_DTYPE, _K_LAYOUT) if k in meta} or None
    return ShardScan(rows=table.replace_schema_metadata(kept), errors=errors, skipped=skipped)
