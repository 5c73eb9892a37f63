"""Compiled kernels' shared parts: the one numba decorator the planner uses, and small helpers kernels share.

Kernels are `@njit` (nopython, cached next to their module: a process compiles a kernel once, later processes,
Dask workers included, load it from the cache; numba falls back to its user-wide cache dir where the source
folder is not writable). Only planning modules import this (a training rank never imports numba).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

__all__ = ["njit", "stable_argsort"]

F = TypeVar("F", bound=Callable[..., Any])


def njit(fn: F) -> F:
    """numba.njit(cache=True, nogil=True) (nopython: no object mode), typed as the function it wraps."""
    return cast(F, numba.njit(cache=True, nogil=True)(fn))


@njit
def stable_argsort(x: np.ndarray) -> np.ndarray:
    """np.argsort(x, kind="stable") of a 1-d float array: insertion sort when short, merge sort otherwise."""
    n = len(x)
    if n > 32:
        return np.argsort(x, kind="mergesort")
    o = np.arange(n)
    for i in range(1, n):
        j, v = i, o[i]
        while j > 0 and x[o[j - 1]] > x[v]:
            o[j] = o[j - 1]
            j -= 1
        o[j] = v
    return o
