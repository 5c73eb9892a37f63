"""Fingerprints: of one shard (stats + head/tail bytes), of a source's scan config, of a whole index.

A shard's fingerprint changes when its path, size, mtime or first/last 64 KiB do; a Megatron prefix
hashes both its .idx and .bin. The scan config holds every spec field that changes scan output, so
a new tokenizer or metadata list rescans. The index fingerprint hashes the ordered shard fingerprints
and the scan config, so it changes whenever the index content does.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import SourceFormat, SourceSpec, Spec, TokenizerKind

__all__ = ["ShardStat", "cache_key", "fingerprint_file", "index_fingerprint", "scan_config_hash", "stat_shard"]

_EDGE_BYTES = 64 * 1024
SCAN_VERSION = 1
"""Bump when scan output of the same files and config changes (invalidates every cached part)."""


@dataclass(frozen=True, slots=True)
class ShardStat:
    """One shard as found on disk: path, total size, newest mtime and fingerprint."""

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
    """Feed `path`'s name, size, mtime and first/last 64 KiB into `h`; return (size, mtime_ns)."""
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
    h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
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
    """The fingerprint of one shard: changes with its path, size, mtime or first/last 64 KiB."""
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
        config["tokenizer"] = tok.model_dump(mode="json")
        if tok.kind is TokenizerKind.HUGGINGFACE and tok.path is not None and tok.path.is_file():
            config["tokenizer_file"] = fingerprint_file(tok.path)
    if source.format is SourceFormat.WEBDATASET:
        config["images"] = spec.images.model_dump(mode="json")
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:32]


def cache_key(shard_fingerprint: str, config_hash: str) -> str:
    """Name of a shard's cached scan result: its fingerprint under one scan config."""
    return hashlib.sha256(f"{shard_fingerprint}:{config_hash}".encode()).hexdigest()[:32]


def index_fingerprint(config_hash: str, shard_fingerprints: list[str]) -> str:
    """The content fingerprint of a source's index: scan config plus ordered shard fingerprints."""
    h = hashlib.sha256(config_hash.encode())
    for fp in shard_fingerprints:
        h.update(b"\0" + fp.encode())
    return h.hexdigest()[:16]
