"""Compiled kernels' shared parts: the one numba decorator the planner uses, and small helpers kernels share.

Kernels are `@njit` (nopython, cached next to their module: a process compiles a kernel once, later processes,
Dask workers included, load it from the cache; numba falls back to its user-wide cache dir where the source
folder is not writable). Only planning modules import this (a training rank never imports numba).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

__all__ = ["njit", "stable_argsort", "stable_argsort_into", "warm_up"]

F = TypeVar("F", bound=Callable[..., Any])
_SHORT = 32
"""stable_argsort sorts arrays up to this long by insertion."""


def njit(fn: F) -> F:
    """numba.njit(cache=True, nogil=True) (nopython: no object mode), typed as the function it wraps."""
    return cast(F, numba.njit(cache=True, nogil=True)(fn))


@njit
def stable_argsort(x: np.ndarray) -> np.ndarray:
    """np.argsort(x, kind="stable") of a 1-d float array: insertion sort when short, merge sort otherwise."""
    if len(x) > _SHORT:
        return np.argsort(x, kind="mergesort")
    o = np.empty(len(x), dtype=np.int64)
    stable_argsort_into(x, o)
    return o


@njit
def stable_argsort_into(x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = stable_argsort(x), allocating nothing where x is short (a loop's reused buffer)."""
    n = len(x)
    if n > _SHORT:
        out[:] = np.argsort(x, kind="mergesort")
        return
    for i in range(n):
        j = i
        while j > 0 and x[out[j - 1]] > x[i]:
            out[j] = out[j - 1]
            j -= 1
        out[j] = i


@njit
def _first_call(x: np.ndarray) -> int:
    """A kernel whose first call sets numba up in this process (warm_up)."""
    return len(x)


_WARMED: list[threading.Thread] = []


def warm_up() -> None:
    """Set numba up in this process (its target context and registries: ~0.3 s, paid by the first kernel call) on
    a thread of its own, once, so it runs beside the index reads instead of on the planner's serial path; a later
    first call waits for it (numba's compiler lock) rather than doing it again. Errors are left to that call."""
    if _WARMED:
        return
    t = threading.Thread(target=_warm, name="loom-numba-warm", daemon=True)
    _WARMED.append(t)
    t.start()


def _warm() -> None:
    with contextlib.suppress(Exception):  # a broken set-up shows at the first real kernel call, with its own error
        _first_call(np.zeros(1))
