"""Per-source work of the serial part of planning (index reads, streams) on a few threads of this process.

Each source's index read and stream are independent of the others' and spend their time in Arrow's decoding
and in compiled kernels that release the GIL (planning._jit.njit is nogil), so on a machine with idle cores
the serial part runs in about the time of its largest source rather than of all of them; the results are
the same objects in the same order whatever the threads (each is a function of its source alone).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from loomdata.planning._allocator import trim_arenas

__all__ = ["PLAN_THREADS_ENV", "per_source", "plan_threads"]

T = TypeVar("T")

PLAN_THREADS_ENV = "LOOM_PLAN_THREADS"
"""Environment variable capping the threads (1: everything on the calling thread); default: the usable cores."""


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


def per_source(fn: Callable[[int], T], n: int) -> list[T]:
    """[fn(0), ..., fn(n-1)], on up to plan_threads() threads; the first source's error (in source order) is
    raised, as a loop would."""
    threads = min(n, plan_threads())
    if threads <= 1:
        return [fn(k) for k in range(n)]
    with ThreadPoolExecutor(threads, thread_name_prefix="loom-plan") as pool:
        out = list(pool.map(fn, range(n)))
    trim_arenas()  # each thread's arena keeps what it freed
    return out
