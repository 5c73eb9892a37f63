"""The rank gateway: one TLS listener per worker process that serves ranks' takes from its constructors.

Why: see `_wire`. A rank connects straight to the worker holding its constructor (the address
serve.json names for it), authenticated like the cluster's own comms (the worker's TLS listen
context: the cluster CA, client certificates required), and asks by the constructor's published
name. The listener runs on the worker's event loop and calls the constructor's coroutines directly,
so a take costs one socket round trip and no Dask message. A connection's calls run concurrently
(as Dask actor calls do: a take waiting for a peer must not hold up the rank's next call), each
answer tagged with its request's id; constructors are held weakly (a released actor is gone from here too, and a
rank asking for it is told to re-resolve).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
import weakref
from typing import Any, NamedTuple

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
from loomdata.execution.protocol import ExecutorUnavailable
from loomdata.schemas.errors import ExecutionError

__all__ = ["METHODS", "GatewayAddress", "register", "unregister"]

logger = logging.getLogger(__name__)

METHODS = frozenset({"take", "take_steps", "take_block", "record_telemetry"})
"""What a rank may ask of its constructor through the gateway."""


class GatewayAddress(NamedTuple):
    """Where a gateway listens and the id it drew when it opened (another gateway on that address has another)."""

    address: str
    id: str


class _Gateway:
    """The listener of this worker process and the constructors it serves, by published name."""

    def __init__(self) -> None:
        self.targets: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self.address: GatewayAddress | None = None
        self._server: asyncio.base_events.Server | None = None

    async def open(self, host: str, scheme: str, ssl_context: ssl.SSLContext | None) -> GatewayAddress:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host=host, port=0, ssl=ssl_context)
            port = self._server.sockets[0].getsockname()[1]
            self.address = GatewayAddress(f"{scheme}://{host}:{port}", secrets.token_hex(8))
        assert self.address is not None
        return self.address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        lock = asyncio.Lock()  # a connection's calls run concurrently; one answer is written at a time
        try:
            while True:
                try:
                    head = await reader.readexactly(HEADER.size)
                except asyncio.IncompleteReadError:
                    return  # the rank closed its connection
                magic, kind, request_id, n_buffers = HEADER.unpack(head)
                if magic != MAGIC or kind != REQUEST or n_buffers != 0:
                    raise WireError(f"not a gateway request frame from {peer}")
                (length,) = lengths_format(0).unpack(await reader.readexactly(lengths_format(0).size))
                if length > MAX_BODY:
                    raise WireError(f"a request of {length} bytes from {peer}")
                target, method, args, kwargs = decode_request(await reader.readexactly(length))
                call = asyncio.ensure_future(self._answer(writer, lock, request_id, target, method, args, kwargs))
                _RUNNING.add(call)  # held until done: a call runs on even if the rank hangs up (as Dask's do)
                call.add_done_callback(_RUNNING.discard)
        except (WireError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError) as e:
            logger.info("gateway: dropped the connection from %s (%s: %s)", peer, type(e).__name__, e)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        lock: asyncio.Lock,
        request_id: int,
        target: str,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> None:
        value, error = await self._call(target, method, args, kwargs)
        with contextlib.suppress(ConnectionError, RuntimeError):  # the rank hung up meanwhile
            async with lock:
                writer.writelines(_answer(request_id, value, error))
                await writer.drain()

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
