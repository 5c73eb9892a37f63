"""Fingerprints: of one shard's content, of a source's scan config, of a whole index; the scan-cache key.

Identity comes from content, never from where a file is or when it was written, so the same data
indexed in two folders (a cluster mounting it elsewhere, a moved copy) has the same index fingerprint
and so the same plan ids:
- a shard's `fingerprint` hashes its size and its first/last 64 KiB (both files of a Megatron pair);
- the scan config hashes every spec setting that changes scan output (format, fields, metadata,
  on_error, the tokenizer's kind and the bytes of its tokenizer.json, the image rule), no path;
- the index fingerprint hashes the scan config, the ordered shard fingerprints and the index's own
  columns, the per-sample checksums included (so a rescan that finds other tokens changes it,
  whatever the edges of the file, and a copy elsewhere keeps it).
Change detection is another matter: the scan cache is keyed by `cache_key`, which adds the shard's
path, size, mtime and ctime to its fingerprint, so a rewritten file is rescanned even where its edges
match, and even when the rewrite kept size and mtime (`cp -p`, `rsync -t`, `os.utime`): the inode
change time moves with every write and no user tool can set it back.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from loomdata.schemas.freshness import scan_config
from loomdata.schemas.spec import SourceFormat, SourceSpec, Spec
from loomdata.sources._integrity import ShardStat, stat_shard
from loomdata.storage import location

__all__ = [
    "ShardStat",
    "cache_key",
    "fingerprint_file",
    "index_fingerprint",
    "samples_content_hash",
    "scan_config_hash",
    "stat_shard",
]

SCAN_VERSION = 2
"""Bump when scan output of the same files and config changes (invalidates every cached part)."""
_INDEX_COLUMNS = ("sample", "shard", "row", "num_tokens", "num_image_tokens", "checksum")


def fingerprint_file(path: str | Path, fmt: SourceFormat = SourceFormat.PARQUET) -> str:
    """The content fingerprint of one shard: changes with its size or first/last 64 KiB, not with path or mtime."""
    return stat_shard(location(path), fmt).fingerprint


def scan_config_hash(spec: Spec, source: SourceSpec) -> str:
    """A hash of every spec field that changes `source`'s scan output (schemas.freshness.scan_config)."""
    config = {"scan_version": SCAN_VERSION, **scan_config(spec, source)}
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:32]


def cache_key(stat: ShardStat, config_hash: str) -> str:
    """Name of a shard's cached scan result: its content fingerprint, path, size, mtime and ctime under one config.

    Path and times take part here (not in the fingerprint) so that a file rewritten in its middle, which
    the edge bytes do not see, is rescanned rather than served from the cache; ctime catches a rewrite
    whose size and mtime were put back.
    """
    key = f"{stat.fingerprint}:{stat.path}:{stat.size_bytes}:{stat.mtime_ns}:{stat.ctime_ns}:{config_hash}"
    if stat.version:  # objects only: local keys stay as they were (existing caches stay valid)
        key += f":{stat.version}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def samples_content_hash(samples: pa.Table) -> str:
    """Hash of an index table's own columns (sample, shard, row, num_tokens, num_image_tokens, checksum)."""
    h = hashlib.blake2b(digest_size=16)
    for name in _INDEX_COLUMNS:
        col = samples.column(name)
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        h.update(name.encode() + b"\0")
        h.update(np.ascontiguousarray(arr.to_numpy(zero_copy_only=False)).tobytes())
    return h.hexdigest()


def index_fingerprint(config_hash: str, shard_fingerprints: list[str], samples_hash: str = "") -> str:
    """The content fingerprint of a source's index: scan config, ordered shard fingerprints, its columns' hash."""
    h = hashlib.sha256(config_hash.encode())
    for fp in shard_fingerprints:
        h.update(b"\0" + fp.encode())
    h.update(b"\1" + samples_hash.encode())
    return h.hexdigest()[:16]
