"""Compiled membership repair (planning._mixture._repair): one pass over the steps, deferring segments of the
source most ahead of its target until each step fits its slots.

Per step it sums the sources' short-lane tokens and long-lane segments between the repaired pointer row before
the step and the nearest row after it (integers: exact); a step that overflows defers, one segment at a time,
from the source whose count is furthest ahead of its target (the first such source on ties), as the
per-step loop it replaces did.
"""

from __future__ import annotations

import numpy as np
from numba.typed import List

from loomdata.planning._jit import njit

__all__ = ["repair_rows", "typed_columns"]


def typed_columns(columns: list[np.ndarray]) -> List:
    """The per-source int64 columns as the typed list a kernel takes (no copies)."""
    out = List()
    for c in columns:
        out.append(c)
    return out


@njit
def repair_rows(
    ptr: np.ndarray,
    targets: np.ndarray,
    cum: List,
    short_of: List,
    long_of: List,
    slots: np.ndarray,
    seq_len: int,
) -> None:
    """Rewrite ptr[t + 1] (nearest pointers on entry) for every step t that overflows its slots; long_of[k] is
    empty for a source without a long lane."""
    steps, n_src = ptr.shape[0] - 1, ptr.shape[1]
    r = np.empty(n_src, dtype=np.int64)
    ahead = np.empty(n_src)
    for t in range(steps):
        short = n_long = 0
        for k in range(n_src):
            p, q = ptr[t, k], ptr[t + 1, k]
            short += short_of[k][q] - short_of[k][p]
            if len(long_of[k]):
                n_long += long_of[k][q] - long_of[k][p]
        sl = slots[t]
        if n_long <= sl and short <= (sl - n_long) * seq_len:
            continue
        for k in range(n_src):
            r[k] = ptr[t + 1, k]
            ahead[k] = cum[k][r[k]] - targets[t, k] if r[k] > ptr[t, k] else -np.inf
        while True:
            k = int(np.argmax(ahead))
            rk = r[k]
            short -= short_of[k][rk] - short_of[k][rk - 1]
            if len(long_of[k]):
                n_long -= long_of[k][rk] - long_of[k][rk - 1]
            rk -= 1
            r[k] = rk
            ahead[k] = cum[k][rk] - targets[t, k] if rk > ptr[t, k] else -np.inf
            if n_long <= sl and short <= (sl - n_long) * seq_len:
                break
        ptr[t + 1] = r
