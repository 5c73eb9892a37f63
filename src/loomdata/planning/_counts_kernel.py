"""Compiled passes of planning._counts: a dense block of (steps, sources) counts compressed into a chunk of its
nonzero cells by source, and a chunk's cells scattered back into rows of sources."""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["add_pieces", "count_nonzero", "fill_nonzero", "scatter_sources", "source_sums"]


@njit
def add_pieces(
    rows: np.ndarray, row0: int, step: np.ndarray, src: np.ndarray, count: np.ndarray, a: int, b: int
) -> None:
    """rows[row0 + step[i], src[i]] += count[i] for pieces a..b-1."""
    for i in range(a, b):
        rows[row0 + step[i], src[i]] += count[i]


@njit
def count_nonzero(rows: np.ndarray, counts: np.ndarray) -> None:
    """counts[k] = the nonzero cells of column k of a dense (steps, sources) block."""
    for i in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            if rows[i, k] != 0:
                counts[k] += 1


@njit
def fill_nonzero(rows: np.ndarray, indptr: np.ndarray, step: np.ndarray, value: np.ndarray) -> None:
    """The nonzero cells of a dense block by source (indptr from count_nonzero): their steps (ascending within
    a source) and values."""
    n_src = rows.shape[1]
    cursor = indptr[:n_src].copy()
    for i in range(rows.shape[0]):
        for k in range(n_src):
            v = rows[i, k]
            if v != 0:
                c = cursor[k]
                step[c] = i
                value[c] = v
                cursor[k] = c + 1


@njit
def scatter_sources(
    indptr: np.ndarray, step: np.ndarray, value: np.ndarray, k0: int, i0: int, i1: int, at: int, out: np.ndarray
) -> None:
    """out[k - k0, at + i - i0] = the chunk's cell (local step i, source k) for sources k0..k0+len(out)-1 and
    steps i0..i1-1 (out zeroed by the caller)."""
    for j in range(out.shape[0]):
        k = k0 + j
        for c in range(indptr[k], indptr[k + 1]):
            i = step[c]
            if i0 <= i < i1:
                out[j, at + i - i0] = value[c]


@njit
def source_sums(indptr: np.ndarray, value: np.ndarray, out: np.ndarray) -> None:
    """out[k] += the sum of source k's cells in the chunk (int64)."""
    for k in range(len(indptr) - 1):
        s = np.int64(0)
        for c in range(indptr[k], indptr[k + 1]):
            s += np.int64(value[c])
        out[k] += s
