"""Glob, stat and read objects through fsspec; plain paths keep Python's own open/stat.

Every remote read is an explicit range GET (`cat_file(start, end)`; S3 reads of 512 KiB or more through
pyarrow's C++ client, a third of the CPU: `_arrow`) wrapped in `retrying`, so each request is retried
alone on a transient error and counted in `request_stats` (the benchmarks' and tests' source of
requests and bytes). `RangeFile` gives readers a seekable file (pyarrow takes it
for Parquet footers and row groups; tarfile and the JSONL scanner take it too); `ObjectView` an
mmap-like view (`len`, slicing, `find`) for readers written against memory maps.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from loomdata.storage._arrow import (
    ARROW_MIN_READ,
    arrow_filesystem,
    arrow_head,
    arrow_open,
    arrow_read,
    arrow_s3_kwargs,
    drop_handle,
)
from loomdata.storage._errors import ObjectNotFoundError
from loomdata.storage._latency import _LATENCY
from loomdata.storage._options import options_for
from loomdata.storage._retry import DEFAULT_POLICY, RetryPolicy, retrying
from loomdata.storage._shared_gets import SharedGets
from loomdata.storage._url import Location, is_url, protocol_of

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "ObjectIdentity",
    "ObjectView",
    "RangeFile",
    "StorageOptions",
    "cache_dir",
    "exists",
    "fetch_to_cache",
    "glob",
    "identity",
    "open_input",
    "read_range",
    "read_range_identity",
    "request_stats",
    "reset_request_stats",
    "warm_client",
]

StorageOptions = Mapping[str, Mapping[str, Any]]
"""Per-protocol fsspec options, `{"s3": {"endpoint_url": ...}}`."""

_MIN_READ = 256 * 1024  # a RangeFile reads at least this much per request (footers, headers, lines)
_GLOB_CHARS = frozenset("*?[")


class _Stats:
    """Per-process counts of remote requests and bytes (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()


_STATS = _Stats()


def request_stats() -> dict[str, int]:
    """Remote requests of this process so far: `list`, `head`, `get` (range reads), `get_bytes`, `retries`."""
    return _STATS.snapshot()


def reset_request_stats() -> None:
    """Zero `request_stats`."""
    _STATS.reset()


_CONNECT_LOCK = threading.Lock()
_MADE: set[bytes | None] = set()  # the options (`_options_key`) whose s3fs client this process has made


def _forget_after_fork() -> None:
    """In a forked child: no s3fs client made yet (fsspec forgets the parent's), and a `_CONNECT_LOCK` no thread holds
    (a parent thread making a client at the fork is not in the child: its lock would never be released there)."""
    global _CONNECT_LOCK
    _CONNECT_LOCK = threading.Lock()
    _MADE.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_after_fork)


def _client_made(url: str, options: StorageOptions | None) -> bool:
    """Whether this process has made the s3fs client `url` would be read with (checked without making it)."""
    return _options_key(url, options) in _MADE


def _fs(url: str, options: StorageOptions | None) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem of `url`'s protocol; fsspec is imported here, at the first object URL (a process that
    serves local files never loads it: 17 modules, about 1-2 MiB a process)."""
    import fsspec

    proto = protocol_of(url)
    try:
        fs = fsspec.filesystem(proto, **options_for(proto, options))
    except ImportError as e:
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(proto, "")
        hint = f"pip install 'loomdata[{extra}]'" if extra else "install fsspec's HTTP support (aiohttp)"
        raise ObjectNotFoundError(url, f"no filesystem for {proto}:// ({e})", hint=hint) from None
    if proto == "s3" and not getattr(fs, "_loom_connected", False):
        _connect(fs)
        _MADE.add(_options_key(url, options))
    return fs


def _connect(fs: fsspec.AbstractFileSystem) -> None:
    """Make an s3fs filesystem's client once, before its first request (which would otherwise make it).

    0.29-0.34 s in a fresh process (the botocore session, aiobotocore's SSL context; moto on loopback,
    results/object_store_s8d_ab.json `cold_client`), which the first request and its measured latency (`_latency`)
    included. No request is sent.
    """
    with _CONNECT_LOCK:
        if getattr(fs, "_loom_connected", False):
            return
        with contextlib.suppress(Exception):  # the first request makes it again and reports the error, naming the URL
            fs.connect()
        fs._loom_connected = True


def warm_client(loc: Location, options: StorageOptions | None = None, fsspec: bool = True) -> None:
    """Make the client of `loc`'s store now (s3fs's session, pyarrow's S3 filesystem), sending no request.

    For a worker that starts serving a source on an object store: its first request then pays only its round
    trip. A no-op for a local path (a local-only plan starts no storage client). `fsspec=False`: on S3, pyarrow's
    alone (a loader whose requests all go through pyarrow: s3fs's client, ~0.3 s of CPU, is made only if needed).
    """
    if not is_url(loc):
        return
    url = str(loc)
    if fsspec or protocol_of(url) != "s3":
        _fs(url, options)
    if protocol_of(url) == "s3":
        kwargs = arrow_s3_kwargs(options_for("s3", options))
        if kwargs is not None:
            arrow_filesystem(kwargs)


def _retry(fn: Any, url: str, what: str, policy: RetryPolicy) -> Any:
    return retrying(fn, url, what, policy, on_retry=lambda _e: _STATS.add("retries"))


def _timed(fn: Callable[[], Any], url: str) -> Callable[[], Any]:
    """`fn`, each attempt that returns timed into the process's storage latency (`_latency`; retries' back-off not)."""

    def run() -> Any:
        t0 = time.perf_counter()
        out = fn()
        _LATENCY.record(url, time.perf_counter() - t0)
        return out

    return run


def glob(pattern: str, options: StorageOptions | None = None, policy: RetryPolicy = DEFAULT_POLICY) -> list[str]:
    """Object URLs matching `pattern` (fsspec glob semantics), sorted; a pattern without wildcards names one object."""
    fs = _fs(pattern, options)
    proto = protocol_of(pattern)
    if not _GLOB_CHARS & set(pattern.split("://", 1)[1]):
        return [pattern] if exists(pattern, options, policy) else []

    def run() -> list[str]:
        fs.invalidate_cache()
        return list(fs.glob(pattern, detail=False))

    _STATS.add("list")
    found = _retry(run, pattern, "listing", policy)
    if not found and proto in ("s3", "gs", "gcs"):  # no match: say so when the bucket itself is missing
        bucket = pattern.split("://", 1)[1].split("/", 1)[0]
        _STATS.add("head")
        if not _retry(lambda: fs.exists(bucket), pattern, "bucket check", policy):
            raise ObjectNotFoundError(
                pattern, f"bucket {bucket!r} does not exist (or is not visible to these credentials)"
            )
    return sorted(p if "://" in p else f"{proto}://{p}" for p in found)


@dataclass(frozen=True, slots=True)
class ObjectIdentity:
    """What identifies one version of a file or object without reading it: size plus ETag/version (or mtime/ctime)."""

    size: int
    version: str  # VersionId, GCS generation, ETag; "" for a local file
    mtime_ns: int = 0  # local files only
    ctime_ns: int = 0  # local files only


def _version_of(info: Mapping[str, Any]) -> str:
    for key in ("VersionId", "generation", "ETag", "etag", "md5Hash"):
        v = info.get(key)
        if v not in (None, "", "null"):
            return str(v).strip('"')
    return ""


def identity(
    loc: Location, options: StorageOptions | None = None, policy: RetryPolicy = DEFAULT_POLICY
) -> ObjectIdentity:
    """Size and version of `loc` (one HEAD for an object, a stat for a file); errors name it."""
    if not is_url(loc):
        st = os.stat(loc)
        return ObjectIdentity(int(st.st_size), "", int(st.st_mtime_ns), int(st.st_ctime_ns))
    url = str(loc)
    fs = _fs(url, options)

    def run() -> dict[str, Any]:
        fs.invalidate_cache(url)
        return dict(fs.info(url))

    _STATS.add("head")
    info = _retry(run, url, "stat", policy)
    if info.get("type") == "directory":
        raise ObjectNotFoundError(url, "is a prefix (a folder), not an object")
    return ObjectIdentity(int(info.get("size") or 0), _version_of(info))


def exists(loc: Location, options: StorageOptions | None = None, policy: RetryPolicy = DEFAULT_POLICY) -> bool:
    """Whether `loc` is an existing file or object (False when it is missing; other errors raise)."""
    try:
        if not is_url(loc):
            return Path(loc).is_file()
        identity(loc, options, policy)
    except ObjectNotFoundError:
        return False
    return True


def read_range(
    url: str,
    start: int,
    stop: int,
    options: StorageOptions | None = None,
    policy: RetryPolicy = DEFAULT_POLICY,
    size: int | None = None,
) -> bytes:
    """Bytes [start, stop) of an object: one range GET, retried when transient, or the answer of the same GET
    another thread has in flight now (`SharedGets`: same URL, range and options; made under that caller's retry
    policy; if it fails, this call makes its own, so an error can take two retry cycles to surface).

    `size`: the object's size as the caller knows it (a large S3 read through pyarrow checks its handle against it).
    """
    data = _read_view(url, start, stop, options, policy, size)
    return data if isinstance(data, bytes) else bytes(data)


def _read_view(
    url: str,
    start: int,
    stop: int,
    options: StorageOptions | None = None,
    policy: RetryPolicy = DEFAULT_POLICY,
    size: int | None = None,
) -> bytes | Any:
    """`read_range` without its copy: the bytes, or the `pyarrow.Buffer` a large S3 GET filled (buffer protocol).

    For `RangeFile`, which hands pyarrow slices of it (`read_buffer`): a row group read through pyarrow's S3 client
    then reaches the Parquet decoder with no copy in Python (five before: `bytes()`, a slice, a bytearray, a slice
    of it and `bytes()` again).
    """
    if stop <= start:
        return b""
    if stop - start >= ARROW_MIN_READ and protocol_of(url) == "s3":
        data = _arrow_range(url, start, stop, options, policy, size)
        if data is not None:
            return data
    fs = _fs(url, options)

    def one() -> bytes:
        _STATS.add("get")
        get = _timed(lambda: fs.cat_file(url, start=start, end=stop), url)
        data = bytes(_retry(get, url, f"read of bytes {start}..{stop}", policy))
        _STATS.add("get_bytes", len(data))
        return data

    key = _options_key(url, options)
    return one() if key is None else _SHARED.run((url, start, stop, key), one)


def head_identity(
    url: str, size: int, options: StorageOptions | None = None, policy: RetryPolicy = DEFAULT_POLICY
) -> ObjectIdentity | None:
    """Size and version of an s3:// object of `size` bytes (as indexed) from the HEAD that opens its pyarrow read
    handle (kept for the large reads after: `_arrow.arrow_head`), so checking a shard and opening it for reads is one
    request. None where its reads take no such handle (`handle_opened`). Errors raise, naming the URL."""
    if not handle_opened(url, size, options):
        return None
    kwargs = arrow_s3_kwargs(options_for("s3", options))
    if kwargs is None:
        return None
    got = _retry(lambda: arrow_head(url, kwargs, lambda: _STATS.add("head")), url, "open", policy)
    if got is None:
        return None
    size, headers = got
    return ObjectIdentity(size, _version_of(headers))


def handle_opened(url: str, size: int, options: StorageOptions | None = None) -> bool:
    """Whether large reads of `url` (an object of `size` bytes) go through a pyarrow handle, opened by a HEAD: an
    s3:// object of at least `ARROW_MIN_READ` bytes, pyarrow with S3, options it takes, no `LOOMDATA_S3_TRANSPORT`."""
    if protocol_of(url) != "s3" or size < ARROW_MIN_READ:
        return False
    return arrow_s3_kwargs(options_for("s3", options)) is not None


def read_range_identity(
    url: str, start: int, stop: int, options: StorageOptions | None = None, policy: RetryPolicy = DEFAULT_POLICY
) -> tuple[bytes, ObjectIdentity] | None:
    """Bytes [start, stop) of an s3:// object and its identity (size, version), from one range GET; None elsewhere.

    A GET's response carries what a HEAD gives (`Content-Range`'s total size, `ETag`, `x-amz-version-id`), read
    as s3fs's `info` reads them from a HEAD, so the identity equals `identity(url)`'s: a loader's shard check then
    needs no HEAD of its own (one request per object open fewer). Protocols other than s3, or a server that ignored
    the Range (a body longer than asked; at most one byte more is read, then it is closed): None (HEAD, then read).
    Errors raise as `read_range`'s do, naming the URL.
    """
    if protocol_of(url) != "s3" or stop <= start:
        return None
    fs = _fs(url, options)
    if not hasattr(fs, "_call_s3"):  # not s3fs
        return None

    import fsspec.asyn

    def one() -> tuple[bytes, ObjectIdentity] | None:
        _STATS.add("get")
        get = _timed(lambda: fsspec.asyn.sync(fs.loop, _get_with_headers, fs, url, start, stop), url)
        got = _retry(get, url, f"read of bytes {start}..{stop}", policy)
        if got is not None:
            _STATS.add("get_bytes", len(got[0]))
        return got

    return one()


async def _get_with_headers(fs: Any, url: str, start: int, stop: int) -> tuple[bytes, ObjectIdentity] | None:
    """One s3fs `get_object` of bytes [start, stop): the body, and size and version from the response's headers.

    At most `stop - start` bytes of the body are read (one more to tell a longer answer), then it is closed: a server
    that ignores the Range (a 200 with the whole object) costs no download of the object. Such an answer longer than
    asked: None (cannot tell; the caller HEADs and reads the ranges it needs)."""
    from s3fs.core import _error_wrapper, version_id_kw

    bucket, key, vers = fs.split_path(url)
    want = stop - start

    async def call() -> tuple[bytes, dict[str, Any]]:
        resp = await fs._call_s3(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", **version_id_kw(vers)
        )
        body, parts, got = resp["Body"], [], 0
        try:
            while got <= want:  # a stream's read(n) returns what has arrived, up to n: read until n or the end
                part = await body.read(want + 1 - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            return b"".join(parts), resp
        finally:
            body.close()

    body, resp = await _error_wrapper(call, retries=fs.retries)
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
    if len(body) > want or (not total.isdigit() and start > 0):
        return None  # the Range was not honoured: these are not bytes [start, stop)
    size = int(total) if total.isdigit() else int(resp.get("ContentLength") or len(body))  # a 200: the whole object
    info = {"VersionId": resp.get("VersionId"), "ETag": resp.get("ETag", "")}
    return bytes(body), ObjectIdentity(size, _version_of(info))


_SHARED = SharedGets()
"""This process's fsspec range GETs in flight: the same range asked for twice at once is one request (the shard
check's last 64 KiB and a Parquet footer, read together when a loader opens a shard)."""


def _options_key(url: str, options: StorageOptions | None) -> bytes | None:
    """The options a request of `url` is made with, as their pickled values (two callers with other credentials
    never share, whatever the values' repr shows); None where they do not pickle: that request is not shared.

    Not the filesystem instance: fsspec makes one per thread, and the callers to join are on other threads.
    """
    try:
        return pickle.dumps(sorted(options_for(protocol_of(url), options).items(), key=lambda kv: kv[0]))
    except Exception:  # an option that does not pickle (a client object): no sharing for it
        return None


def _arrow_range(
    url: str, start: int, stop: int, options: StorageOptions | None, policy: RetryPolicy, size: int | None
) -> Any | None:
    """A large S3 range through pyarrow (see `_arrow`), as the `pyarrow.Buffer` it filled; None: read it through
    fsspec (no pyarrow S3, sizes differ)."""
    kwargs = arrow_s3_kwargs(options_for("s3", options))
    if kwargs is None:
        return None
    what = f"read of bytes {start}..{stop}"
    wait = not _client_made(url, options)  # no s3fs client yet: wait for a handle being opened rather than make one
    timed = functools.partial(_LATENCY.record, url)  # the GET alone: not a wait for the HEAD opening its handle

    def get() -> Any | None:
        return arrow_read(url, start, stop, kwargs, lambda: _STATS.add("head"), size, wait, timed)

    data = _retry(get, url, what, policy)
    if data is None:  # being opened by another thread (kept: not dropped), or its size disagreed (dropped already)
        return None
    n = memoryview(data).nbytes
    if n != stop - start:  # a short read through a handle
        drop_handle(url)
        return None
    _STATS.add("get")
    _STATS.add("get_bytes", n)
    return data


def open_ahead(
    url: Location, options: StorageOptions | None = None, size: int | None = None, policy: RetryPolicy = DEFAULT_POLICY
) -> None:
    """Open now what large range reads of `url` will use (pyarrow's S3 handle: its one HEAD); a no-op elsewhere.

    For opening a shard ahead of its first read (a loader's shard opens). `size`: the object's size where known
    (an object smaller than `ARROW_MIN_READ` has no large read: nothing is opened). An error raises, naming the URL.
    """
    if not is_url(url) or protocol_of(str(url)) != "s3" or (size is not None and size < ARROW_MIN_READ):
        return
    kwargs = arrow_s3_kwargs(options_for("s3", options))
    if kwargs is not None:
        _retry(lambda: arrow_open(str(url), kwargs, lambda: _STATS.add("head")), str(url), "open", policy)


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over one object: each read is a range GET of at least 256 KiB (buffered).

    pyarrow reads it through `read_buffer` (zero-copy views of the range fetched); other readers (tarfile, the JSONL
    scanner) through `read` / `readinto` (one copy).
    """

    def __init__(
        self, url: str, size: int, options: StorageOptions | None = None, policy: RetryPolicy = DEFAULT_POLICY
    ) -> None:
        super().__init__()
        self.url = url
        self.name = url
        self._size = size
        self._options = options
        self._policy = policy
        self._pos = 0
        self._buf: bytes | Any = b""  # the range last fetched: bytes, or a pyarrow.Buffer (see `_read_view`)
        self._buf_start = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def size(self) -> int:
        return self._size

    def preload(self, start: int, stop: int) -> None:
        """Fetch bytes [start, stop) in one range request: reads inside them are served from memory (coalesced reads).

        Held until `release` or a read outside them; retried like any range read (a reset mid-body is read again).
        """
        start, stop = max(0, start), min(self._size, stop)
        if stop > start:
            self._buf = _read_view(self.url, start, stop, self._options, self._policy, self._size)
            self._buf_start = start

    def release(self) -> None:
        """Let go of the bytes held (a preloaded span, or the last read's)."""
        self._buf, self._buf_start = b"", 0

    def _view(self, size: int | None) -> memoryview:
        """The next `size` bytes (all that is left for None or < 0) as a view of the range held, fetching a range
        of at least 256 KiB from the position when they are not all held; the position moves past them."""
        n = self._size - self._pos if size is None or size < 0 else min(size, self._size - self._pos)
        if n <= 0:
            return memoryview(b"")
        lo = self._pos - self._buf_start
        held = memoryview(self._buf)
        if not (lo >= 0 and lo + n <= held.nbytes):
            stop = min(self._size, self._pos + max(n, _MIN_READ))
            self._buf = _read_view(self.url, self._pos, stop, self._options, self._policy, self._size)
            self._buf_start, lo = self._pos, 0
            held = memoryview(self._buf)
        self._pos += n
        return held.cast("B")[lo : lo + n]

    def read_buffer(self, size: int | None = -1) -> memoryview:
        """`read` without the copy: a view of the bytes fetched (pyarrow's Python-file reader uses it when present)."""
        return self._view(size)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        got = self._view(len(view))
        view[: got.nbytes] = got
        return got.nbytes

    def read(self, size: int | None = -1) -> bytes:
        got = self._view(size)
        obj = got.obj
        if isinstance(obj, bytes) and got.nbytes == len(obj):
            return obj  # the whole range fetched, as fetched: no copy
        return got.tobytes()


def open_input(loc: Location, options: StorageOptions | None = None, size: int | None = None) -> BinaryIO:
    """A binary file for reading: the plain `open` for a path, a `RangeFile` for an object URL."""
    if not is_url(loc):
        return open(loc, "rb")
    url = str(loc)
    n = identity(url, options).size if size is None else size
    return RangeFile(url, n, options)  # type: ignore[return-value]


class ObjectView:
    """An mmap-like read-only view of an object (`len`, indexing, slicing, `find`); 256 KiB pages cached."""

    def __init__(self, url: str, size: int, options: StorageOptions | None = None, max_pages: int = 64) -> None:
        self.url = url
        self._size = size
        self._options = options
        self._pages: dict[int, bytes] = {}
        self._max_pages = max_pages

    def __len__(self) -> int:
        return self._size

    def _page(self, i: int) -> bytes:
        page = self._pages.get(i)
        if page is None:
            if len(self._pages) >= self._max_pages:
                self._pages.pop(next(iter(self._pages)))
            page = read_range(self.url, i * _MIN_READ, min(self._size, (i + 1) * _MIN_READ), self._options)
            self._pages[i] = page
        return page

    def _bytes(self, start: int, stop: int) -> bytes:
        start, stop = max(0, start), min(self._size, stop)
        if stop <= start:
            return b""
        first, last = start // _MIN_READ, (stop - 1) // _MIN_READ
        if last - first > 4:  # a long range: one request, not cached
            return read_range(self.url, start, stop, self._options)
        data = b"".join(self._page(i) for i in range(first, last + 1))
        return data[start - first * _MIN_READ : stop - first * _MIN_READ]

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, _ = key.indices(self._size)
            return self._bytes(start, stop)
        if not -self._size <= key < self._size:
            raise IndexError(key)
        key %= self._size
        return self._bytes(key, key + 1)[0]

    def find(self, sub: bytes, start: int = 0) -> int:
        """Index of the first `sub` at or after `start`, or -1 (page by page)."""
        pos = start
        while pos < self._size:
            i = pos // _MIN_READ
            page = self._page(i)
            hit = page.find(sub, pos - i * _MIN_READ)
            if hit >= 0:
                return i * _MIN_READ + hit
            pos = (i + 1) * _MIN_READ
        return -1


def cache_dir() -> Path:
    """Where objects fetched whole are kept (`LOOMDATA_CACHE_DIR`, else ~/.cache/loomdata/objects)."""
    env = os.environ.get("LOOMDATA_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "loomdata" / "objects"


def fetch_to_cache(url: str, options: StorageOptions | None = None) -> Path:
    """A local copy of a whole (small) object, fetched once per version: the file is named by URL, ETag and size."""
    ident = identity(url, options)
    name = hashlib.sha256(f"{url}\0{ident.version}\0{ident.size}".encode()).hexdigest()[:32]
    suffix = "".join(Path(url.rsplit("/", 1)[-1]).suffixes[-1:])
    path = cache_dir() / f"{name}{suffix}"
    if path.is_file() and path.stat().st_size == ident.size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        pos = 0
        while pos < ident.size:
            chunk = read_range(url, pos, min(ident.size, pos + 64 * _MIN_READ), options)
            f.write(chunk)
            pos += len(chunk)
    os.replace(tmp, path)
    return path
