"""What a shard and its samples were when indexed: file stats with a content fingerprint, per-sample checksums.

The index job records both; Source Loaders recompute them when they open a shard and read a sample
(`verify: sample | shard | off`), so a file changed after indexing fails the step instead of serving
other tokens.

Checksum: CRC-32 (`zlib.crc32`) of the sample's full token stream as little-endian int32 bytes (image
placeholder tokens first, exactly what `FormatReader.read` returns), stored as uint32. Why this hash:
xxhash is not installed here, and `zlib.crc32` is the fastest hash the standard library has (about
1-2 GB/s of int32 bytes on this machine, i.e. 250-500 M tokens/s; a NumPy multiply-add hash over the
same tokens measured slower). One implementation, `checksums_flat`, serves the scan and the loaders'
verification: int32 buffers are hashed in place, any other dtype (text bytes, a uint16 .bin) is cast
in cache-sized blocks, and the per-sample calls run as a C-level `map` over slices. Hashing the int32
stream is the cost floor: 4 bytes a token, however narrow the source stores them. 32 bits suffice to
detect change (a changed sample passes unnoticed with probability 2**-32), not to resist an adversary;
the token count, checked too, catches every change of length.

A shard's `fingerprint` hashes its size and first/last 64 KiB (both files of a Megatron pair); it
is content, never path or time. `ctime_ns` (the inode change time, which no user tool can set back)
serves change detection only. An object (a URL) is hashed the same way through two range reads, so a
copy in a bucket has the fingerprint of the local file; its `version` (ETag or version id) takes the
place of the times for change detection: `mtime_ns` holds `version_stamp(version)` (a CRC-32 of it), so
the loaders' open check, which compares size, mtime and fingerprint, compares the ETag too.
"""

from __future__ import annotations

import hashlib
import operator
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import SourceFormat
from loomdata.storage import Location, StorageOptions, identity, is_url, read_range

__all__ = [
    "CHECKSUM",
    "ShardStat",
    "checksums",
    "checksums_flat",
    "files_of",
    "prefixed_checksums",
    "stat_shard",
    "version_stamp",
]

CHECKSUM = "crc32-int32le"
"""Name of the per-sample checksum definition; change it with the definition (not yet recorded in the index)."""

_EDGE_BYTES = 64 * 1024
_LE_INT32 = np.dtype("<i4")
_BLOCK_TOKENS = 1 << 18  # tokens cast to int32 at once (1 MiB: the cast and the hash stay in L2)


@dataclass(frozen=True, slots=True)
class ShardStat:
    """One shard as found: path or URL, total size, newest mtime and ctime, content fingerprint, object version."""

    path: Location
    size_bytes: int
    mtime_ns: int
    fingerprint: str
    ctime_ns: int = 0
    version: str = ""  # objects: the ETag/version id of each file, joined; "" for local files


def version_stamp(version: str) -> int:
    """What an object's `mtime_ns` holds: a CRC-32 of its ETag/version (0 for none), changed by every rewrite."""
    return zlib.crc32(version.encode()) if version else 0


def files_of(path: Location, fmt: SourceFormat) -> list[Location]:
    """The files a shard consists of (a Megatron prefix is its .idx and .bin)."""
    if fmt is SourceFormat.MEGATRON:
        if is_url(path):
            return [f"{path}.idx", f"{path}.bin"]
        return [Path(f"{path}.idx"), Path(f"{path}.bin")]
    return [path]


def _hash_object(h: hashlib._Hash, url: str, options: StorageOptions | None) -> tuple[int, str]:
    """Feed an object's size and first/last 64 KiB into `h` (two range reads); return its size and version."""
    ident = identity(url, options)
    size = ident.size
    head = read_range(url, 0, min(size, _EDGE_BYTES), options)
    tail = read_range(url, max(size - _EDGE_BYTES, _EDGE_BYTES), size, options) if size > _EDGE_BYTES else b""
    h.update(f"{size}\0".encode())
    h.update(head)
    h.update(b"\0")
    h.update(tail)
    return size, ident.version


def _hash_file(h: hashlib._Hash, path: Location) -> os.stat_result:
    """Feed `path`'s size and first/last 64 KiB into `h` (content only); return its stat."""
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
    return st


def stat_shard(
    path: Location, fmt: SourceFormat = SourceFormat.PARQUET, options: StorageOptions | None = None
) -> ShardStat:
    """Size, mtime, ctime and fingerprint of one shard (raises SourceDataError when it cannot be read)."""
    h = hashlib.sha256()
    if is_url(path):
        total, versions = 0, []
        for url in files_of(path, fmt):
            n, v = _hash_object(h, str(url), options)
            total += n
            versions.append(v)
        version = ",".join(versions)
        return ShardStat(path, total, version_stamp(version), h.hexdigest()[:32], version=version)
    size, mtime, ctime = 0, 0, 0
    for f in files_of(path, fmt):
        st = _hash_file(h, f)
        size += int(st.st_size)
        mtime = max(mtime, int(st.st_mtime_ns))
        ctime = max(ctime, int(st.st_ctime_ns))
    return ShardStat(path=path, size_bytes=size, mtime_ns=mtime, fingerprint=h.hexdigest()[:32], ctime_ns=ctime)


def _crc_slices(buf: memoryview, bounds: list[int], start: list[int] | None = None) -> Iterator[int]:
    """CRC-32 of `buf[bounds[i]:bounds[i+1]]` for each i, continuing from `start[i]` when given.

    The iteration runs in C (`map` over slices): no Python frame per sample, only the zlib call.
    """
    pieces = map(buf.__getitem__, map(slice, bounds[:-1], bounds[1:]))
    return map(zlib.crc32, pieces) if start is None else map(zlib.crc32, pieces, start)


def checksums(token_arrays: Sequence[np.ndarray]) -> np.ndarray:
    """uint32 checksum of each token array (one sample's full token stream each)."""
    if not token_arrays:
        return np.zeros(0, dtype=np.uint32)
    if all(t.dtype == _LE_INT32 and t.flags.c_contiguous for t in token_arrays):  # readers return these
        buffers = map(operator.attrgetter("data"), token_arrays)  # hashed in place
        return np.fromiter(map(zlib.crc32, buffers), np.uint32, len(token_arrays))
    return checksums_flat(np.concatenate(token_arrays), _offsets_of(token_arrays))


def checksums_flat(flat: np.ndarray, offsets: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """Checksums of samples stored end to end: sample i is `flat[offsets[i]:offsets[i+1]]`.

    `flat` may hold token ids of any integer dtype (a uint8 text buffer, a uint16 Megatron memory map):
    int32 little-endian is hashed in place; any other dtype is cast to int32 in blocks of `_BLOCK_TOKENS`
    that stay in cache between the cast and the hash (no full-size int32 copy written and read back).
    `start` (uint32 per sample) continues each CRC from a value, the CRC of a prefix hashed before.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint32)
    init = start.astype(np.int64).tolist() if start is not None else None
    if flat.dtype == _LE_INT32 and flat.flags.c_contiguous:
        buf = flat.data.cast("B")
        return np.fromiter(_crc_slices(buf, (offsets * 4).tolist(), init), np.uint32, n)
    return _checksums_cast(flat, offsets, init if init is not None else [0] * n)


def _checksums_cast(flat: np.ndarray, offsets: np.ndarray, init: list[int]) -> np.ndarray:
    """`checksums_flat` of a `flat` that is not int32 LE: cast block by block into one reused int32 buffer.

    A block holds whole samples; a sample longer than a block is cast and hashed in pieces, its CRC
    carried from piece to piece (`zlib.crc32(piece, crc)`), which equals one call on the whole.
    """
    n = len(offsets) - 1
    out = np.empty(n, dtype=np.uint32)
    block = np.empty(_BLOCK_TOKENS, dtype=_LE_INT32)
    mv = block.data.cast("B")
    ends = offsets[1:]
    a = 0
    while a < n:
        lo = int(offsets[a])
        b = int(np.searchsorted(ends, lo + _BLOCK_TOKENS, side="right"))
        if b > a:  # samples a..b-1 fit in one block
            hi = int(offsets[b])
            np.copyto(block[: hi - lo], flat[lo:hi], casting="unsafe")
            bounds = ((offsets[a : b + 1] - lo) * 4).tolist()
            out[a:b] = np.fromiter(_crc_slices(mv, bounds, init[a:b]), np.uint32, b - a)
            a = b
            continue
        crc, hi = init[a], int(offsets[a + 1])  # one sample longer than a block
        for s in range(lo, hi, _BLOCK_TOKENS):
            e = min(s + _BLOCK_TOKENS, hi)
            np.copyto(block[: e - s], flat[s:e], casting="unsafe")
            crc = zlib.crc32(mv[: 4 * (e - s)], crc)
        out[a] = crc
        a += 1
    return out


def _offsets_of(token_arrays: Sequence[np.ndarray]) -> np.ndarray:
    lengths = np.fromiter(map(len, token_arrays), dtype=np.int64, count=len(token_arrays))
    return np.concatenate([[0], np.cumsum(lengths)])


def prefixed_checksums(prefix_token: int, prefix_lengths: np.ndarray, token_arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Checksums of streams made of `prefix_lengths[i]` copies of `prefix_token`, then `token_arrays[i]`.

    The image placeholders of a multimodal sample come first; this hashes them without building the stream.
    """
    n = len(token_arrays)
    if n == 0:
        return np.zeros(0, dtype=np.uint32)
    k = (np.asarray(prefix_lengths, dtype=np.int64) * 4).tolist()
    pad = np.full(max(k) // 4, prefix_token, dtype=_LE_INT32).data.cast("B")
    heads = np.fromiter(map(zlib.crc32, map(pad.__getitem__, map(slice, k))), np.uint32, n)
    return checksums_flat(np.concatenate(token_arrays), _offsets_of(token_arrays), start=heads)
