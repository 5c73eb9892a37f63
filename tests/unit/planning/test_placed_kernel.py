"""The compiled manifest order of a block's placed pieces (balance._placed_kernel) against the NumPy code it
replaces (gathers, a search and a stable lexsort by step, slot and phase), on random dealt blocks with split
pieces, unplaced items and long-lane items."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning.balance._placed_kernel import placed_rows


def _placed_numpy(fd, nb: int, pieces: np.ndarray, off: np.ndarray, mb: int):  # type: ignore[no-untyped-def]
    """_block._placed before placed_rows (the oracle): the block's placed pieces in manifest order (step, slot,
    then placement order: long items, LPT order, split pieces)."""
    dp = fd.cost3.shape[1]
    long_idx, order = fd.long_idx[: fd.long_cut[nb]], fd.order[: fd.cut[nb]]
    whole = np.concatenate([long_idx, order]) if len(long_idx) else order
    phase = np.concatenate([np.zeros(len(long_idx), np.int64), np.ones(len(order), np.int64)])
    keep = fd.p_rank[whole] >= 0
    item, phase = whole[keep], phase[keep]
    step = np.searchsorted(off, item, side="right") - 1
    delta = np.zeros(len(item), dtype=np.int64)
    plen, rank, mbs = fd.length[item], fd.p_rank[item], fd.p_mb[item]
    if len(pieces):
        p_step = pieces[:, 0]
        item = np.concatenate([item, pieces[:, 1] + off[p_step]])
        step = np.concatenate([step, p_step])
        phase = np.concatenate([phase, np.full(len(pieces), 2, np.int64)])
        delta = np.concatenate([delta, pieces[:, 2]])
        plen = np.concatenate([plen, pieces[:, 3]])
        rank = np.concatenate([rank, pieces[:, 4]])
        mbs = np.concatenate([mbs, pieces[:, 5]])
    o = _lexsort_small([phase, rank * mb + mbs, step], [3, dp * mb, nb])
    return step[o], item[o], delta[o], plen[o], rank[o], mbs[o]


def _lexsort_small(keys: list[np.ndarray], sizes: list[int]) -> np.ndarray:
    """np.lexsort(keys) (last key primary) of non-negative keys below `sizes`: one stable 16-bit radix pass a
    key (least significant first) where all fit 16 bits, several times faster than one stable int64 sort."""
    if max(sizes) > 1 << 16:
        return np.lexsort(keys)
    o = np.argsort(keys[0].astype(np.uint16), kind="stable")
    for k in keys[1:]:
        o = o[np.argsort(k.astype(np.uint16)[o], kind="stable")]
    return o


class _Fd:
    """The FlatDeal fields _placed reads."""

    def __init__(self, rng: np.random.Generator, nb: int, dp: int, mb: int) -> None:
        ns = rng.integers(1, 12, nb)
        self.off = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
        n = int(self.off[-1])
        is_long = rng.random(n) < 0.15
        self.long_idx = np.flatnonzero(is_long).astype(np.int64)
        self.long_cut = np.searchsorted(self.long_idx, self.off)
        short = np.flatnonzero(~is_long)
        step = np.searchsorted(self.off, short, side="right") - 1
        order = []
        for s in range(nb):  # a dealing order within each step (any permutation of its short items)
            mine = short[step == s]
            order.append(mine[rng.permutation(len(mine))])
        self.order = np.concatenate(order).astype(np.int64)
        self.cut = np.concatenate([[0], np.cumsum([len(o) for o in order])]).astype(np.int64)
        self.p_rank = np.where(rng.random(n) < 0.1, -1, rng.integers(0, dp, n)).astype(np.int64)
        self.p_mb = np.where(self.p_rank < 0, -1, rng.integers(0, mb, n)).astype(np.int64)
        self.length = rng.integers(1, 100, n).astype(np.int64)
        self.cost3 = np.zeros((nb, dp, mb))


@pytest.mark.parametrize("seed", range(30))
def test_placed_rows_match_the_numpy_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nb, dp, mb = int(rng.integers(1, 40)), int(rng.choice([1, 2, 5, 64])), int(rng.integers(1, 5))
    fd = _Fd(rng, nb, dp, mb)
    used = int(rng.integers(1, nb + 1))  # a block cut short (a step that deferred): only its first steps
    n_p = int(rng.choice([0, 1, 30]))
    p_step = np.sort(rng.integers(0, used, n_p))
    pieces = np.stack(
        [
            p_step,
            rng.integers(0, 5, n_p) % np.diff(fd.off)[p_step],
            rng.integers(0, 50, n_p),
            rng.integers(1, 50, n_p),
            rng.integers(0, dp, n_p),
            rng.integers(0, mb, n_p),
        ],
        axis=1,
    ).astype(np.int64)
    off = fd.off[: used + 1]
    want = _placed_numpy(fd, used, pieces, off, mb)
    got = placed_rows(
        fd.long_idx[: fd.long_cut[used]],
        fd.order[: fd.cut[used]],
        fd.p_rank,
        fd.p_mb,
        fd.length,
        off,
        pieces,
        used,
        dp,
        mb,
    )
    for w, g in zip(want, got, strict=True):
        assert g.dtype == np.int64 and np.array_equal(g, w)
