"""Per-source work of the serial part of planning (index reads, streams) on a few threads of this process,
where the sources are large enough for threads to pay.

Each source's index read and stream are independent of the others' and spend much of their time in Arrow's
decoding and in compiled kernels that release the GIL (planning._jit.njit is nogil), so on a machine with idle
cores the serial part runs in about the time of its largest source rather than of all of them; the results are
the same objects in the same order whatever the threads (each is a function of its source alone).

Threads cost CPU, though: each source's work also holds the GIL (opening its files, NumPy calls on its
arrays), and two threads hand the GIL back and forth at every release. With small sources that is most of
the work: on this 2-core machine (session 28, `_load_index` alone, 8-10 rounds alternating) 300 sources of
333 rows read in 0.20 CPU-s (0.20 s) on one thread and 0.35 CPU-s (0.27 s) on two; 300 of 33K rows 0.45 CPU-s
(0.46 s) against 0.57 (0.35 s); 30 of 333K rows 0.20 (0.20 s) against 0.23 (0.13 s); 10 of 1M rows 0.17 (0.17 s)
against 0.19 (0.11 s). So the caller passes each source's size and the work stays on the calling thread unless
the sources are THREAD_ROWS (rows) or THREAD_BYTES (index bytes) a source on average.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from loomdata.planning._allocator import trim_arenas

__all__ = ["PLAN_THREADS_ENV", "THREAD_BYTES", "THREAD_ROWS", "parallel", "per_source", "plan_threads"]

T = TypeVar("T")

PLAN_THREADS_ENV = "LOOM_PLAN_THREADS"
"""Environment variable capping the threads (1: everything on the calling thread); default: the usable cores."""

THREAD_ROWS = 1 << 20
"""Mean documents a source from which per-source work (streams) runs on threads (see the module doc)."""

THREAD_BYTES = 1 << 20
"""Mean bytes of a source's index table from which its reading runs on threads: 1 MiB is about 600K rows of the
benchmarks' synthetic indexes (1.7 bytes a row), fewer of an index with checksums."""


def plan_threads() -> int:
    """Threads for per-source work: LOOM_PLAN_THREADS when set, else the cores this process may run on."""
    raw = os.environ.get(PLAN_THREADS_ENV, "").strip()
    if raw:
        try:
            return max(1, int(raw))
        except ValueError as exc:
            raise ValueError(f"{PLAN_THREADS_ENV}={raw!r} is not a whole number of threads (e.g. 1 or 4)") from exc
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def per_source(fn: Callable[[int], T], n: int, sizes: Sequence[int] | None = None, large: int = THREAD_ROWS) -> list[T]:
    """[fn(0), ..., fn(n-1)], on up to plan_threads() threads where the sources' `sizes` average at least `large`
    (no sizes: threads whatever the sizes), else on the calling thread; the first source's error (in source
    order) is raised, as a loop would."""
    threads = min(n, plan_threads())
    if sizes is not None and sum(sizes) < large * n:
        threads = 1
    if threads <= 1:
        return [fn(k) for k in range(n)]
    with ThreadPoolExecutor(threads, thread_name_prefix="loom-plan") as pool:
        out = list(pool.map(fn, range(n)))
    trim_arenas()  # each thread's arena keeps what it freed
    return out


def parallel(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """[task() for task in tasks], each on a thread of its own where there are several (compiled kernels that release
    the GIL: one source's stream cut into parts); the first task's error (in order) is raised. At most plan_threads()
    such tasks run at once in the process (_part_slots), however many callers (per_source's threads, each with a
    large source) ask at once: a many-core host with hundreds of large sources would otherwise start threads x parts
    threads. Callers look it up on this module at call time, so a benchmark can time the tasks."""
    if len(tasks) <= 1:
        return [t() for t in tasks]
    slots = _part_slots()

    def run(task: Callable[[], T]) -> T:
        with slots:
            return task()

    with ThreadPoolExecutor(len(tasks), thread_name_prefix="loom-part") as pool:
        futures = [pool.submit(run, t) for t in tasks]
        return [f.result() for f in futures]


_SLOTS: list[threading.BoundedSemaphore] = []
_SLOTS_LOCK = threading.Lock()


def _part_slots() -> threading.BoundedSemaphore:
    """The process's one semaphore of plan_threads() slots for parallel's tasks (made at first use)."""
    with _SLOTS_LOCK:
        if not _SLOTS:
            _SLOTS.append(threading.BoundedSemaphore(plan_threads()))
        return _SLOTS[0]
