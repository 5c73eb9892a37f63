"""Cached scan results, one Parquet file per shard under `index/<source>/_parts/<key>.parquet`.

A cached file holds the shard's scan rows (`row, num_tokens, num_image_tokens, checksum`, metadata columns)
and, in its key-value metadata, whether the whole shard was skipped and the skipped samples. An
unreadable or foreign cache file counts as a miss (the shard is scanned again), never as an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["ShardScan", "load_scan", "parts_dir", "store_scan"]

_VERSION = b"2"
_K_VERSION = b"loomdata.scan_cache"
_K_SKIPPED = b"loomdata.skipped"
_K_ERRORS = b"loomdata.errors"

SCAN_COLUMNS = ("row", "num_tokens", "num_image_tokens", "checksum")


@dataclass(frozen=True, slots=True)
class ShardScan:
    """The scan of one whole shard: its rows, its skipped samples, and whether it was skipped whole."""

    rows: pa.Table
    errors: list[tuple[int | None, str]] = field(default_factory=list)
    skipped: bool = False


def parts_dir(root: Path) -> Path:
    """Folder of a source's cached per-shard scans."""
    return root / "_parts"


def store_scan(path: Path, scan: ShardScan) -> None:
    """Write `scan` to `path` atomically (a crash leaves the old file or none, never half a file)."""
    meta = dict(scan.rows.schema.metadata or {})
    meta[_K_VERSION] = _VERSION
    meta[_K_SKIPPED] = b"1" if scan.skipped else b"0"
    meta[_K_ERRORS] = json.dumps([[r, m] for r, m in scan.errors]).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(scan.rows.replace_schema_metadata(meta), str(tmp), compression="zstd")
    os.replace(tmp, path)


def load_scan(path: Path) -> ShardScan | None:
    """The cached scan at `path`, or None when it is missing, unreadable or of another version."""
    if not path.is_file():
        return None
    try:
        table = pq.read_table(str(path))
        meta = table.schema.metadata or {}
        if meta.get(_K_VERSION) != _VERSION or any(c not in table.column_names for c in SCAN_COLUMNS):
            return None
        errors = [(None if r is None else int(r), str(m)) for r, m in json.loads(meta[_K_ERRORS])]
        skipped = meta.get(_K_SKIPPED) == b"1"
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError):
        return None
    return ShardScan(rows=table.replace_schema_metadata(None), errors=errors, skipped=skipped)
