"""A Source Loader's shard opens, run ahead of its plan and off its planning lock.

Opening a shard on an object store costs several round trips: the verifier's HEAD and edge reads and
the format's footer (about 0.4 s at 100 ms a request). The planner used to open a chunk's newly met
shards while it held its lock, so a read whose chunk was not planned yet waited for the whole open
(session 6: the one long wait at a fixed step of every 100 ms run). `ShardOpens` instead opens every
shard the plan names as soon as the manifest names it, soonest first use first, at most `limit` shards
at once on the process's read-ahead threads; the planner and the read path wait only for the shards
they need now, and only while those are still opening (a shard needed now starts at once, past the bound).

A shard's open has two parts: what planning needs (its footer: `jobs_of`) and what only the serving of its
bytes needs (the shard check and the object's read handle: `side_of`), run together. Planning, and with it the
read-ahead of the shard's first units, waits only for the first part (`wait`): on an object store the check
is a HEAD and two edge reads one after another, the longest chain of a serve's start (session 8: the first
units were issued one to two round trips later). A read still checks the shard before it uses any of its
bytes (`Verifier.open_shard`, on the read path, waiting for the check running here), and `done`, which tells
whether a read can run without a storage request, is true only once both parts are.

An open that raises is not raised here: the read that needs the shard meets the error again and
reports it, with the verifier's words (the same rule as every read ahead).
"""

from __future__ import annotations

import contextlib
import heapq
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for

import numpy as np

from loomdata.execution._prefetch import shared_threads

__all__ = ["OPENS_IN_FLIGHT", "ShardOpens"]

OPENS_IN_FLIGHT = 8
"""Shards one loader opens ahead at once (each its few requests in parallel); a shard needed now is not bounded."""


Jobs = Callable[[int], Sequence[Callable[[], None]]]
"""The independent jobs of one shard's open (run in parallel)."""


def _done_future() -> Future[None]:
    fut: Future[None] = Future()
    fut.set_running_or_notify_cancel()
    fut.set_result(None)
    return fut


_DONE = _done_future()
"""What a finished open's futures are replaced with: a loader remembers each of its shards' opens for good, and a
Future costs ~1.6 KB (its Condition, lock and waiter deque): 2,400 of them, 1.4 MiB of deques alone, in a worker
serving 150 sources of 4 shards (tracemalloc, benchmarks/memory.py). Whoever waits holds the original."""


class ShardOpens:
    """Opens a loader's shards ahead (`want`, in first-use order) and lets a caller wait for some (`wait`).

    `jobs_of(shard)`: the jobs planning needs (`wait` returns when they are done); `side_of(shard)`: the jobs only
    reading the shard's bytes needs, run alongside (`done` and `settle` count them too).
    """

    def __init__(self, jobs_of: Jobs, limit: int = OPENS_IN_FLIGHT, side_of: Jobs | None = None) -> None:
        self._jobs_of = jobs_of
        self._side_of = side_of
        self._limit = max(int(limit), 1)
        self._lock = threading.Lock()
        self._queue: list[tuple[int, int]] = []  # (first use step, shard), a heap; started shards are skipped
        self._first: dict[int, int] = {}  # queued shard -> the earliest first use asked for
        self._started: dict[int, Future[None]] = {}  # shard -> done when its planning jobs are
        self._whole: dict[int, Future[None]] = {}  # shard -> done when all its jobs (side jobs too) are
        self._running = 0  # started by `want` and not wholly done (what `limit` bounds)
        self._closed = False

    def want(self, shards: np.ndarray, first_steps: np.ndarray) -> None:
        """Open these shards ahead, the earliest first use first (a shard asked again keeps its earliest use)."""
        with self._lock:
            for s, step in zip(np.asarray(shards).tolist(), np.asarray(first_steps).tolist(), strict=True):
                s, step = int(s), int(step)
                if s in self._started or self._first.get(s, step + 1) <= step:
                    continue
                self._first[s] = step
                heapq.heappush(self._queue, (step, s))
        self._start_queued()

    def wait(self, shards: np.ndarray | Sequence[int], timeout: float | None = None) -> bool:
        """Wait until these shards can be planned (their planning jobs done; those not started yet start now).

        False on timeout. Their side jobs (shard checks, read handles) may still run.
        """
        futs = [self._start(int(s), bounded=False) for s in np.unique(np.asarray(shards, dtype=np.int64)).tolist()]
        _, pending = wait_for([f for f in futs if f is not None], timeout)
        return not pending

    def done(self, shards: np.ndarray | Sequence[int]) -> bool:
        """Whether every one of these shards is wholly opened, side jobs too (or failed: the read reports it)."""
        with self._lock:
            return all(
                (f := self._whole.get(int(s))) is not None and f.done()
                for s in np.unique(np.asarray(shards, dtype=np.int64)).tolist()
            )

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no open is queued or running (tests, benchmarks); False on timeout."""
        while True:
            with self._lock:
                futs = [f for f in self._whole.values() if not f.done()]
                queued = bool(self._first) and not self._closed
            if not futs and not queued:
                return True
            _, pending = wait_for(futs, timeout)
            if pending:
                return False

    def close(self) -> None:
        """Open nothing more (opens running finish)."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._first.clear()

    def _start_queued(self) -> None:
        while True:
            with self._lock:
                if self._closed or self._running >= self._limit or not self._queue:
                    return
                _, s = heapq.heappop(self._queue)
                if s in self._started or s not in self._first:
                    continue
            self._start(s, bounded=True)

    def _start(self, shard: int, bounded: bool) -> Future[None] | None:
        """The future of `shard`'s open, started now if it was not (None: closed before it started)."""
        with self._lock:
            fut = self._started.get(shard)
            if fut is not None:
                return fut
            if self._closed:
                return None
            self._first.pop(shard, None)
            fut = self._started[shard] = Future()
            whole = self._whole[shard] = Future()
            for f in (fut, whole):
                f.set_running_or_notify_cancel()
            if bounded:
                self._running += 1
        jobs = list(self._jobs_of(shard))
        side = list(self._side_of(shard)) if self._side_of is not None else []
        left = [len(jobs), len(jobs) + len(side)]  # planning jobs, all jobs not done
        count = threading.Lock()

        def one(job: Callable[[], None], plans: bool) -> None:
            with contextlib.suppress(Exception):  # the read that needs this shard opens it again, reports the error
                job()
            with count:
                left[0] -= plans
                left[1] -= 1
                planned, last = plans and left[0] == 0, left[1] == 0
            if planned:
                self._planned(shard, fut)
            if last:
                self._finish(shard, whole, bounded)

        if not jobs:
            self._planned(shard, fut)
        if not jobs and not side:
            self._finish(shard, whole, bounded)
        pool = shared_threads()
        for job in jobs:
            pool.submit(one, job, True)
        for job in side:
            pool.submit(one, job, False)
        return fut

    def _planned(self, shard: int, fut: Future[None]) -> None:
        with self._lock:
            self._started[shard] = _DONE
        fut.set_result(None)

    def _finish(self, shard: int, whole: Future[None], bounded: bool) -> None:
        with self._lock:
            self._whole[shard] = _DONE
            if bounded:
                self._running -= 1
        whole.set_result(None)
        self._start_queued()
