"""A rank's connection to its constructor through the worker's rank gateway (`execution._gateway`).

Stdlib sockets and ssl only: no Dask client in the rank (no scheduler connection, no event-loop
thread, ~20 MiB less private memory per rank). Calls look like the actor's (`take_steps(...)`
returns something with `.result(timeout)`); one reader thread receives answers into the buffers
their arrays then live in. A broken connection fails every call in flight and every later one with
ConnectionError (the StreamClient re-reads serve.json and connects again); an error the constructor
raised is raised by `result`.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import ssl
import threading
from typing import Any

from loomdata.execution._wire import (
    ANSWER,
    ERROR,
    HEADER,
    MAGIC,
    WireError,
    decode_answer,
    encode_request,
    lengths_format,
)

__all__ = ["DirectConstructor"]


class _Answer:
    """The answer to one call, set by the reader thread."""

    __slots__ = ("_done", "_error", "_value")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def result(self, timeout: float | None = None) -> Any:
        """The call's value; TimeoutError if none came within `timeout` s; what the call raised."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._value


class DirectConstructor:
    """Calls to the constructor published as `target`, over one connection to `address` (tls:// or tcp://)."""

    def __init__(self, address: str, target: str, ssl_context: ssl.SSLContext | None, timeout: float) -> None:
        scheme, _, rest = address.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme not in ("tls", "tcp") or not port.isdigit():
            raise ValueError(f"not a gateway address: {address!r}")
        if scheme == "tls" and ssl_context is None:
            raise ValueError(f"gateway {address} speaks TLS: pass an ssl context")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "tls":
            assert ssl_context is not None
            sock = ssl_context.wrap_socket(sock)
        sock.settimeout(None)
        self.address, self.target = address, target
        self.key = f"{address}/{target}"
        self._sock = sock
        self._ids = itertools.count(1)
        self._pending: dict[int, _Answer] = {}
        self._lock = threading.Lock()
        self._broken: BaseException | None = None
        self._reader = threading.Thread(target=self._read_loop, name=f"loom-rank-{target[-12:]}", daemon=True)
        self._reader.start()

    def take_steps(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._call("take_steps", args, kwargs)

    def take_block(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._call("take_block", args, kwargs)

    def take(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._call("take", args, kwargs)

    def record_telemetry(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._call("record_telemetry", args, kwargs)

    def close(self) -> None:
        """Close the connection; calls in flight fail with ConnectionError."""
        self._fail(ConnectionError(f"connection to {self.address} closed"))
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    # ---- internals ------------------------------------------------------------------------------

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Answer:
        answer = _Answer()
        with self._lock:
            if self._broken is not None:
                answer.set(None, ConnectionError(f"gateway {self.address}: {self._broken}"))
                return answer
            request_id = next(self._ids)
            self._pending[request_id] = answer
            frame = encode_request(request_id, self.target, method, list(args), kwargs)
            try:
                self._sock.sendall(frame)
            except OSError as e:
                self._pending.pop(request_id, None)
                answer.set(None, ConnectionError(f"gateway {self.address}: {e}"))
        return answer

    def _read_loop(self) -> None:
        try:
            while True:
                magic, kind, request_id, n_buffers = HEADER.unpack(self._exact(HEADER.size))
                if magic != MAGIC or kind not in (ANSWER, ERROR):
                    raise WireError(f"gateway {self.address} sent a frame that is not an answer")
                fmt = lengths_format(n_buffers)
                body_len, *buf_lens = fmt.unpack(self._exact(fmt.size))
                body = self._exact(body_len)
                buffers = [self._exact(n) for n in buf_lens]
                value = decode_answer(body, buffers)
                with self._lock:
                    answer = self._pending.pop(request_id, None)
                if answer is None:  # an abandoned call: dropped
                    continue
                if kind == ERROR:
                    answer.set(None, value)
                else:
                    answer.set(value, None)
        except BaseException as e:  # the thread ends; every caller learns why
            self._fail(e if isinstance(e, ConnectionError) else ConnectionError(f"{type(e).__name__}: {e}"))

    def _exact(self, n: int) -> bytearray:
        """Exactly n bytes from the socket, into a buffer of their own (arrays are wrapped around it)."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError(f"gateway {self.address} closed the connection")
            got += k
        return buf

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = error
            pending, self._pending = self._pending, {}
        for answer in pending.values():
            answer.set(None, ConnectionError(f"gateway {self.address}: {error}"))
