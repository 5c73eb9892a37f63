"""Compiled passes of planning._counts: a block's placed pieces summed into its nonzero (step, source) cells,
step-major with sources ascending within a step (the order report/sources.parquet stores them in), and the
cells' per-source and per-step sums."""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["piece_cells", "source_sums", "step_sums"]

_FEW = 8
"""A step's touched sources are sorted (insertion) when fewer than 1/_FEW of the sources, else every source's
slot is read in order (a branch-free scan of a row that stays in cache)."""


@njit
def piece_cells(
    step: np.ndarray,
    src: np.ndarray,
    count: np.ndarray,
    steps: int,
    row: np.ndarray,
    out_src: np.ndarray,
    out_val: np.ndarray,
    per_step: np.ndarray,
) -> tuple[int, int]:
    """The nonzero cells of pieces (step ascending within 0..steps-1, source, count), step after step, sources
    ascending within a step: written to out_src / out_val (room for len(step) + 1: the scan writes one past the
    last cell), each step's number of cells to per_step[0:steps]; returns (the number of cells, the largest).
    `row`: int64 (sources,) zeros, left zero."""
    n_src = len(row)
    seen = np.zeros(n_src, dtype=np.int64)  # step + 1 where a source was last touched
    touched = np.empty(n_src, dtype=np.int64)
    c, i, n, most = 0, 0, len(step), 0
    for t in range(steps):
        m = 0
        while i < n and step[i] == t:
            k = src[i]
            if seen[k] != t + 1:
                seen[k] = t + 1
                touched[m] = k
                m += 1
            row[k] += count[i]
            i += 1
        c0 = c
        if m * _FEW < n_src:
            for q in range(1, m):  # insertion sort of the few touched sources
                x = touched[q]
                p = q - 1
                while p >= 0 and touched[p] > x:
                    touched[p + 1] = touched[p]
                    p -= 1
                touched[p + 1] = x
            for q in range(m):
                k = touched[q]
                v = row[k]
                if v != 0:
                    out_src[c] = k
                    out_val[c] = v
                    c += 1
                    most = max(most, v)
                row[k] = 0
        elif m:
            for k in range(n_src):
                v = row[k]
                out_src[c] = k
                out_val[c] = v
                c += v != 0
                most = max(most, v)
                row[k] = 0
        per_step[t] = c - c0
    return c, most


@njit
def source_sums(src: np.ndarray, value: np.ndarray, out: np.ndarray) -> None:
    """out[src[i]] += value[i] (int64)."""
    for i in range(len(src)):
        out[src[i]] += np.int64(value[i])


@njit
def step_sums(per_step: np.ndarray, value: np.ndarray, out: np.ndarray) -> None:
    """out[t] = the sum of step t's cells (per_step[t] of them, the cells step-major; int64)."""
    c = 0
    for t in range(len(per_step)):
        s = np.int64(0)
        for _ in range(per_step[t]):
            s += np.int64(value[c])
            c += 1
        out[t] = s
