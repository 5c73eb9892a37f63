"""Fingerprints: of one shard's content, of a source's scan config, of a whole index; the scan-cache key.

Identity comes from content, never from where a file is or when it was written, so the same data
indexed in two folders (a cluster mounting it elsewhere, a moved copy) has the same index fingerprint
and so the same plan ids:
- a shard's `fingerprint` hashes its size and its first/last 64 KiB (both files of a Megatron pair);
- the scan config hashes every spec setting that changes scan output (format, fields, metadata,
  on_error, the tokenizer's kind and the bytes of its tokenizer.json, the image rule), no path;
- the index fingerprint hashes the scan config, the ordered shard fingerprints and the index's own
  columns (so a rescan that finds other lengths changes it, whatever the edges of the file).
Change detection is another matter: the scan cache is keyed by `cache_key`, which adds the shard's
path, size and mtime to its fingerprint, so a rewritten file is rescanned even where its edges match.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import SourceFormat, SourceSpec, Spec, TokenizerKind

__all__ = [
    "ShardStat",
    "cache_key",
    "fingerprint_file",
    "index_fingerprint",
    "samples_content_hash",
    "scan_config_hash",
    "stat_shard",
]

_EDGE_BYTES = 64 * 1024
SCAN_VERSION = 1
_INDEX_COLUMNS = ("sample", "shard", "row", "num_tokens", "num_image_tokens")
"""Bump when scan output of the same files and config changes (invalidates every cached part)."""


@dataclass(frozen=True, slots=True)
class ShardStat:
    """One shard as found on disk: path, total size, newest mtime and content fingerprint."""

    path: Path
    size_bytes: int
    mtime_ns: int
    fingerprint: str


def _files_of(path: Path, fmt: SourceFormat) -> list[Path]:
    """The files a shard consists of (a Megatron prefix is its .idx and .bin)."""
    if fmt is SourceFormat.MEGATRON:
        return [Path(f"{path}.idx"), Path(f"{path}.bin")]
    return [path]


def _hash_file(h: hashlib._Hash, path: Path) -> tuple[int, int]:
    """Feed `path`'s size and first/last 64 KiB into `h` (content only); return (size, mtime_ns)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = f.read(_EDGE_BYTES)
            if st.st_size > _EDGE_BYTES:
                f.seek(max(st.st_size - _EDGE_BYTES, _EDGE_BYTES))
                tail = f.read(_EDGE_BYTES)
            else:
                tail = b""
    except OSError as e:
        raise SourceDataError(str(path), f"cannot read the file ({e.strerror or e})") from None
    h.update(f"{st.st_size}\0".encode())
    h.update(head)
    h.update(b"\0")
    h.update(tail)
    return int(st.st_size), int(st.st_mtime_ns)


def stat_shard(path: Path, fmt: SourceFormat = SourceFormat.PARQUET) -> ShardStat:
    """Size, mtime and fingerprint of one shard (raises SourceDataError when it cannot be read)."""
    h = hashlib.sha256()
    size, mtime = 0, 0
    for f in _files_of(path, fmt):
        s, m = _hash_file(h, f)
        size += s
        mtime = max(mtime, m)
    return ShardStat(path=path, size_bytes=size, mtime_ns=mtime, fingerprint=h.hexdigest()[:32])


def fingerprint_file(path: str | Path, fmt: SourceFormat = SourceFormat.PARQUET) -> str:
    """The content fingerprint of one shard: changes with its size or first/last 64 KiB, not with path or mtime."""
    return stat_shard(Path(path), fmt).fingerprint


def scan_config_hash(spec: Spec, source: SourceSpec) -> str:
    """A hash of every spec field that changes `source`'s scan output."""
    config: dict[str, object] = {
        "scan_version": SCAN_VERSION,
        "format": source.format.value,
        "tokens_field": source.tokens_field,
        "text_field": source.text_field,
        "image_field": list(source.image_field),
        "metadata": list(source.metadata),
        "on_error": source.on_error.value,
    }
    if source.text_field is not None:  # only raw text is tokenized during the scan
        tok = spec.tokenizer
        config["tokenizer"] = tok.kind.value
        if tok.kind is TokenizerKind.HUGGINGFACE and tok.path is not None:
            config["tokenizer_file"] = _file_sha256(tok.path)
    if source.format is SourceFormat.WEBDATASET:
        config["images"] = spec.images.model_dump(mode="json")
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:32]


def _file_sha256(path: Path) -> str:
    """sha256 of a whole (small) file such as tokenizer.json; "missing" when it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:32]
    except OSError:
        return "missing"  # the spec check reports a missing tokenizer; the hash only has to differ


def cache_key(stat: ShardStat, config_hash: str) -> str:
    """Name of a shard's cached scan result: its content fingerprint, path, size and mtime under one config.

    Path and mtime take part here (not in the fingerprint) so that a file rewritten in its middle, which
    the edge bytes do not see, is rescanned rather than served from the cache.
    """
    key = f"{stat.fingerprint}:{stat.path}:{stat.size_bytes}:{stat.mtime_ns}:{config_hash}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def samples_content_hash(samples: pa.Table) -> str:
    """Hash of an index table's own columns (sample, shard, row, num_tokens, num_image_tokens)."""
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
