"""What a shard and its samples were when indexed: file stats with a content fingerprint, per-sample checksums.

The index job records both; Source Loaders recompute them when they open a shard and read a sample
(`verify: sample | shard | off`), so a file changed after indexing fails the step instead of serving
other tokens.

Checksum (`CHECKSUM`, recorded in the index and checked by the loaders): the low 32 bits of XXH3-64
(seed 0) of the sample's token ids as the shard stores them, little-endian, in the shard's *checksum
dtype* (`FormatReader.checksum_dtype`): a Megatron pair's `.bin` dtype (uint16 mostly), a pre-tokenized
Parquet column's value type (int32 mostly), uint8 for text read with the byte tokenizer (whose tokens
are the UTF-8 bytes: the hash is of the raw text, and the byte count is the token count), int32 for
text tokenized by Hugging Face and for WebDataset (image placeholder tokens first, exactly the stream
`FormatReader.read` returns). Why: the scan hashes the bytes it already holds, in place, with no cast
and no int32 copy (XXH3 runs at memory speed, ~11 GB/s here against zlib CRC-32's ~3.5 GB/s, and a
uint16 `.bin` is half the bytes of its int32 stream); the loaders cast the int32 tokens they read back
to the dtype of the shard they read (exact: the values came from that dtype) and hash with the same
`checksums_flat`, the one implementation. The dtype is a property of the stored shard (the `.idx`
header, the Parquet schema, the tokenizer kind), covered by the shard's fingerprint and recorded in the
index (samples.parquet metadata `checksum_dtype`; loaders take it from what they read): a shard
rewritten in another dtype hashes other bytes and fails as changed, which it is. 32 bits suffice to
detect change (a changed sample of the same length passes with probability 2**-32; XXH3 hashes the
length too), not to resist an adversary. What is left is the per-sample call (~0.3 us: a slice and a
hash call, run as a C-level `map`): the floor for sources of many short samples.

A shard's `fingerprint` hashes its size and first/last 64 KiB (both files of a Megatron pair); it
is content, never path or time. `ctime_ns` (the inode change time, which no user tool can set back)
serves change detection only. An object (a URL) is hashed the same way through two range reads (run
together, and beside its HEAD where the indexed size is known: a loader's check is one round trip; on S3
the first range GET's response gives the size and ETag/version, so that check sends no HEAD; since session 23 a
loader's check of a one-object S3 shard first asks one request, whose size and ETag/version equal to the indexed
ones accept it with no edge read: `unchanged_object`; since session 24 that request is the HEAD that opens the
object's pyarrow read handle where its reads take one (`head_checked`), else a 1-byte GET), so a
copy in a bucket has the fingerprint of the local file; its `version` (ETag or version id) takes the
place of the times for change detection: `mtime_ns` holds `version_stamp(version)` (a CRC-32 of it), so
the loaders' open check, which compares size, mtime and fingerprint, compares the ETag too.
"""

from __future__ import annotations

import hashlib
import operator
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.records import SourceFormat
from loomdata.storage import (
    AccessDeniedError,
    Location,
    ObjectNotFoundError,
    RetryPolicy,
    StorageError,
    StorageOptions,
    TransientStorageError,
    handle_opened,
    head_identity,
    identity,
    is_url,
    protocol_of,
    read_range,
    read_range_identity,
)

__all__ = [
    "CHECKSUM",
    "TOKEN_DTYPE",
    "ShardStat",
    "checksums",
    "checksums_flat",
    "files_of",
    "head_checked",
    "prefixed_checksums",
    "span_checksums",
    "stat_shard",
    "unchanged_object",
    "version_stamp",
]

CHECKSUM = "xxh3_64-low32-stored-le/1"
"""Name of the per-sample checksum definition, recorded in the index (samples.parquet metadata `checksum`) and
in every cached scan; loaders refuse an index with another (or none). Change it with the definition."""

TOKEN_DTYPE = np.dtype("<i4")
"""The dtype of `Sample.tokens`, and the checksum dtype of sources that store no narrower ids."""

_EDGE_BYTES = 64 * 1024
_MASK32 = np.uint64(0xFFFFFFFF)
_xxh3 = xxhash.xxh3_64_intdigest


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


_EDGE_THREADS = 8
_EDGE_POOL: list[ThreadPoolExecutor] = []  # made on first use (a local-only process never starts its threads)
_EDGE_LOCK = threading.Lock()


def _edge_pool() -> ThreadPoolExecutor:
    """The process's threads for an object's concurrent edge reads (its own: callers run on the read-ahead threads)."""
    with _EDGE_LOCK:
        if not _EDGE_POOL:
            _EDGE_POOL.append(ThreadPoolExecutor(_EDGE_THREADS, thread_name_prefix="loom-edges"))
        return _EDGE_POOL[0]


def _edges(url: str, size: int, options: StorageOptions | None) -> list[Future[bytes]]:
    """The first and last 64 KiB of an object of `size` bytes, read concurrently (the tail empty when it is small)."""
    pool = _edge_pool()
    head = pool.submit(read_range, url, 0, min(size, _EDGE_BYTES), options)
    if size <= _EDGE_BYTES:
        tail: Future[bytes] = Future()
        tail.set_result(b"")
        return [head, tail]
    return [head, pool.submit(read_range, url, max(size - _EDGE_BYTES, _EDGE_BYTES), size, options)]


def _hash_object(h: hashlib._Hash, url: str, options: StorageOptions | None, known: int | None) -> tuple[int, str]:
    """Feed an object's size and first/last 64 KiB into `h`; return its size and version.

    The two edge reads run together; given the size the index recorded (`known`), alongside the HEAD too (one
    round trip, not two), and on S3 the first edge's GET answers for the HEAD (`read_range_identity`: size and
    ETag/version from its response, one request fewer per object). An object whose size is not `known` now has its
    edges read again at its real size.
    """
    if known is not None and known > 0 and protocol_of(url) == "s3":
        got = _edges_with_identity(url, known, options)
        if got is not None:
            return _feed(h, *got[0]), got[1]
    early = _edges(url, known, options) if known is not None else None
    try:
        ident = identity(url, options)
    finally:
        if early is not None and not all(f.done() for f in early):
            wait_for(early)
    if early is not None and ident.size == known:
        head, tail_bytes = (f.result() for f in early)
    else:
        head, tail_bytes = (f.result() for f in _edges(url, ident.size, options))
    return _feed(h, ident.size, head, tail_bytes), ident.version


def _edges_with_identity(
    url: str, known: int, options: StorageOptions | None
) -> tuple[tuple[int, bytes, bytes], str] | None:
    """An S3 object's (size, first, last 64 KiB) and version from its two edge GETs alone, read at the indexed
    size `known` (the first GET's response stands for the HEAD). None: take the HEAD path (no s3fs here, or the
    first GET failed other than "missing", "denied" or "retries ran out", as a read of an object now empty does: the
    HEAD path reports it as it always has). At another size now, the edges are read again at it."""
    pool = _edge_pool()
    first = pool.submit(read_range_identity, url, 0, min(known, _EDGE_BYTES), options)
    tail = (
        pool.submit(read_range, url, max(known - _EDGE_BYTES, _EDGE_BYTES), known, options)
        if known > _EDGE_BYTES
        else None
    )
    try:
        got = first.result()
    except (ObjectNotFoundError, AccessDeniedError, TransientStorageError):
        raise
    except StorageError:
        return None
    finally:
        if tail is not None and not tail.done():
            wait_for([tail])
    if got is None:
        return None
    head, ident = got
    if ident.size == known and len(head) == min(known, _EDGE_BYTES):
        return (known, head, b"" if tail is None else tail.result()), ident.version
    head, last = (f.result() for f in _edges(url, ident.size, options))
    return (ident.size, head, last), ident.version


def _feed(h: hashlib._Hash, size: int, head: bytes, tail: bytes) -> int:
    """Feed a shard file's size and edges into its fingerprint hash `h` (the one layout for files and objects)."""
    h.update(f"{size}\0".encode())
    h.update(head)
    h.update(b"\0")
    h.update(tail)
    return size


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
    _feed(h, st.st_size, head, tail)
    return st


def stat_shard(
    path: Location,
    fmt: SourceFormat = SourceFormat.PARQUET,
    options: StorageOptions | None = None,
    size: int | None = None,
) -> ShardStat:
    """Size, mtime, ctime and fingerprint of one shard (raises SourceDataError when it cannot be read).

    `size`: the shard's size as indexed, where known (a loader's check): a one-object shard's edge reads then
    run alongside its HEAD. The result is the same with or without it.
    """
    h = hashlib.sha256()
    if is_url(path):
        total, versions = 0, []
        urls = files_of(path, fmt)
        for url in urls:
            n, v = _hash_object(h, str(url), options, size if len(urls) == 1 else None)
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


_ONCE = RetryPolicy(attempts=1)
"""The shard check's HEAD is not retried by loomdata (pyarrow's own S3 retry strategy still retries it inside the one
attempt): the 1-byte GET after a failed one retries, and names the error as before."""


def _one_object(path: Location, fmt: SourceFormat, size: int, stamp: int, version: str | None) -> bool:
    """Whether `unchanged_object` can tell a shard from one response: a one-object S3 shard whose size, stamp and
    ETag/version string the index recorded (else it answers False at once, sending nothing)."""
    if not version or not is_url(path) or protocol_of(str(path)) != "s3" or not stamp or size <= 0:
        return False
    return len(files_of(path, fmt)) == 1


def head_checked(
    path: Location, fmt: SourceFormat, options: StorageOptions | None, size: int, stamp: int, version: str | None
) -> bool:
    """Whether `unchanged_object` checks this shard from the HEAD that opens its pyarrow read handle (`head_identity`),
    so a loader need not open that handle beside the check (`Verifier.opens_handle`). The same conditions as the
    check's own, so a shard it will not HEAD is never left without its handle opened ahead."""
    return _one_object(path, fmt, size, stamp, version) and handle_opened(str(path), size, options)


def unchanged_object(
    path: Location, fmt: SourceFormat, options: StorageOptions | None, size: int, stamp: int, version: str | None
) -> bool:
    """Whether a one-object S3 shard still has the size and ETag/version (`stamp`: `version_stamp`) it was indexed
    with, from one request's response (see below): no edge reads.

    The identity comes from the HEAD that opens the object's pyarrow read handle (`head_identity`, kept for the
    reads: checking and opening a shard is one request, session 24); where that HEAD does not name the version the
    index recorded (a versioned bucket's id, or no pyarrow S3), from the 1-byte GET's response.

    An S3 ETag changes with every write that changes the content (a single-part upload's is its MD5 without SSE-KMS;
    a multipart or SSE-KMS upload's is opaque, and new on each upload), and where the bucket keeps versions the version
    id names one write: an equal one and size are taken for the indexed object, whose content fingerprint is not read.
    The same bytes written again keep their ETag only as a single-part upload without SSE-KMS to an unversioned
    bucket (accepted then: the same content); otherwise they differ here and the full check below compares content.
    The answer's ETag/version is compared whole with `version`, the string the index recorded for this object (its
    `_objects.json` memo), and its CRC-32 with `stamp` (shards.parquet's): a same-size rewrite is never taken for the
    indexed object on a stamp that collides. False (the caller hashes the edges: `stat_shard`, whose differences it
    reports) where that cannot tell: not S3, several files, no version, stamp or size recorded (an index without the
    memo), the GET failed other than "missing", "denied" or "retries ran out" (those raise), or the object differs.
    """
    url = str(path)
    if not _one_object(path, fmt, size, stamp, version):
        return False
    # the HEAD that opens its read handle: no request of the check's own. Any error, any difference (a HEAD may not
    # name the version): the 1-byte GET asks, and reports what it meets
    try:
        head = head_identity(url, size, options, _ONCE)
    except StorageError:
        head = None
    try:
        if head is None or head.size != size or head.version != version:
            got = read_range_identity(url, 0, 1, options)
            head = None if got is None else got[1]
    except (ObjectNotFoundError, AccessDeniedError, TransientStorageError):
        raise
    except StorageError:
        return False
    if head is None or head.size != size or head.version != version:
        return False
    return version_stamp(head.version) == stamp


def _low32(digests: Iterator[int], n: int) -> np.ndarray:
    """uint32 low halves of `n` 64-bit digests."""
    return (np.fromiter(digests, np.uint64, n) & _MASK32).astype(np.uint32)


def _le(dtype: np.dtype) -> np.dtype:
    """`dtype` in little-endian byte order (single-byte dtypes unchanged)."""
    little = dtype.byteorder in "<|" or (dtype.byteorder == "=" and np.little_endian)
    return dtype if little else dtype.newbyteorder("<")


def checksums_flat(flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Checksums of samples stored end to end: sample i is `flat[offsets[i]:offsets[i+1]]`, hashed in `flat`'s dtype.

    The one implementation of the definition: the scan passes the ids as stored (a uint16 `.bin` slice, a
    Parquet values buffer, the UTF-8 bytes of a text column), hashed in place; verification passes what it
    read cast to the shard's checksum dtype. A big-endian or strided `flat` is copied little-endian first.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint32)
    dtype = _le(flat.dtype)
    if flat.dtype != dtype or not flat.flags.c_contiguous:
        flat = np.ascontiguousarray(flat, dtype=dtype)
    buf = flat.data.cast("B") if flat.size else memoryview(b"")
    bounds = (offsets * dtype.itemsize).tolist()
    pieces = map(buf.__getitem__, map(slice, bounds[:-1], bounds[1:]))  # a C-level map: no Python frame per sample
    return _low32(map(_xxh3, pieces), n)


_cut: Callable[[memoryview, slice], memoryview] = operator.getitem  # type: ignore[assignment]
"""`view[s]`, typed for a C-level `map` over many views and slices."""

_cut_array: Callable[[np.ndarray, slice], np.ndarray] = operator.getitem  # type: ignore[assignment]
"""`array[s]`, typed likewise (`span_checksums`' samples widened from another dtype)."""


def span_checksums(
    buffers: Sequence[np.ndarray], buffer: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> np.ndarray:
    """Checksums of token ids lying in several buffers, hashed as int32: sample i is
    `buffers[buffer[i]][start[i]:stop[i]]`.

    Samples in int32 buffers are hashed in place, one C-level map over them: no copy, no Python frame per sample.
    A buffer of another integer type (a loader's unit kept narrow, uint16) has only its samples widened, into one
    int32 copy hashed flat: never the whole buffer.
    """
    n = len(buffer)
    if n == 0:
        return np.zeros(0, dtype=np.uint32)
    native = np.fromiter((b.dtype == TOKEN_DTYPE for b in buffers), dtype=bool, count=len(buffers))
    if native.all():
        return _spans_in_place(buffers, buffer, start, stop)
    got = np.empty(n, dtype=np.uint32)
    is_native = native[buffer]
    here, other = np.flatnonzero(is_native), np.flatnonzero(~is_native)
    if len(here):
        got[here] = _spans_in_place(buffers, buffer[here], start[here], stop[here])
    offsets = np.zeros(len(other) + 1, dtype=np.int64)
    np.cumsum(stop[other] - start[other], out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=TOKEN_DTYPE)
    if len(flat):
        spans: map[np.ndarray] = map(
            _cut_array,
            map(buffers.__getitem__, buffer[other].tolist()),
            map(slice, start[other].tolist(), stop[other].tolist()),
        )
        np.concatenate(list(spans), out=flat)
    got[other] = checksums_flat(flat, offsets)
    return got


def _spans_in_place(
    buffers: Sequence[np.ndarray], buffer: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> np.ndarray:
    """`span_checksums` of samples all in int32 buffers (`buffer` names only those), hashed in place."""
    views = [np.ascontiguousarray(b).data.cast("B") if b.dtype == TOKEN_DTYPE else memoryview(b"") for b in buffers]
    size = TOKEN_DTYPE.itemsize
    pieces: map[memoryview] = map(
        _cut,
        map(views.__getitem__, buffer.tolist()),
        map(slice, (start * size).tolist(), (stop * size).tolist()),
    )
    return _low32(map(_xxh3, pieces), len(buffer))


def checksums(token_arrays: Sequence[np.ndarray], dtype: np.dtype | str = TOKEN_DTYPE) -> np.ndarray:
    """uint32 checksum of each token array (one sample's full token stream each), hashed as `dtype`.

    `dtype` is the checksum dtype of the shard the arrays come from (`FormatReader.checksum_dtype`); int32
    arrays hashed as int32 are hashed in place, anything else is concatenated and cast once.
    """
    if not token_arrays:
        return np.zeros(0, dtype=np.uint32)
    dtype = _le(np.dtype(dtype))
    if all(t.dtype == dtype and t.flags.c_contiguous for t in token_arrays):  # readers return these
        return _low32(map(_xxh3, map(operator.attrgetter("data"), token_arrays)), len(token_arrays))
    flat = np.concatenate(token_arrays) if len(token_arrays) > 1 else token_arrays[0]
    return checksums_flat(flat.astype(dtype, copy=False), _offsets_of(token_arrays))


def _offsets_of(token_arrays: Sequence[np.ndarray]) -> np.ndarray:
    lengths = np.fromiter(map(len, token_arrays), dtype=np.int64, count=len(token_arrays))
    return np.concatenate([[0], np.cumsum(lengths)])


def prefixed_checksums(prefix_token: int, prefix_lengths: np.ndarray, token_arrays: Sequence[np.ndarray]) -> np.ndarray:
    """int32 checksums of streams made of `prefix_lengths[i]` copies of `prefix_token`, then `token_arrays[i]`.

    The image placeholders of a multimodal sample come first: the streams are laid out end to end in one
    int32 buffer (placeholders filled, tokens scattered after them, no per-sample loop) and hashed flat.
    """
    n = len(token_arrays)
    if n == 0:
        return np.zeros(0, dtype=np.uint32)
    k = np.asarray(prefix_lengths, dtype=np.int64)
    tok_offsets = _offsets_of(token_arrays)
    tok_len = np.diff(tok_offsets)
    offsets = np.concatenate([[0], np.cumsum(k + tok_len)])
    flat = np.full(int(offsets[-1]), prefix_token, dtype=TOKEN_DTYPE)
    if tok_offsets[-1]:
        shift = np.repeat(offsets[:-1] + k - tok_offsets[:-1], tok_len)  # where each sample's tokens move to
        flat[np.arange(int(tok_offsets[-1])) + shift] = np.concatenate(token_arrays)
    return checksums_flat(flat, offsets)
