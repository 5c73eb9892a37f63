"""glibc's allocator through one handle on the C library: its heap thresholds and `malloc_trim` (no-ops elsewhere).

Serving workers (`execution._heap.arrays_in_heap`, `execution._heap.maybe_trim`), the planner
(`planning._allocator`) and a training rank (`client._trim.RankTrim`) all call it. It imports nothing of loomdata
and nothing beyond ctypes, so planning still imports nothing of execution and a rank stays lean.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["TRIM_EVERY_S", "glibc", "set_heap_thresholds", "set_mmap_threshold", "trim"]

TRIM_EVERY_S = 2.0
"""The shortest time between two rate-limited trims of one process's heap (a serving worker's or a rank's)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it has mallopt and malloc_trim), else None; loaded once."""
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's soname: anything else is not glibc
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def _mallopt(param: int, value: int) -> bool:
    libc = glibc()
    return libc is not None and libc.mallopt(param, value) == 1  # mallopt returns 1 on success, 0 on error


def set_mmap_threshold(nbytes: int) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes): blocks below `nbytes` come from the heap, not a fresh mmap each (this also
    turns glibc's adaptive threshold off); whether it took (False elsewhere than glibc)."""
    return _mallopt(_M_MMAP_THRESHOLD, nbytes)


def set_heap_thresholds(nbytes: int) -> bool:
    """mallopt of both M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to `nbytes` (both are tried): blocks below `nbytes` come
    from the heap, and up to `nbytes` free at its top stays there; whether both took (False elsewhere than glibc)."""
    mmap = set_mmap_threshold(nbytes)
    top = _mallopt(_M_TRIM_THRESHOLD, nbytes)
    return mmap and top


def trim() -> bool:
    """malloc_trim(0): every arena's free pages back to the OS; whether it ran (False elsewhere than glibc)."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
