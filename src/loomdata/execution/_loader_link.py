"""Same-host loader reads without Dask actor calls: a constructor reads a loader on another worker of its host
through that worker's loader link, a Unix socket.

Why: a Dask actor call costs ~1.1-2.2 ms of CPU per read on the two workers together beyond the loader's own read
(~0.4 ms; TLS, Dask's comm stack, msgpack and pickle, the actor machinery), the link ~0.2-0.9 ms
(`benchmarks/loader_link.py`), and a build group reads every source of the mixture. Over the link a read is one
small frame out (`_wire`'s header, a JSON body naming the loader's actor key, the request's rows as one raw buffer)
and one frame back (the answer as a protocol-5 pickle, its arrays as raw buffers), on both ends handled by an
asyncio protocol on the worker's event loop.

Safety, as the rank gateway's same-host endpoint (`_gateway`): the socket lives in a folder made with mode
0700, and each end checks the other's uid (SO_PEERCRED); the server never unpickles what a peer sent (the
request is JSON and a NumPy buffer of `REQUEST_DTYPE`), and a constructor unpickles answers only from a server
of its own user, in a folder of its own user closed to others (else `LinkRefused`: it reads through Dask).
Only `SourceLoader.read` is served, and only for an actor key that is a live loader of that worker.

Where it applies: a constructor learns a worker's link endpoint once, from any loader there
(`LinkedLoader.link_endpoint`, an actor call; the executor's loaders are `LinkedLoader`s: a method on
`SourceLoader` itself would make `_loader` import this module, a circle). A worker on another host (another
`host_id`) or whose link is refused (`LinkRefused`) is read through Dask for good: its endpoint is not asked
again. A worker without a link (no Unix sockets, a socket path too long), a loader without the method, or a link
that failed to connect is read through Dask for `RETRY_AFTER_S`, then its endpoint is asked again. A loader on
the constructor's own worker is never read over a link (in-process while it is live, else through Dask).
Recovery stays `_reads`'s: a link that breaks fails its reads in flight with ConnectionError (sorted "lost",
asked again on the route of the moment), a retired loader raises `LoaderRetired` through it as through Dask, a
key the worker no longer holds (a released actor) is read through Dask, whose answer is the one `_reads` already
sorts, and an answer that does not unpickle fails its read with ExecutionError (the link stays open).
`LOOM_LOADER_LINK=0` turns the link off.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import socket
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from loomdata.execution._dask_actors import actor_address, worker_actor
from loomdata.execution._loader import REQUEST_DTYPE, SegmentData, SourceLoader
from loomdata.execution._unix_listen import listen_unix
from loomdata.execution._wire import (
    ANSWER,
    ERROR,
    HEADER,
    MAGIC,
    MAX_BODY,
    REQUEST,
    WireError,
    decode_answer,
    encode_answer,
    lengths_format,
)
from loomdata.execution.protocol import foreign_folder, host_id, peer_uid
from loomdata.schemas.errors import ExecutionError

__all__ = [
    "ENABLED",
    "RETRY_AFTER_S",
    "LinkEndpoint",
    "LinkRefused",
    "LinkedLoader",
    "NotServed",
    "link_for",
    "serve_link",
    "stats",
]

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("LOOM_LOADER_LINK", "1") != "0"
"""Whether constructors read same-host loaders over the link (`LOOM_LOADER_LINK=0`: every read through Dask)."""

RETRY_AFTER_S = 5.0
"""After a link could not be had for a worker (no endpoint, connect failed), reads go through Dask this long."""

LINK_SOCKET = "loader.sock"
_PREFIX = "loom-link-"
_MAX_REQUEST = 64 << 20  # a request's rows (20 bytes each): far above any step's
_DIRECT = 1 << 16  # a frame part this large is received straight into its own buffer, not through the scratch
_ENDPOINT_TIMEOUT_S = 10.0
_SOCKET_BUFFER = 4 << 20  # an answer (~200 KB for a window's rows) leaves in one send, arrives in one recv

_STATS = dict.fromkeys(("served", "not_served", "read", "opened", "no_link"), 0)


def stats() -> dict[str, int]:
    """This process's link counts: reads `served` (and `not_served`) as a loader's worker; reads `read` over links,
    links `opened`, and link attempts that ended in `no_link` (reads through Dask) as a constructor's worker."""
    return dict(_STATS)


class LinkEndpoint(NamedTuple):
    """A worker's loader link: its Unix socket and the host it is on (`protocol.host_id`)."""

    path: str
    host_id: str


class LinkRefused(ConnectionError):
    """A link a constructor will not use: its folder not its user's or open to others, or another uid serving it."""


class NotServed(Exception):
    """The link's worker holds no live loader under the key asked (released, or not a loader): read through Dask."""


class LinkedLoader(SourceLoader):
    """A SourceLoader that also tells where its worker's loader link listens (the executor's loaders are these)."""

    async def link_endpoint(self) -> LinkEndpoint | None:
        """This worker's loader link, opened on first use; None where it has none (a constructor then reads through
        Dask)."""
        return await serve_link()


# ---- frames ----------------------------------------------------------------------------------------------------


class _Frames(asyncio.BufferedProtocol):
    """Receives `_wire` frames (header, lengths, body, buffers) from a stream; `frame()` gets each whole one.

    Small parts are received into a scratch buffer (one `recv` takes a whole small frame, or several), a large
    one straight into its own bytearray (the buffer an answer's array then lives in: no copy).
    """

    kinds: tuple[int, ...] = ()
    max_buffers = 1 << 16
    max_body = 1 << 62  # an answer's body may carry an array in-band (a non-contiguous one)
    max_part = 1 << 62

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(_DIRECT)  # a part this large or larger is received in place
        self._direct = False
        self._reset()

    def _reset(self) -> None:
        self._cur = bytearray(HEADER.size)
        self._got = 0
        self._stage = 0  # 0 header, 1 lengths, 2 body and buffers
        self._parts: list[bytearray] = []
        self._sizes: list[int] = []
        self._head = (0, 0, 0)

    def get_buffer(self, sizehint: int) -> memoryview:
        left = len(self._cur) - self._got
        self._direct = left >= _DIRECT
        return memoryview(self._cur)[self._got :] if self._direct else memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._direct:
                self._got += nbytes
                self._advance()
                return
            data = memoryview(self._scratch)[:nbytes]
            while data:
                k = min(len(self._cur) - self._got, len(data))
                self._cur[self._got : self._got + k] = data[:k]
                self._got += k
                data = data[k:]
                self._advance()
        except WireError as e:
            logger.info("loader link: dropped a connection (%s)", e)
            if self.transport is not None:
                self.transport.abort()

    def _advance(self) -> None:
        """Move past every complete part (zero-length parts included); hand on each complete frame."""
        while self._got == len(self._cur):
            if self._stage == 0:
                magic, kind, request_id, n_buffers = HEADER.unpack(self._cur)
                if magic != MAGIC or kind not in self.kinds or n_buffers > self.max_buffers:
                    raise WireError(f"not a loader link frame (kind {kind}, {n_buffers} buffers)")
                self._head = (kind, request_id, n_buffers)
                self._stage, self._cur, self._got = 1, bytearray(lengths_format(n_buffers).size), 0
            elif self._stage == 1:
                self._sizes = list(lengths_format(self._head[2]).unpack(self._cur))
                if self._sizes[0] > self.max_body or any(s > self.max_part for s in self._sizes[1:]):
                    raise WireError(f"a loader link frame of parts {self._sizes} bytes")
                self._stage, self._cur, self._got = 2, bytearray(self._sizes.pop(0)), 0
            else:
                self._parts.append(self._cur)
                if self._sizes:
                    self._cur, self._got = bytearray(self._sizes.pop(0)), 0
                    continue
                (kind, request_id, _), parts = self._head, self._parts
                self._reset()
                self.frame(kind, request_id, parts[0], parts[1:])

    def frame(self, kind: int, request_id: int, body: bytearray, buffers: list[bytearray]) -> None:
        raise NotImplementedError


# ---- the server (on the loader's worker) -----------------------------------------------------------------------


class _ServerConnection(_Frames):
    """One constructor's connection: each request a task reading the loader, answers written as they finish."""

    kinds = (REQUEST,)
    max_buffers = 1
    max_body = MAX_BODY
    max_part = _MAX_REQUEST

    def __init__(self, lookup: Callable[[str], Any], live: weakref.WeakSet[_ServerConnection]) -> None:
        super().__init__()
        self._lookup = lookup
        self._tasks: set[asyncio.Future[None]] = set()
        live.add(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        uid = peer_uid(transport.get_extra_info("socket"))
        if uid != os.getuid():  # the folder is 0700: only root gets here otherwise
            logger.warning("loader link: refused a connection from uid %s (serving uid %s)", uid, os.getuid())
            transport.abort()
            return
        _grow_buffer(transport.get_extra_info("socket"), socket.SO_SNDBUF)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None  # reads in flight finish; their answers are dropped

    def frame(self, kind: int, request_id: int, body: bytearray, buffers: list[bytearray]) -> None:
        try:
            key = json.loads(body)["key"]
            if not isinstance(key, str) or len(buffers) != 1 or len(buffers[0]) % REQUEST_DTYPE.itemsize:
                raise ValueError("a key and one buffer of request rows")
        except Exception as e:  # not JSON, not an object with a key, nested past the recursion limit, ...
            raise WireError(f"not a loader read request ({type(e).__name__}: {str(e)[:200]})") from None
        request = np.frombuffer(buffers[0], dtype=REQUEST_DTYPE)
        task = asyncio.ensure_future(self._answer(request_id, key, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, request_id: int, key: str, request: np.ndarray) -> None:
        loader = self._lookup(key)
        error = True
        value: Any
        if not isinstance(loader, SourceLoader):
            _STATS["not_served"] += 1
            value = NotServed(f"no live loader {key} on this worker")
        else:
            _STATS["served"] += 1
            try:
                value, error = await loader.read(request), False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the constructor sorts it (`_outcome.sort_read_failure`), as a Dask call's
                value = e
        try:
            parts = encode_answer(request_id, value, error=error)
        except Exception as e:  # an exception that does not pickle still reaches the constructor, as text
            parts = encode_answer(request_id, ExecutionError(f"{type(value).__name__}: {value} ({e})"), error=True)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(parts)


class _Server:
    """A worker's link: the listener in its private folder, serving that worker's loaders by actor key."""

    def __init__(self, lookup: Callable[[str], Any]) -> None:
        self.lookup = lookup
        self.endpoint: LinkEndpoint | None = None
        self._server: asyncio.AbstractServer | None = None
        self._live: weakref.WeakSet[_ServerConnection] = weakref.WeakSet()

    async def open(self) -> LinkEndpoint | None:
        got = listen_unix(_PREFIX, LINK_SOCKET, logger, "loader link", "reads go through Dask")
        if got is None:
            return None
        path, listener = got
        try:
            loop = asyncio.get_running_loop()
            serve = functools.partial(_ServerConnection, self.lookup, self._live)
            self._server = await loop.create_unix_server(serve, sock=listener)
        except OSError as e:
            listener.close()
            shutil.rmtree(path.parent, ignore_errors=True)
            logger.info("loader link: none (%s: %s); reads go through Dask", type(e).__name__, e)
            return None
        self.endpoint = LinkEndpoint(str(path), host_id())
        return self.endpoint

    def close(self) -> None:
        """Stop listening and drop every connection (as the worker's death would; tests)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._live):
            if conn.transport is not None:
                conn.transport.abort()


_SERVERS: dict[str, _Server] = {}
_OPENING: dict[str, asyncio.Future[LinkEndpoint | None]] = {}


async def serve_link() -> LinkEndpoint | None:
    """This worker's loader link endpoint, opened on first use; None off a worker or where it cannot open."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return None
    address = str(worker.address)
    server = _SERVERS.get(address)
    if server is not None:
        return server.endpoint
    opening = _OPENING.get(address)
    if opening is None:

        def lookup(key: str) -> Any:
            return worker_actor(worker, key)

        new = _Server(lookup)
        opening = _OPENING[address] = asyncio.ensure_future(new.open())

        def opened(_: object) -> None:
            _SERVERS[address] = new
            _OPENING.pop(address, None)

        opening.add_done_callback(opened)
    return await asyncio.shield(opening)


# ---- the client (in the constructor's worker) ------------------------------------------------------------------


class Link(_Frames):
    """A connection to one worker's link: reads in flight by request id, answered in any order."""

    kinds = (ANSWER, ERROR)

    def __init__(self, address: str) -> None:
        super().__init__()
        self.address = address
        self.closed = False
        self._next = 0
        self._pending: dict[int, asyncio.Future[Any]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"loader link to {self.address} lost ({exc or 'closed'})"))

    def frame(self, kind: int, request_id: int, body: bytearray, buffers: list[bytearray]) -> None:
        fut = self._pending.pop(request_id, None)
        if fut is None or fut.done():  # an abandoned read: dropped
            return
        try:
            value = decode_answer(body, buffers)
        except Exception as e:  # e.g. an exception class that does not unpickle: the read fails, the link stays
            fut.set_exception(ExecutionError(f"undecodable answer from {self.address}: {type(e).__name__}: {e}"))
            return
        if kind == ERROR:
            fut.set_exception(value if isinstance(value, BaseException) else ExecutionError(str(value)))
        else:
            fut.set_result(value)

    async def read(self, key: str, request: np.ndarray) -> SegmentData:
        """Loader `key`'s answer to `request` (NotServed: read it through Dask; ConnectionError: the link broke)."""
        if self.closed or self.transport is None:
            raise ConnectionError(f"loader link to {self.address} is closed")
        self._next += 1
        request_id = self._next
        rows = np.ascontiguousarray(request, dtype=REQUEST_DTYPE)
        body = json.dumps({"key": key}).encode()
        head = HEADER.pack(MAGIC, REQUEST, request_id, 1) + lengths_format(1).pack(len(body), rows.nbytes)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        _STATS["read"] += 1
        try:
            self.transport.writelines([head, body, rows.data.cast("B")])
            answer: SegmentData = await fut
            return answer
        finally:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Links:
    """One event loop's links by worker address: a live link, the time before which not to try, or one opening."""

    def __init__(self) -> None:
        self.links: dict[str, Link] = {}
        self.not_before: dict[str, float] = {}
        self.opening: dict[str, asyncio.Future[Link | None]] = {}
        self.host = host_id()

    async def open(self, loader: Any, address: str) -> Link | None:
        fut = self.opening.get(address)
        if fut is None:
            fut = self.opening[address] = asyncio.ensure_future(self._open(loader, address))
            fut.add_done_callback(lambda _: self.opening.pop(address, None))
        return await asyncio.shield(fut)

    async def _open(self, loader: Any, address: str) -> Link | None:
        try:
            endpoint = await asyncio.wait_for(loader.link_endpoint(), _ENDPOINT_TIMEOUT_S)
            if endpoint is None or endpoint.host_id != self.host:
                self.not_before[address] = float("inf") if endpoint is not None else time.monotonic() + RETRY_AFTER_S
                _STATS["no_link"] += 1
                return None
            link = await _connect(endpoint.path, address)
        except LinkRefused as e:
            logger.warning("loader link: %s; reads from %s go through Dask", e, address)
            self.not_before[address] = float("inf")
            _STATS["no_link"] += 1
            return None
        except Exception as e:  # no endpoint (a lost worker, an old loader) or no connection: Dask, for a while
            logger.debug("loader link to %s: none (%s: %s)", address, type(e).__name__, e)
            self.not_before[address] = time.monotonic() + RETRY_AFTER_S
            _STATS["no_link"] += 1
            return None
        self.links[address] = link
        _STATS["opened"] += 1
        return link


_LINKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Links] = weakref.WeakKeyDictionary()


def link_for(loader: Any) -> Link | asyncio.Future[Link | None] | None:
    """The link to read `loader` (a Dask actor handle) over: a live one, None (read through Dask), or a future of
    one being opened. Called on the constructor's event loop."""
    if not ENABLED:
        return None
    address = actor_address(loader)
    if address is None:
        return None
    loop = asyncio.get_running_loop()
    links = _LINKS.get(loop)
    if links is None:
        links = _LINKS[loop] = _Links()
    link = links.links.get(address)
    if link is not None:
        if not link.closed:
            return link
        del links.links[address]  # broke (its worker died?): connect again, or read through Dask
    if time.monotonic() < links.not_before.get(address, 0.0):
        return None
    if address == _own_address():  # a loader released from this very worker: no link to itself, Dask answers
        return None
    return asyncio.ensure_future(links.open(loader, address))


def _own_address() -> str | None:
    """The address of the worker this runs on (None off a worker)."""
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except ValueError:
        return None


async def _connect(path: str, address: str) -> Link:
    """A link over the socket at `path`, once its folder and its server are known to be this user's."""
    why = foreign_folder(Path(path).parent)
    if why is not None:
        raise LinkRefused(f"link folder {why}")
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        _grow_buffer(sock, socket.SO_RCVBUF)
        await loop.sock_connect(sock, path)
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise LinkRefused(f"link socket {path} is served by uid {uid}, not uid {os.getuid()}")
        _, link = await loop.create_unix_connection(lambda: Link(address), sock=sock)
    except BaseException:
        sock.close()
        raise
    return link


def _grow_buffer(sock: Any, option: int) -> None:
    """Ask for a socket buffer of `_SOCKET_BUFFER` (the kernel caps it at its maximum; failing changes nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)


def close_links() -> None:
    """Close this event loop's links (tests; a worker's links otherwise end with its process)."""
    with contextlib.suppress(RuntimeError):
        links = _LINKS.pop(asyncio.get_running_loop(), None)
        for link in links.links.values() if links is not None else ():
            link.close()
