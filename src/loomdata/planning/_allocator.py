"""The planner's two settings of glibc's allocator, through `loomdata._glibc` (no-ops elsewhere).

`plan_heap` sets glibc's heap thresholds once in a planning process whose environment leaves them adaptive;
`tune_allocator` raises the mmap threshold in a Dask worker that balances ranges; `trim_arenas` gives back
what the planning threads' arenas keep once they are done (planning._threads). The serving side has its
own, rate-limited trim (execution._heap) over the same `_glibc`: planning imports nothing of execution.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from loomdata import _glibc

__all__ = ["HEAP_BYTES", "heap_settable", "plan_heap", "trim_arenas", "tune_allocator"]

HEAP_BYTES = 32 << 20
"""plan_heap's mmap and trim thresholds: glibc's largest adaptive mmap threshold (64-bit), which plans reach."""
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def heap_settable(environ: Mapping[str, str]) -> bool:
    """Whether plan_heap may set the thresholds: nobody chose glibc's heap settings through the environment (Dask's
    nannies set MALLOC_TRIM_THRESHOLD_; GLIBC_TUNABLES may name glibc.malloc ones)."""
    return not any(k in environ for k in _MALLOC_ENV) and "glibc.malloc." not in environ.get("GLIBC_TUNABLES", "")


@functools.cache
def plan_heap() -> bool:
    """Set glibc's mmap and trim thresholds to HEAP_BYTES in this process, once, where heap_settable; whether glibc
    took both.

    A fresh process's thresholds start at 128 KB and grow only as mmapped blocks are freed, so until then each
    free at the heap's top above 128 KB gives the pages back and the next allocation faults them in again. A cold
    20-step plan of 10M samples x 300 sources (dp 4) took 97-107K minor page faults against 57K with the thresholds
    set (mostly the streams' per-source temporaries; system time 0.20-0.35 -> 0.14-0.19 CPU-s), peak RSS unchanged;
    the same plan again in that process takes 22-29K either way. The values are about where glibc's own adaptation
    ends after a plan; the planning threads' arenas are still given back at set points (trim_arenas).
    """
    return heap_settable(os.environ) and _glibc.set_heap_thresholds(HEAP_BYTES)


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
