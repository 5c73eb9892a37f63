"""The baseline's sequences: a step's segments shuffled (seeded by step), packed next-fit per lane.

Sequence ids are numbered in stream order (by the position of each sequence's first segment in the
shuffled order); deal_baseline (see _balance) deals them round-robin. `baseline_sequences` does one
step; `baseline_sequences_many` does a block of steps with one next_fit per lane: the steps' shuffled
segments are laid end to end with a separator of exactly one sequence's capacity before each step's
first segment, so no sequence spans two steps and every step's ids come out as they do alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.planning._packing import Lanes, next_fit

__all__ = ["baseline_sequences", "baseline_sequences_many"]

_BASELINE_SALT = 0xBA5E


def _perm(t: int, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, _BASELINE_SALT, t]).permutation(n)


def baseline_sequences(t: int, seed: int, length: np.ndarray, lane: np.ndarray, lanes: Lanes) -> np.ndarray:
    """Baseline sequence id of every segment: shuffled, next-fit per lane, sequences in stream order."""
    n = len(length)
    perm = _perm(t, seed, n)
    seq_local = np.zeros(n, dtype=np.int64)
    firsts = []
    lp = lane[perm]
    offset = 0
    for ln in (0, 1):
        pos = np.flatnonzero(lp == ln)
        if len(pos) == 0:
            continue
        cap = lanes.seq_len if ln == 0 else int(lanes.long_seq_len or 0)
        ids = next_fit(length[perm[pos]], cap)
        seq_local[pos] = ids + offset
        firsts.append(pos[np.flatnonzero(np.diff(ids, prepend=-1))])  # where each sequence starts
        offset += int(ids[-1]) + 1
    first = np.concatenate(firsts)
    rank_of_seq = np.empty(len(first), dtype=np.int64)
    rank_of_seq[np.argsort(first, kind="stable")] = np.arange(len(first))
    out = np.empty(n, dtype=np.int64)
    out[perm] = rank_of_seq[seq_local]
    return out


def baseline_sequences_many(
    ts: Sequence[int], seed: int, steps: Sequence[tuple[np.ndarray, np.ndarray]], lanes: Lanes
) -> list[np.ndarray]:
    """baseline_sequences of steps ts (their (length, lane) each), computed for all of them at once."""
    perms = [_perm(t, seed, len(length)) for t, (length, _) in zip(ts, steps, strict=True)]
    ns = np.array([len(p) for p in perms], dtype=np.int64)
    off = np.zeros(len(ns) + 1, dtype=np.int64)
    np.cumsum(ns, out=off[1:])
    length = np.concatenate([s[0][p] for s, p in zip(steps, perms, strict=True)]).astype(np.int64, copy=False)
    lane = np.concatenate([s[1][p] for s, p in zip(steps, perms, strict=True)])
    step_of = np.repeat(np.arange(len(ns)), ns)
    item_seq = np.zeros(len(length), dtype=np.int64)  # index of the item's sequence in `firsts` order
    firsts = []
    n_seq = 0
    for ln in (0, 1):
        pos = (lane == ln).nonzero()[0]
        if len(pos) == 0:
            continue
        cap = lanes.seq_len if ln == 0 else int(lanes.long_seq_len or 0)
        s = step_of[pos]
        brk = (s[1:] != s[:-1]).nonzero()[0] + 1  # each step's first segment of this lane (but the block's first)
        ids = next_fit(np.insert(length[pos], brk, cap), cap)
        ids = np.delete(ids, brk + np.arange(len(brk)))  # drop the separators (each a sequence of its own)
        new = np.empty(len(ids), dtype=bool)
        new[0] = True
        np.not_equal(ids[1:], ids[:-1], out=new[1:])
        dense = np.cumsum(new) - 1
        item_seq[pos] = dense + n_seq
        firsts.append(pos[new])
        n_seq += int(dense[-1]) + 1
    first = np.concatenate(firsts)
    by_pos = np.argsort(first, kind="stable")
    rank = np.empty(n_seq, dtype=np.int64)
    rank[by_pos] = np.arange(n_seq)  # position in stream order over the block
    rank -= np.searchsorted(first[by_pos], off[:-1])[step_of[first]]  # ... within its step
    seq = rank[item_seq]
    out = []
    for i, p in enumerate(perms):
        o = np.empty(len(p), dtype=np.int64)
        o[p] = seq[off[i] : off[i + 1]]
        out.append(o)
    return out
