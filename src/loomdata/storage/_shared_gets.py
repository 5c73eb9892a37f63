"""Identical range GETs in flight at the same time share one request (`SharedGets`).

A loader opening a Parquet object reads its footer (pyarrow asks for the last 64 KiB) while the shard check reads
the object's last 64 KiB for its fingerprint: the same bytes, asked for at the same moment by two threads, so two
requests where one does (one of the five requests of each shard's open on S3). A later caller joins a request
still in flight and gets its bytes; nothing is kept after it finishes, so no stale bytes are ever served (an
object rewritten between two reads is read twice, as before). A request that fails is not shared: a joiner then
makes its own and meets or reports the error itself, after the first caller's attempts (an error can take two
retry cycles to surface). A first caller that is interrupted (KeyboardInterrupt, SystemExit) raises that in its own
thread only: its joiners make their own requests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["SharedGets"]

T = TypeVar("T")


class _LeaderAborted(Exception):
    """Set on a shared request whose first caller was interrupted (KeyboardInterrupt, SystemExit, a cancelled
    task): its joiners then make their own requests instead of raising the first caller's interrupt."""


class SharedGets:
    """Runs `fn` once for callers asking for the same `key` while a call for it is in flight (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[Hashable, Future[object]] = {}
        self.joined = 0  # calls that waited on another's request (tests, diagnostics)
        self.shared = 0  # of them, those answered by it

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        """`fn()`, or the result of the call of `key` in flight now (a fresh `fn()` if that call fails)."""
        with self._lock:
            fut = self._calls.get(key)
            leader = fut is None
            if fut is None:
                fut = self._calls[key] = Future()
            else:
                self.joined += 1
        if not leader:
            try:
                out = fut.result()
            except Exception:  # the first caller reports its own error: this one tries for itself
                return fn()
            with self._lock:
                self.shared += 1
            return out  # type: ignore[return-value]
        try:
            got = fn()
        except BaseException as e:
            with self._lock:
                self._calls.pop(key, None)
            fut.set_exception(e if isinstance(e, Exception) else _LeaderAborted())
            raise
        with self._lock:
            self._calls.pop(key, None)
        fut.set_result(got)
        return got
