"""The rank gateway: one TLS listener per worker process that serves ranks' takes from its constructors.

Why: see `_wire`. A rank connects straight to the worker holding its constructor (the address
serve.json names for it), authenticated like the cluster's own comms (the worker's TLS listen
context: the cluster CA, client certificates required), and asks by the constructor's published
name. The listener runs on the worker's event loop and calls the constructor's coroutines directly,
so a take costs one socket round trip and no Dask message. A connection's calls run concurrently
(as Dask actor calls do: a take waiting for a peer must not hold up the rank's next call), each
answer tagged with its request's id; constructors are held weakly (a released actor is gone from here too, and a
rank asking for it is told to re-resolve).

Same host: the gateway also listens on a Unix-domain socket in a folder it creates with mode 0700, named
in serve.json beside the TLS address (`protocol.LocalGateway`). Only its own user can reach it (the folder's
permissions, and the peer's uid checked at accept), so it needs no TLS, and its answers are written from their
buffers in one `sendmsg` (no join into one bytes, no copy into a transport's buffer): a take costs
0.35x the CPU of the TLS path at 768 KiB, worker and rank together (`benchmarks/gateway_transport.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import ssl
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

from loomdata.execution._unix_listen import listen_unix
from loomdata.execution._wire import (
    HEADER,
    MAGIC,
    MAX_BODY,
    REQUEST,
    WireError,
    decode_request,
    encode_answer,
    lengths_format,
)
from loomdata.execution.protocol import ExecutorUnavailable, LocalGateway, host_id, peer_uid
from loomdata.schemas.errors import ExecutionError

__all__ = ["LOCAL_SOCKET", "METHODS", "GatewayAddress", "register", "unregister"]

logger = logging.getLogger(__name__)

METHODS = frozenset({"take", "take_steps", "take_block", "record_telemetry"})
"""What a rank may ask of its constructor through the gateway."""


LOCAL_SOCKET = "gateway.sock"
"""The Unix socket's name inside the gateway's private folder."""
_PREFIX = "loom-gw-"
_RECV_CHUNK = 1 << 16  # a same-host connection's requests are read this much at a time (a request: ~200 bytes)
_IOV_MAX = 512  # parts per sendmsg (Linux allows 1024)
_SEND_BUFFER = 4 << 20  # a take leaves in one sendmsg, not one per 208 KiB (the kernel caps it at wmem_max)


class GatewayAddress(NamedTuple):
    """Where a gateway listens and the id it drew when it opened (another gateway on that address has another).

    `local`: its same-host endpoint (None where it has none: no Unix sockets with peer credentials here).
    """

    address: str
    id: str
    local: LocalGateway | None = None


Read = Callable[[int], Awaitable[bytes]]
Write = Callable[[Sequence[bytes | memoryview]], Awaitable[None]]


class _Gateway:
    """The listeners of this worker process and the constructors they serve, by published name."""

    def __init__(self) -> None:
        self.targets: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self.address: GatewayAddress | None = None
        self._server: asyncio.base_events.Server | None = None
        self._local: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None

    async def open(self, host: str, scheme: str, ssl_context: ssl.SSLContext | None) -> GatewayAddress:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve_stream, host=host, port=0, ssl=ssl_context)
            port = self._server.sockets[0].getsockname()[1]
            local = self._open_local()
            self.address = GatewayAddress(f"{scheme}://{host}:{port}", secrets.token_hex(8), local)
        assert self.address is not None
        return self.address

    def _open_local(self) -> LocalGateway | None:
        """Listen on a Unix socket in a fresh 0700 folder (removed at exit); None where that is not possible."""
        got = listen_unix(_PREFIX, LOCAL_SOCKET, logger, "gateway same-host endpoint", "ranks use TLS")
        if got is None:
            return None
        path, listener = got
        self._local = listener
        self._accepting = asyncio.ensure_future(self._accept_local(listener))
        return LocalGateway(path=str(path), host_id=host_id())

    async def _accept_local(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:  # e.g. out of descriptors: keep accepting
                logger.warning("gateway: accepting on %s failed (%s)", listener.getsockname(), e)
                await asyncio.sleep(0.1)
                continue
            uid = peer_uid(conn)
            if uid != os.getuid():  # the folder is 0700: only root gets here otherwise
                logger.warning("gateway: refused a same-host connection from uid %s (serving uid %s)", uid, os.getuid())
                conn.close()
                continue
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
            serve = asyncio.ensure_future(self._serve_socket(conn))
            _RUNNING.add(serve)
            serve.add_done_callback(_RUNNING.discard)

    async def _serve_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A TLS (or `--insecure` TCP) connection: asyncio streams."""

        async def write(parts: Sequence[bytes | memoryview]) -> None:
            writer.writelines(parts)
            await writer.drain()

        try:
            await self._serve(reader.readexactly, write, writer.get_extra_info("peername"))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_socket(self, conn: socket.socket) -> None:
        """A same-host connection: the socket itself; an answer's parts leave from their own buffers in one
        `sendmsg` (no join, no transport buffer), requests are read as they come (one `recv` for a whole one)."""
        loop = asyncio.get_running_loop()
        pending = bytearray()

        async def read(n: int) -> bytes:
            while len(pending) < n:
                chunk = await loop.sock_recv(conn, max(n - len(pending), _RECV_CHUNK))
                if not chunk:
                    raise asyncio.IncompleteReadError(bytes(pending), n)
                pending.extend(chunk)
            out = bytes(pending[:n])
            del pending[:n]
            return out

        sender = _Sender(loop, conn)
        try:
            await self._serve(read, sender.send, "a same-host rank")
        finally:
            sender.close()

    async def _serve(self, read: Read, write: Write, peer: Any) -> None:
        """Read a connection's requests and start each call; until the rank hangs up or sends a wrong frame."""
        lock = asyncio.Lock()  # a connection's calls run concurrently; one answer is written at a time
        try:
            while True:
                try:
                    head = await read(HEADER.size)
                except asyncio.IncompleteReadError:
                    return  # the rank closed its connection
                magic, kind, request_id, n_buffers = HEADER.unpack(head)
                if magic != MAGIC or kind != REQUEST or n_buffers != 0:
                    raise WireError(f"not a gateway request frame from {peer}")
                (length,) = lengths_format(0).unpack(await read(lengths_format(0).size))
                if length > MAX_BODY:
                    raise WireError(f"a request of {length} bytes from {peer}")
                target, method, args, kwargs = decode_request(await read(length))
                call = asyncio.ensure_future(self._answer(write, lock, request_id, target, method, args, kwargs))
                _RUNNING.add(call)  # held until done: a call runs on even if the rank hangs up (as Dask's do)
                call.add_done_callback(_RUNNING.discard)
        except (WireError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError) as e:
            logger.info("gateway: dropped the connection from %s (%s: %s)", peer, type(e).__name__, e)

    async def _answer(
        self,
        write: Write,
        lock: asyncio.Lock,
        request_id: int,
        target: str,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> None:
        value, error = await self._call(target, method, args, kwargs)
        with contextlib.suppress(OSError, RuntimeError):  # the rank hung up meanwhile (ConnectionError included)
            async with lock:
                await write(_answer(request_id, value, error))

    async def _call(self, target: str, method: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """(value, False) or (exception, True): what the rank's call raised is raised again at the rank."""
        if method not in METHODS:
            return ExecutionError(f"the gateway serves {sorted(METHODS)}, not {method!r}"), True
        constructor = self.targets.get(target)
        if constructor is None:
            return ExecutorUnavailable(f"constructor {target} is not served on this worker (any more)"), True
        try:
            return await getattr(constructor, method)(*args, **kwargs), False
        except asyncio.CancelledError:  # the constructor stopped under the take: the rank must hear of it
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return ExecutorUnavailable(f"constructor {target} stopped during the call; reconnect"), True
        except Exception as e:  # the rank decides: a LoomError fails it, anything else is retried
            return e, True


class _Sender:
    """Writes answers to a non-blocking same-host socket: scatter-gather `sendmsg`, waiting while it is full."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        self._loop, self._conn, self._fd = loop, conn, conn.fileno()
        self._waiting: set[asyncio.Future[None]] = set()

    async def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send `parts` in order (OSError once the rank is gone or the connection was closed)."""
        views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
        while views:
            try:
                sent = self._conn.sendmsg(views[:_IOV_MAX])
            except (BlockingIOError, InterruptedError):
                sent = 0
            while sent and views:  # drop what went out; the first part left may be partly sent
                if sent >= views[0].nbytes:
                    sent -= views.pop(0).nbytes
                else:
                    views[0], sent = views[0][sent:], 0
            if views:
                await self._writable()

    async def _writable(self) -> None:
        writable = self._loop.create_future()
        self._waiting.add(writable)
        self._loop.add_writer(self._fd, _wake, writable)
        try:
            await writable
        finally:
            self._waiting.discard(writable)
            if not self._waiting and self._conn.fileno() != -1:  # closed: its number may be another socket's now
                self._loop.remove_writer(self._fd)

    def close(self) -> None:
        """Close the socket; a send waiting for room tries once more and fails (it would wait forever)."""
        self._loop.remove_writer(self._fd)
        self._conn.close()
        for writable in list(self._waiting):
            _wake(writable)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _answer(request_id: int, value: Any, error: bool) -> list[bytes | memoryview]:
    try:
        return encode_answer(request_id, value, error=error)
    except Exception as e:  # an exception that does not pickle still reaches the rank, as text
        return encode_answer(request_id, ExecutionError(f"{type(value).__name__}: {value} ({e})"), error=True)


_GATEWAY = _Gateway()
_RUNNING: set[asyncio.Future[None]] = set()


async def register(name: str, constructor: Any) -> GatewayAddress | None:
    """Serve `constructor` under `name` on this worker's gateway (opened on first use); its address and id.

    None when not on a Dask worker (a constructor made directly in a test): ranks then use Dask calls.
    """
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return None
    scheme, _, rest = str(worker.address).partition("://")
    host = rest.rsplit(":", 1)[0].strip("[]")
    ctx = None
    if scheme == "tls":
        ctx = worker.security.get_listen_args("worker")["ssl_context"]
    address = await _GATEWAY.open(host, scheme, ctx)
    _GATEWAY.targets[name] = constructor
    return address


def unregister(constructor: Any) -> None:
    """Stop serving `constructor` (another constructor since registered under its name stays)."""
    for name in [n for n, c in _GATEWAY.targets.items() if c is constructor]:
        del _GATEWAY.targets[name]
