"""The baseline's sequences: a step's segments shuffled (seeded by step), packed next-fit per lane.

Sequence ids are numbered in stream order (by the position of each sequence's first segment in the
shuffled order); deal_baseline deals them round-robin. `baseline_sequences_many` does a block of steps
with one next_fit per lane: the steps' shuffled segments are laid end to end with a separator of exactly
one sequence's capacity before each step's first segment, so no sequence spans two steps and every
step's ids come out as they do alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.planning._packing import Lanes, next_fit

__all__ = ["baseline_sequences_many", "deal_baseline"]

_BASELINE_SALT = 0xBA5E


def _perm(t: int, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, _BASELINE_SALT, t]).permutation(n)


def baseline_sequences_many(
    ts: Sequence[int], seed: int, steps: Sequence[tuple[np.ndarray, np.ndarray]], lanes: Lanes
) -> list[np.ndarray]:
    """Baseline sequence id of every segment of steps ts (their (length, lane) each): shuffled (seeded by step),
    next-fit per lane, sequences numbered in stream order within each step."""
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


def deal_baseline(seq_of_item: np.ndarray, item_cost: np.ndarray, dp: int, micro_batches: int) -> np.ndarray:
    """Per-rank time of the baseline for the step's tokens: sequences dealt round-robin (j to rank j % dp).

    The baseline packs less densely, so it may need more or fewer sequences (n) than the step's
    dp * micro_batches slots. In steady state each rank runs micro_batches of its sequences per step and
    the step's tokens take n / (dp * micro_batches) steps: a rank's time is its cost scaled to
    micro_batches sequences, times that step count. This neither penalises the baseline for the
    planner's fill nor lets it overfill a step.
    """
    n_seq = int(seq_of_item.max()) + 1 if len(seq_of_item) else 0
    seq_cost = np.bincount(seq_of_item, weights=item_cost, minlength=n_seq)
    rank_of_seq = np.arange(n_seq) % dp
    cost = np.bincount(rank_of_seq, weights=seq_cost, minlength=dp)
    count = np.bincount(rank_of_seq, minlength=dp)
    per_step = cost * micro_batches / np.maximum(count, 1)
    return per_step * (n_seq / (dp * micro_batches))
