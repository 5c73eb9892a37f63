"""A compiled, cache-friendly transpose of the planner's (steps, sources) grids.

NumPy copies a transposed C-ordered grid (`np.ascontiguousarray(a.T)`) element by element in the source's
order, so every read or write of a tall grid with a few hundred columns is another cache line: 300 sources x
33K steps of float64 took 0.28 s a copy. Copying square tiles of 64 x 64 keeps both sides in cache (a copy is
exact: the same bytes as NumPy's).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["transpose_into", "transposed"]

_TILE = 64
_SMALL = 1 << 14
"""Grids of fewer cells are copied by NumPy (no kernel dispatch for tiny ones)."""


@njit
def _transpose_into(a: np.ndarray, out: np.ndarray) -> None:
    """out[j, i] = a[i, j], a tile of _TILE x _TILE at a time."""
    n, m = a.shape
    for i0 in range(0, n, _TILE):
        i1 = min(n, i0 + _TILE)
        for j0 in range(0, m, _TILE):
            j1 = min(m, j0 + _TILE)
            for j in range(j0, j1):
                for i in range(i0, i1):
                    out[j, i] = a[i, j]


def transposed(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `a.T` for a 2-d array: np.ascontiguousarray(a.T) bit for bit, tiled."""
    if a.ndim != 2:
        raise ValueError(f"transposed takes a 2-d array, got {a.ndim} dimensions")
    if a.size < _SMALL or a.dtype.kind not in "iuf":
        return np.ascontiguousarray(a.T)
    src = np.ascontiguousarray(a)
    out = np.empty((a.shape[1], a.shape[0]), dtype=a.dtype)
    _transpose_into(src, out)
    return out


def transpose_into(a: np.ndarray, out: np.ndarray) -> None:
    """out[...] = a.T for a 2-d `a` and an `out` of a's transposed shape and dtype (a view, strided or not), tiled
    where it is large."""
    if a.ndim != 2 or out.shape != a.shape[::-1] or out.dtype != a.dtype:
        raise ValueError(f"transpose_into: {a.shape} {a.dtype} into {out.shape} {out.dtype}")
    if a.size < _SMALL or a.dtype.kind not in "iuf":
        out[...] = a.T
        return
    _transpose_into(a, out)
