"""The planner's two settings of glibc's allocator, through `loomdata._glibc` (no-ops elsewhere).

`tune_allocator` raises the mmap threshold in a Dask worker that balances ranges; `trim_arenas` gives back
what the planning threads' arenas keep once they are done (planning._threads). The serving side has its
own, rate-limited trim (execution._heap) over the same `_glibc`: planning imports nothing of execution.
"""

from __future__ import annotations

import functools

from loomdata import _glibc

__all__ = ["trim_arenas", "tune_allocator"]


@functools.cache
def tune_allocator() -> bool:
    """Let glibc keep freed blocks below 32 MB for reuse (M_MMAP_THRESHOLD) in this worker process, once; whether
    glibc took it.

    Dask starts workers with MALLOC_TRIM_THRESHOLD_ set, which pins glibc's mmap threshold at 128 KB: every
    temporary array of the balancer above that is then a fresh mmap, page-faulted in and unmapped again,
    which costs 1.3-1.5x the CPU of the same balancing in a plain process (measured). Memory is still trimmed
    at the heap top as Dask asks (the trim threshold is left alone).
    """
    return _glibc.set_mmap_threshold(32 << 20)


def trim_arenas() -> None:
    """Return the free memory of every malloc arena to the system (glibc's malloc_trim walks them all): each
    planning thread allocates its temporaries in an arena of its own, which glibc keeps once they are freed
    (measured: +95 MB of RSS left after two 25M-document streams, the plan's peak 29.0 -> 32.0 B a sample)."""
    _glibc.trim()
