"""A rank's connection to its constructor through the worker's rank gateway (`execution._gateway`).

Stdlib sockets and ssl only: no Dask client in the rank (no scheduler connection, no event-loop
thread, ~20 MiB less private memory per rank). Calls look like the actor's (`take_steps(...)`
returns something with `.result(timeout)`); answers are received, by the thread that waits for one,
into the buffers their arrays then live in. A broken connection fails every call in flight and every
later one with ConnectionError (the StreamClient re-reads serve.json and connects again); an error
the constructor raised is raised by `result`.

On the gateway's host the same frames travel over its Unix socket (`local=`), without TLS: the rank checks
that the socket's folder belongs to its own user and is closed to others, and that the process answering runs
as its own user (SO_PEERCRED), so a forged serve.json cannot make it unpickle another user's answers
(`LocalRefused`; the StreamClient then uses TLS).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import ssl
import sys
import time
from pathlib import Path
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
from loomdata.execution.protocol import foreign_folder, peer_uid

__all__ = ["DirectConstructor", "LocalRefused"]


class LocalRefused(ConnectionError):
    """A same-host gateway socket this rank will not use: not its user's, open to others, or answered by another uid."""


class _Answer:
    """The answer to one call: filled in when the connection reads its frame (in the caller's thread)."""

    __slots__ = ("_conn", "_done", "_error", "_value")

    def __init__(self, conn: DirectConstructor) -> None:
        self._conn = conn
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error, self._done = value, error, True

    def result(self, timeout: float | None = None) -> Any:
        """The call's value; TimeoutError if none came within `timeout` s; what the call raised."""
        self._conn._read_until(self, timeout)
        if self._error is not None:
            raise self._error
        return self._value


class DirectConstructor:
    """Calls to the constructor published as `target`, over one connection to `address` (tls:// or tcp://),
    or to the same gateway's Unix socket `local` (on its host: no TLS; `address` still names the gateway).

    Single-threaded on purpose: an SSL connection must not be read and written by two threads at once
    (OpenSSL's rule), so answers are read by whoever waits for one (`result`), frame by frame, keeping a
    partly received frame across timeouts; answers to other calls (sent ahead) are kept for them.
    """

    def __init__(
        self,
        address: str,
        target: str,
        ssl_context: ssl.SSLContext | None,
        timeout: float,
        gateway_id: str | None = None,
        local: str | None = None,
    ) -> None:
        """`gateway_id`: the id serve.json names for the gateway at `address` (`StreamClient` compares it later).

        `local`: connect to this Unix socket of the gateway instead (LocalRefused when it is not this user's).
        """
        scheme, _, rest = address.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme not in ("tls", "tcp") or not port.isdigit():
            raise ValueError(f"not a gateway address: {address!r}")
        sock: socket.socket
        if local is not None:
            sock = _connect_local(local, timeout)
        else:
            if scheme == "tls" and ssl_context is None:
                raise ValueError(f"gateway {address} speaks TLS: pass an ssl context")
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme == "tls":
                assert ssl_context is not None
                sock = ssl_context.wrap_socket(sock)
        self.address, self.target, self.gateway_id, self.local = address, target, gateway_id, local
        self.key = f"{address}/{target}"
        self._sock = sock
        self._ids = itertools.count(1)
        self._pending: dict[int, _Answer] = {}
        self._broken: BaseException | None = None
        self._frame = _Frame()

    def take_steps(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._call("take_steps", args, kwargs)

    def take_block(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._call("take_block", args, kwargs)

    def take(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._call("take", args, kwargs)

    def record_telemetry(self, *args: Any, **kwargs: Any) -> _Answer:
        return self._call("record_telemetry", args, kwargs)

    def close(self) -> None:
        """Close the connection; calls not answered yet fail with ConnectionError."""
        self._fail(ConnectionError(f"connection to {self.address} closed"))
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    # ---- internals ------------------------------------------------------------------------------

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Answer:
        answer = _Answer(self)
        if self._broken is not None:
            answer.set(None, ConnectionError(f"gateway {self.address}: {self._broken}"))
            return answer
        request_id = next(self._ids)
        self._pending[request_id] = answer
        try:
            self._sock.settimeout(None)
            self._sock.sendall(encode_request(request_id, self.target, method, list(args), kwargs))
        except OSError as e:
            self._fail(e)
        return answer

    def _read_until(self, answer: _Answer, timeout: float | None) -> None:
        """Read frames until `answer` has one (TimeoutError after `timeout` s; a partial frame is kept)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not answer._done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no answer from {self.address} within {timeout}s")
            try:
                self._sock.settimeout(left)
                done = self._frame.feed(self._sock, self.address)
            except TimeoutError:
                continue
            except (OSError, WireError, ValueError, EOFError) as e:
                self._fail(e)
                continue
            if done is not None:
                self._deliver(*done)

    def _deliver(self, kind: int, request_id: int, value: Any) -> None:
        answer = self._pending.pop(request_id, None)
        if answer is None:  # an abandoned call: dropped
            return
        if kind == ERROR:
            answer.set(None, value)
        else:
            answer.set(value, None)

    def _fail(self, error: BaseException) -> None:
        if self._broken is None:
            self._broken = error
        pending, self._pending = self._pending, {}
        for answer in pending.values():
            answer.set(None, ConnectionError(f"gateway {self.address}: {error}"))


def _connect_local(path: str, timeout: float) -> socket.socket:
    """A connection to a gateway's Unix socket, once its folder and its server are known to be this user's."""
    why = foreign_folder(Path(path).parent)  # gone (a worker since stopped): OSError, the rank uses TLS
    if why is not None:
        raise LocalRefused(
            f"gateway socket folder {why}: this serve.json was not written by your `loom serve` (the rank uses TLS)"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise LocalRefused(f"gateway socket {path} is served by uid {uid}, not this rank's uid {os.getuid()}")
    except BaseException:
        sock.close()
        raise
    return sock


RECYCLE_BYTES = 64 * 1024
"""Receive buffers this large or larger are recycled (`_Recycled`): smaller ones come from the C heap's free lists."""

RECYCLE_KEEP = 2
"""Large receive buffers a connection keeps for reuse (the answer being consumed and the one sent ahead). Session 25,
300 sources x 16 ranks at the warm step of `benchmarks/memory.py` (results/memory_n300_r16_s25_recycle_*.json): the
ranks above idle torch held 37.1-38.6 MiB with none, 44.6-44.7 with 2 and 45.4-53.1 with 3, and the whole serving
side 401-409 / 408-411 / 413-422 MiB, so 3 broke the 13.5x memory bound (419 MiB) in one run of three; page faults a
rank at 1 consumer: none 12,170, 3 about 2,400 (stream_throughput_s25_rank_ab2/3.json); 2: see
stream_throughput_s25_keep2_vs_off.json. The bound: at most this many buffers of RECYCLE_BYTES..RECYCLE_MAX_BYTES held
idle a connection (a take's largest array, about steps x micro_batches x seq_len x 4 bytes for text), and a delivered
array may keep a buffer of up to twice its own size alive while the caller holds it."""

RECYCLE_MAX_BYTES = 8 << 20
"""Buffers above this size are not kept for reuse (a large image block's arrays would otherwise stay held idle)."""


def _refs(buffers: list[bytearray], i: int) -> int:
    """sys.getrefcount of buffers[i] as `_Recycled.get` sees it: the probe and the check share this code shape."""
    buf = buffers[i]
    return sys.getrefcount(buf)


def _free_refs() -> int | None:
    """The count `_refs` gives a buffer nothing else holds, measured on this interpreter, or None where a count cannot
    tell (no GIL, or an interpreter whose borrowed references leave one more holder uncounted: CPython 3.14 loads
    locals without a reference, gh-130704): then nothing is recycled rather than reuse a buffer someone still reads."""
    if getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        return None
    probe = [bytearray(1)]
    free = _refs(probe, 0)
    view = memoryview(probe[0])
    held = _refs(probe, 0)
    view.release()
    return free if held == free + 1 else None


_FREE_REFS = _free_refs()


class _Recycled:
    """Large receive buffers, used again for a later answer once nothing refers to them any more.

    An answer's arrays live in the buffers it was received into, so a fresh buffer each answer is fresh memory
    each answer: every page of it faults in when the socket writes it (one minor fault a 4 KiB page, ~2.6 us on
    this machine's VMs; 12,000 a rank at 3,000 steps of 4,096 tokens, as much CPU as the rank's own unpacking). A
    buffer is free again when the batches (and tensors) made of it are gone: an array or memoryview over a bytearray
    holds a reference to it, so only this list's reference left means nobody can see its bytes (CPython's reference
    count, as measured at import by `_free_refs`; recycling is off where it cannot be; a training loop that keeps a
    batch keeps its buffer out of reuse). At most `keep` are kept, none above RECYCLE_MAX_BYTES."""

    __slots__ = ("_buffers", "keep", "reused")

    def __init__(self, keep: int = RECYCLE_KEEP) -> None:
        self._buffers: list[bytearray] = []
        self.keep = keep if _FREE_REFS is not None else 0
        self.reused = 0

    def get(self, n: int) -> bytearray | memoryview:
        """A buffer of `n` bytes: a recycled one (its first `n` bytes) if one of n..2n bytes is free, else a new one."""
        if n < RECYCLE_BYTES or n > RECYCLE_MAX_BYTES or not self.keep:
            return bytearray(n)
        buffers = self._buffers
        for i in range(len(buffers)):  # (not `enumerate`: its reused result tuple would hold one more reference)
            if n <= len(buffers[i]) <= 2 * n and _refs(buffers, i) == _FREE_REFS:  # nothing else holds it
                self.reused += 1
                buf = buffers.pop(i)
                buffers.append(buf)  # most recently used last: the oldest are dropped first
                return buf if len(buf) == n else memoryview(buf)[:n]
        buf = bytearray(n)
        buffers.append(buf)
        if len(buffers) > self.keep:
            del buffers[0]  # freed once its arrays are
        return buf


class _Frame:
    """One answer frame being received: header, lengths, body, buffers, each into a buffer of its own (large ones
    recycled, `_Recycled`)."""

    def __init__(self) -> None:
        self.recycled = _Recycled()
        self._reset()

    def _reset(self) -> None:
        self._parts: list[bytearray | memoryview] = [bytearray(HEADER.size)]
        self._got = 0  # bytes of the last part received so far
        self._stage = 0  # 0 header, 1 lengths, 2 body and buffers
        self._head: tuple[int, int, int] = (0, 0, 0)  # kind, request id, buffers

    def feed(self, sock: socket.socket, address: str) -> tuple[int, int, Any] | None:
        """Receive what is available of the frame (blocking up to the socket's timeout); the frame when whole."""
        part = self._parts[-1]
        if self._got < len(part):
            k = sock.recv_into(memoryview(part)[self._got :])
            if k == 0:
                raise ConnectionError(f"gateway {address} closed the connection")
            self._got += k
        while self._got == len(self._parts[-1]):
            if self._stage == 0:
                magic, kind, request_id, n_buffers = HEADER.unpack(self._parts[0])
                if magic != MAGIC or kind not in (ANSWER, ERROR):
                    raise WireError(f"gateway {address} sent a frame that is not an answer")
                self._head = (kind, request_id, n_buffers)
                self._stage, self._got = 1, 0
                self._parts.append(bytearray(lengths_format(n_buffers).size))
            elif self._stage == 1:
                self._lengths = list(lengths_format(self._head[2]).unpack(self._parts[1]))
                self._stage, self._got = 2, 0
                self._parts.append(bytearray(self._lengths.pop(0)))
            elif self._lengths:
                self._got = 0
                self._parts.append(self.recycled.get(self._lengths.pop(0)))
            else:
                kind, request_id, _ = self._head
                value = decode_answer(self._parts[2], self._parts[3:])
                self._reset()
                return kind, request_id, value
        return None
