"""Compiled membership repair (planning._mixture._repair): a pass over a chunk of steps, deferring segments
of the source most ahead of its target until each step fits its slots.

Per step it sums the sources' short-lane tokens and long-lane segments between the repaired pointer row before
the step and the nearest row after it (integers: exact); a step that overflows defers, one segment at a time,
from the source whose count is furthest ahead of its target (the first such source on ties), as the
per-step loop it replaces did. The counts come as the chunk's window of every source's stream, laid end to
end (`off`: where each source's window starts; `lo`: the stream position of its first entry).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["repair_rows"]


@njit
def repair_rows(
    ptr: np.ndarray,
    targets: np.ndarray,
    counts: tuple[np.ndarray, np.ndarray, np.ndarray],
    off: tuple[np.ndarray, np.ndarray],
    lo: np.ndarray,
    slots: np.ndarray,
    seq_len: int,
    steps: tuple[int, int],
) -> None:
    """Rewrite ptr[t + 1] (nearest pointers on entry) for every step t of steps[0]..steps[1]-1 that overflows its
    slots. counts: the windows' tokens, short-lane tokens and long-lane segments (a source without a long lane
    has an empty long window); off: where each source's window starts in them (tokens and short, long)."""
    cum, short_of, long_of = counts
    off_s, off_l = off
    n_src = ptr.shape[1]
    r = np.empty(n_src, dtype=np.int64)
    ahead = np.empty(n_src)
    for t in range(steps[0], steps[1]):
        short = n_long = 0
        for k in range(n_src):
            p, q = ptr[t, k] - lo[k], ptr[t + 1, k] - lo[k]
            short += short_of[off_s[k] + q] - short_of[off_s[k] + p]
            if off_l[k + 1] > off_l[k]:
                n_long += long_of[off_l[k] + q] - long_of[off_l[k] + p]
        sl = slots[t]
        if n_long <= sl and short <= (sl - n_long) * seq_len:
            continue
        for k in range(n_src):
            r[k] = ptr[t + 1, k]
            ahead[k] = cum[off_s[k] + r[k] - lo[k]] - targets[t, k] if r[k] > ptr[t, k] else -np.inf
        while True:
            k = int(np.argmax(ahead))
            at = off_s[k] + r[k] - lo[k]
            short -= short_of[at] - short_of[at - 1]
            if off_l[k + 1] > off_l[k]:
                at_l = off_l[k] + r[k] - lo[k]
                n_long -= long_of[at_l] - long_of[at_l - 1]
            r[k] -= 1
            ahead[k] = cum[at - 1] - targets[t, k] if r[k] > ptr[t, k] else -np.inf
            if n_long <= sl and short <= (sl - n_long) * seq_len:
                break
        ptr[t + 1] = r
