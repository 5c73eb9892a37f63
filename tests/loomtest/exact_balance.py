"""Exact per-step optimum of tiny balancing instances by enumeration (test reference, no solver).

Every assignment of n <= 10 whole segments to dp <= 3 ranks is enumerated (dp ** n rows, NumPy), in
order of its most loaded rank's cost; the first whose every rank's segments pack into micro_batches
<= 2 sequences of seq_len tokens is the optimum of the per-step problem without splitting.
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["exact_max"]


def _packs(lengths: np.ndarray, micro_batches: int, seq_len: int) -> bool:
    """Whether these segments fit into micro_batches sequences of seq_len tokens (micro_batches 1 or 2)."""
    total = int(lengths.sum())
    if micro_batches == 1 or total <= seq_len:
        return total <= seq_len
    if total > 2 * seq_len:
        return False
    sums = {0}
    for x in lengths.tolist():
        sums |= {s + x for s in sums if s + x <= seq_len}
    return any(total - s <= seq_len for s in sums)


def exact_max(length: np.ndarray, cost: np.ndarray, *, dp: int, micro_batches: int, seq_len: int) -> float:
    """The smallest possible maximum rank cost over whole-segment assignments that fit (inf if none fits)."""
    if micro_batches not in (1, 2) or dp > 3 or len(length) > 10:
        raise ValueError("exact_max enumerates dp <= 3 ranks, <= 10 segments and 1 or 2 micro-batches only")
    n = len(length)
    grid = np.array(list(itertools.product(range(dp), repeat=n)), dtype=np.int64).reshape(-1, n)
    loads = np.zeros((len(grid), dp))
    for r in range(dp):
        loads[:, r] = ((grid == r) * cost[None, :]).sum(axis=1)
    top = loads.max(axis=1)
    for i in np.argsort(top, kind="stable"):
        if all(_packs(length[grid[i] == r], micro_batches, seq_len) for r in range(dp)):
            return float(top[i])
    return float("inf")
