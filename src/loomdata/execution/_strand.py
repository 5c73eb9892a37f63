"""Serial executors over one bounded thread pool per process: hundreds of loaders, a handful of threads.

A Source Loader needs its work run off the event loop, one job at a time, in submission order (a reader
that is not thread-safe, `close()` after the reads already queued). A thread per loader gives that, but
costs far more than its stack: Arrow's allocator (mimalloc) keeps per-thread heaps whose pages stay
resident (benchmarks/memory.py, 300 sources: the workers held 2,358 MiB warm with a thread per loader,
1,871 MiB with strands and a shared plan, in separate runs). A `Strand` keeps the ordering and runs on the
process's `strand_threads()` instead; strands take turns (one job per turn), so a busy loader cannot starve others.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

__all__ = ["STRAND_THREADS", "Strand", "process_threads", "strand_threads"]

STRAND_THREADS = 8
"""Threads shared by every strand of a process: reads block on storage at most this many at once here."""

T = TypeVar("T")

_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def process_threads(name: str, threads: int) -> ThreadPoolExecutor:
    """This process's pool of `threads` threads named `name` (made on first use, then shared by every caller)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = ThreadPoolExecutor(threads, thread_name_prefix=name)
        return pool


def strand_threads() -> ThreadPoolExecutor:
    """This process's strand threads."""
    return process_threads("loom-strand", STRAND_THREADS)


class Strand(Executor):
    """Runs submitted jobs one at a time, in order, on the shared strand threads (an `Executor`: usable
    with `loop.run_in_executor`). `shutdown` refuses new jobs; the queued ones still run."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._jobs: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False  # a turn is queued on or running in the pool
        self._shut = False
        self._last: Future[Any] | None = None  # the newest job (`shutdown(wait=True)` waits for it)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError(f"strand {self.name!r} is shut down: cannot run {fn!r}")
            self._jobs.append((fut, fn, args, kwargs))
            self._last = fut
            if self._scheduled:
                return fut
            self._scheduled = True
        strand_threads().submit(self._turn)
        return fut

    def _turn(self) -> None:
        """Run the oldest job, then queue another turn behind the other strands' if more are waiting."""
        with self._lock:
            fut, fn, args, kwargs = self._jobs.popleft()
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # the job's caller gets it, as from any executor
                fut.set_exception(e)
        with self._lock:
            if not self._jobs:
                self._scheduled = False
                return
        strand_threads().submit(self._turn)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new jobs (queued ones run, or are cancelled with `cancel_futures`); `wait`: until they are done."""
        with self._lock:
            self._shut = True
            if cancel_futures:
                for fut, *_ in self._jobs:
                    fut.cancel()
            last = self._last
        if wait and last is not None:
            futures_wait([last])  # jobs run in order: the newest done means all are
