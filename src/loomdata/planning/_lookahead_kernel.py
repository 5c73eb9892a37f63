"""Compiled natural steps of a run of consecutive stream positions (_lookahead's per-source pass).

`run_steps(col, lo, hi)` is searchsorted(col, arange(lo, hi), "right") - 1 for a non-decreasing `col` with
col[0] <= lo: one binary search for the first step, then one merged walk over the positions and the steps
they span. The NumPy form (each step repeated by how many positions fall in it: a clip, a diff and a repeat
over every step the run spans) costs O(steps) a call: with many sources at small dp a source draws a
fraction of a segment a step (300 sources, dp 4: 166K steps, ~0.2 positions of a source a step), so
the steps dominated. `col` may be a strided column of the (steps + 1, sources) pointer grid.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["run_steps"]


@njit
def run_steps(col: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """(hi - lo,) int64: for v in lo..hi-1 the last step t with col[t] <= v (col non-decreasing, col[0] <= lo)."""
    n = len(col)
    a, b = 0, n
    while a < b:  # first index with col[index] > lo
        mid = (a + b) // 2
        if col[mid] <= lo:
            a = mid + 1
        else:
            b = mid
    t = a - 1
    out = np.empty(max(hi - lo, 0), dtype=np.int64)
    for v in range(lo, hi):
        while t + 1 < n and col[t + 1] <= v:
            t += 1
        out[v - lo] = t
    return out
