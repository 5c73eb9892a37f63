"""A serving worker's C heap: arrays kept in it (`arrays_in_heap`), and its freed pages given back to the OS now and
then (glibc `malloc_trim`, `maybe_trim`).

glibc keeps freed memory in its heaps unless it lies at a heap's top: a worker that packs batches and
reads samples all day frees arrays between long-lived objects, and those holes stay resident. At 300
sources and 16 ranks the worker holding the constructor kept 63 MiB free but resident
(`benchmarks/memory.py`, `glibc_heap_mib.free_kept_mib`). `malloc_trim(0)` returns every free page of
every arena (MADV_DONTNEED) in 1-6 ms; `maybe_trim` starts it at most every `TRIM_EVERY_S`, on a thread of
its own, so a read that runs on the worker's event loop never waits for it. A call that comes too soon
schedules one trim at the end of the interval (`_trailing`), so what is freed after the last busy moment
(a constructor releasing taken steps once the ranks stop) is given back too: without it the constructor's
worker kept 8 MiB that one more trim returned (memory.py, warm). Loader reads and constructor takes call
it. Elsewhere than glibc it does nothing. Arrow's buffers are jemalloc's, which returns pages by itself.
`free_kept_mib` (mallinfo2's `fordblks`) counts free chunks whose pages a trim already gave back, so it is
an upper bound of what is resident, not a measure of it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from loomdata import _glibc
from loomdata._glibc import TRIM_EVERY_S
from loomdata.execution._strand import process_threads

__all__ = ["HEAP_ARRAY_BYTES", "TRIM_EVERY_S", "arrays_in_heap", "jemalloc_stats", "maybe_trim"]

_LOCK = threading.Lock()
_LAST = [0.0]
_TRAILING: list[threading.Timer | None] = [None]  # the trim scheduled at the end of the current interval


HEAP_ARRAY_BYTES = 32 << 20
"""Serving workers' arrays below this size come from glibc's heap, not a fresh mmap each, and up to this much free
memory stays at the heap's top between trims (`arrays_in_heap`)."""


@functools.cache
def arrays_in_heap() -> bool:
    """Let this process's arrays up to `HEAP_ARRAY_BYTES` come from glibc's heap and stay there when freed (once;
    nothing elsewhere than glibc); whether glibc took both thresholds (a failure is otherwise ignored).

    Dask's nannies start workers with `MALLOC_TRIM_THRESHOLD_=65536`, which also turns off glibc's adaptive mmap
    threshold: every array over 128 KiB (a build group's block, a loader's answer) was a fresh mmap, page-faulted in
    as it was written, and one freed at the heap's top was given back at once. A worker wrote 200 arrays of 2 MiB in
    0.29 s with 102,600 page faults, 0.012 s with 507 with both thresholds at 32 MiB. Free pages still go back to the
    OS every few seconds (`maybe_trim`, after reads and takes).
    """
    return _glibc.set_heap_thresholds(HEAP_ARRAY_BYTES)  # not glibc: its allocator decides


def maybe_trim(now: float | None = None) -> Future[None] | None:
    """Start a trim of this process's C heap if `TRIM_EVERY_S` passed since the last one (its future), else None."""
    if _glibc.glibc() is None:
        return None
    t = time.monotonic() if now is None else now
    with _LOCK:
        wait = TRIM_EVERY_S - (t - _LAST[0])
        if wait > 0:
            if _TRAILING[0] is None:
                timer = _TRAILING[0] = threading.Timer(wait, _trailing)
                timer.daemon = True
                timer.start()
            return None
        _LAST[0] = t
    return process_threads("loom-heap-trim", 1).submit(_trim)


def _trailing() -> None:
    """The trim a call inside the interval asked for, at its end (on the trim thread)."""
    with _LOCK:
        _TRAILING[0] = None
        _LAST[0] = time.monotonic()
    process_threads("loom-heap-trim", 1).submit(_trim)


def _trim() -> None:
    _glibc.trim()


def jemalloc_stats() -> dict[str, Any] | None:
    """Arrow's jemalloc as it reports itself: byte totals (allocated, active, resident, metadata, mapped, retained)
    and the options in force (`opt`, e.g. tcache, narenas); None where this pyarrow has no jemalloc or its library
    does not export `arrow::jemalloc_stats_print`.

    For measurement (benchmarks, tests), not for a read path: it prints jemalloc's JSON statistics through the
    process's stderr (redirected to a file for the call) and parses them.
    """
    import pyarrow as pa

    try:
        pa.jemalloc_memory_pool()
        lib = ctypes.CDLL(str(Path(pa.__file__).parent / f"libarrow.so.{pa.__version__.split('.')[0]}00"))
        fn = lib._ZN5arrow20jemalloc_stats_printEPKc  # arrow::jemalloc_stats_print(const char*) -> arrow::Status
    except (NotImplementedError, OSError, AttributeError):
        return None
    fn.restype = None
    status = ctypes.create_string_buffer(64)  # the Status returned through a hidden pointer (null state when OK)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            fn(status, b"Jmdablxeh")  # JSON; no merged, destroyed or per-arena sections, bins, extents, mutexes
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    try:
        je = json.loads(text)["jemalloc"]
        out: dict[str, Any] = dict(je["stats"])
        out["opt"] = dict(je.get("opt", {}))
    except (ValueError, KeyError, TypeError):
        return None
    return out
