"""Compiled passes over the sparse stream pointers of planning._pointers (one chunk of steps at a time).

A chunk holds, for each source k, the steps (local to the chunk, ascending) at which the source draws and its
pointer after each of them less its pointer before the chunk (`indptr[k]..indptr[k+1]` of `step` and `end`),
and the row at its first step (`base`). Local row i of the chunk (0..rows) is the pointers before the chunk's
step i: for each source `base` plus the `end` of its last entry with step < i (plus 0 if none).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["column_into", "count_changes", "dense_into", "fill_changes", "row_at", "totals_into"]


@njit
def count_changes(rows: np.ndarray, counts: np.ndarray) -> None:
    """counts[k] = the steps i of a dense (steps + 1, sources) block whose row i + 1 differs from row i in k."""
    for i in range(rows.shape[0] - 1):
        for k in range(rows.shape[1]):
            if rows[i + 1, k] != rows[i, k]:
                counts[k] += 1


@njit
def fill_changes(rows: np.ndarray, indptr: np.ndarray, step: np.ndarray, end: np.ndarray) -> None:
    """The entries of a dense block, by source (indptr from count_changes): step i and rows[i + 1, k] - rows[0, k]
    for every change, in step order within a source."""
    n_src = rows.shape[1]
    cursor = indptr[:n_src].copy()
    for i in range(rows.shape[0] - 1):
        for k in range(n_src):
            v = rows[i + 1, k]
            if v != rows[i, k]:
                c = cursor[k]
                step[c] = i
                end[c] = v - rows[0, k]
                cursor[k] = c + 1


@njit
def _first_at_or_after(step: np.ndarray, a: int, b: int, i: int) -> int:
    """The first entry c of step[a:b] (ascending) with step[c] >= i (b if none)."""
    lo, hi = a, b
    while lo < hi:
        mid = (lo + hi) >> 1
        if step[mid] < i:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit
def row_at(indptr: np.ndarray, step: np.ndarray, end: np.ndarray, base: np.ndarray, i: int, out: np.ndarray) -> None:
    """out[k] = local row i of the chunk: source k's pointer before the chunk's step i."""
    for k in range(len(base)):
        a, b = indptr[k], indptr[k + 1]
        c = _first_at_or_after(step, a, b, i)
        out[k] = base[k] + end[c - 1] if c > a else base[k]


@njit
def column_into(
    indptr: np.ndarray, step: np.ndarray, end: np.ndarray, base: np.ndarray, k: int, i0: int, out: np.ndarray
) -> None:
    """out[j] = source k's pointer at local row i0 + j, for j < len(out)."""
    a, b = indptr[k], indptr[k + 1]
    c = _first_at_or_after(step, a, b, i0)
    v = base[k] + end[c - 1] if c > a else base[k]
    for j in range(len(out)):
        row = i0 + j
        while c < b and step[c] < row:
            v = base[k] + end[c]
            c += 1
        out[j] = v


@njit
def dense_into(indptr: np.ndarray, step: np.ndarray, end: np.ndarray, base: np.ndarray, out: np.ndarray) -> None:
    """out[i, k] = local row i (out has the chunk's rows + 1 rows)."""
    n = out.shape[0]
    for k in range(len(base)):
        v = base[k]
        c, b = indptr[k], indptr[k + 1]
        for i in range(n):
            while c < b and step[c] < i:
                v = base[k] + end[c]
                c += 1
            out[i, k] = v


@njit
def totals_into(indptr: np.ndarray, step: np.ndarray, end: np.ndarray, base: np.ndarray, out: np.ndarray) -> None:
    """out[i] = the sum over sources of local row i (int64; out has the chunk's rows + 1 entries)."""
    out[:] = 0
    total = np.int64(0)
    for k in range(len(base)):
        total += np.int64(base[k])
        prev = np.int64(0)
        for c in range(indptr[k], indptr[k + 1]):
            v = np.int64(end[c])
            out[step[c] + 1] += v - prev
            prev = v
    out[0] += total
    for i in range(1, len(out)):
        out[i] += out[i - 1]


@njit
def fill_run_steps(
    indptr: np.ndarray,
    step: np.ndarray,
    end: np.ndarray,
    base: np.ndarray,
    k: int,
    first: int,
    lo: int,
    hi: int,
    shift: int,
    out: np.ndarray,
) -> int:
    """out[v - lo] = first + s + shift for the stream positions v in [lo, hi) that source k draws at the chunk's
    local step s (those from its pointer before s to its pointer after it); returns how many it wrote."""
    a, b = indptr[k], indptr[k + 1]
    prev = np.int64(base[k])
    wrote = np.int64(0)
    for c in range(a, b):
        nxt = np.int64(base[k]) + np.int64(end[c])
        v0 = prev if prev > lo else np.int64(lo)
        v1 = nxt if nxt < hi else np.int64(hi)
        t = first + np.int64(step[c]) + shift
        for v in range(v0, v1):
            out[v - lo] = t
        if v1 > v0:
            wrote += v1 - v0
        prev = nxt
    return int(wrote)
