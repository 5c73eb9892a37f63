"""Locations: a plain path stays a `Path` (the local fast path), a URL stays its string.

`Path("s3://b/k")` would fold the `//`, so a URL is never turned into a `Path`; `file://` URLs become
plain paths. Every reader, stat and glob takes a `Location` and asks `is_url` which way to go.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import TypeAlias

__all__ = ["REMOTE_PROTOCOLS", "Location", "is_url", "location", "protocol_of", "suffix_of"]

Location: TypeAlias = Path | str
"""A local file (`Path`) or an object URL (`str`, `s3://bucket/key`)."""

REMOTE_PROTOCOLS = ("s3", "gs", "gcs", "http", "https")
"""Protocols read through fsspec (s3fs, gcsfs, fsspec's HTTP filesystem)."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def protocol_of(loc: str | Path) -> str:
    """The URL scheme of `loc` (`s3`, `gs`, ...), or `file` for a plain path."""
    if isinstance(loc, Path):
        return "file"
    m = _SCHEME.match(loc)
    return m.group(1).lower() if m else "file"


def is_url(loc: str | Path) -> bool:
    """Whether `loc` names a remote object (anything but a plain path or a `file://` URL)."""
    return protocol_of(loc) != "file"


def location(loc: str | Path) -> Location:
    """The `Location` of a path, a `file://` URL or an object URL (ValueError for an unknown scheme)."""
    if isinstance(loc, Path):
        return loc
    proto = protocol_of(loc)
    if proto == "file":
        return Path(loc[len("file://") :]) if loc.startswith("file://") else Path(loc)
    if proto not in REMOTE_PROTOCOLS:
        raise ValueError(
            f"unsupported URL scheme {proto!r} in {loc!r} (supported: file, {', '.join(REMOTE_PROTOCOLS)})"
        )
    return loc


def suffix_of(loc: Location) -> str:
    """The file suffix (`.gz`, `.parquet`) of a path or URL."""
    if isinstance(loc, Path):
        return loc.suffix
    return PurePosixPath(loc.split("?", 1)[0]).suffix
