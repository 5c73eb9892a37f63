"""Compiled passes of planning._counts: a block's placed pieces summed into its nonzero (step, source) cells,
step-major with sources ascending within a step (the order report/sources.parquet stores them in), and the
cells' per-source and per-step sums."""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["dense_cells", "piece_cells", "source_sums", "step_sums"]

_DE_BRUIJN = np.uint64(0x03F79D71B4CB0A89)
"""A de Bruijn sequence: the top 6 bits of (a word with one bit set) x this tell the bit (through _BIT_INDEX)."""
_BIT_INDEX = np.zeros(64, dtype=np.int64)
for _j in range(64):
    _BIT_INDEX[((int(_DE_BRUIJN) << _j) & ((1 << 64) - 1)) >> 58] = _j


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
    ascending within a step: written to out_src / out_val (room for len(step) + 1: a cell is written before it is
    known to be nonzero), each step's number of cells to per_step[0:steps]; returns (the number of cells, the
    largest). `row`: int64 (sources,) zeros, left zero. A step's pieces are added into `row` (in cache) and their
    sources marked in a bitmap, whose set bits, read lowest first, give the touched sources in order: no sort
    and no scan of every source."""
    n_src = len(row)
    bits = np.zeros((n_src + 63) >> 6, dtype=np.uint64)
    one = np.uint64(1)
    c, i, n, most = 0, 0, len(step), 0
    for t in range(steps):
        c0 = c
        lo, hi = len(bits), -1  # the words touched
        while i < n and step[i] == t:
            k = int(src[i])
            word = k >> 6
            bits[word] |= one << np.uint64(k & 63)
            lo, hi = min(lo, word), max(hi, word)
            row[k] += count[i]
            i += 1
        for w in range(lo, hi + 1):
            b = bits[w]
            while b:
                low = b & (~b + one)  # the lowest set bit
                k = (w << 6) + int(_BIT_INDEX[np.int64((low * _DE_BRUIJN) >> np.uint64(58))])
                v = row[k]
                out_src[c] = k
                out_val[c] = v
                c += v != 0  # a source whose pieces hold no tokens places none
                most = max(most, v)
                row[k] = 0
                b ^= low
            bits[w] = 0
        per_step[t] = c - c0
    return c, most


@njit
def dense_cells(block: np.ndarray, out_src: np.ndarray, out_val: np.ndarray, per_step: np.ndarray) -> tuple[int, int]:
    """piece_cells of a dense (steps, sources) block of counts (out_src / out_val: room for its cells + 1)."""
    c, most = 0, 0
    for t in range(block.shape[0]):
        c0 = c
        for k in range(block.shape[1]):
            v = block[t, k]
            out_src[c] = k
            out_val[c] = v
            c += v != 0
            most = max(most, v)
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
