"""Gathering a block's segments from a look-ahead assignment (StepItems._assigned): the columns made once for all
sources are those the per-source code made, value and type."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._items import StepItems
from loomdata.planning._items_kernel import _split_at
from loomdata.planning._lookahead import StepAssignment, segments_at
from loomdata.planning._mixture import build_stream
from loomdata.planning._packing import Lanes
from loomdata.planning._segments import DenseIds, RowIds


def _per_source(items: StepItems, t0: int, t1: int) -> tuple[np.ndarray, ...]:
    """The columns as _gather made them source by source before session 14."""
    parts = []
    for k, st in enumerate(items._streams):
        pos, at = items._asg.range(k, t0, t1)  # type: ignore[union-attr]
        if len(pos) == 0:
            continue
        doc, off, length, lane = segments_at(st, pos, items._tokens[k], items._lanes)
        img = items._image_tokens(k, doc, length)
        ids = np.full(len(pos), k, dtype=np.uint16)
        parts.append((ids, items._samples[k][doc], off, length.astype(np.int64), lane, img, at - t0))
    return tuple(c[0] if len(parts) == 1 else np.concatenate(c) for c in zip(*parts, strict=True))


@pytest.mark.parametrize("images", ["broadcast", "zeros", "some"])
@pytest.mark.parametrize("lanes", [Lanes(seq_len=512), Lanes(seq_len=512, long_seq_len=4096, threshold=1024)])
def test_assigned_columns_are_the_per_source_ones(images: str, lanes: Lanes) -> None:
    rng = np.random.default_rng(len(images))
    n_src, steps = 7, 40
    tokens, streams, samples, image_cols, pos, step = [], [], [], [], [], []
    for k in range(n_src):
        n = int(rng.integers(1, 300)) if k != 3 else 5  # source 3: few segments, absent from most steps
        lengths = rng.integers(1, 3000, n).astype(np.uint32)
        st = build_stream(f"s{k}", 0, lengths, lanes, 1)
        tokens.append(lengths)
        streams.append(st)
        samples.append(DenseIds(n) if k % 2 else (np.arange(n, dtype=np.uint64) * 3 + 1))
        if images == "broadcast":
            image_cols.append(np.broadcast_to(np.zeros(1, np.uint32), (n,)))
        elif images == "zeros":
            image_cols.append(np.zeros(n, dtype=np.uint32))
        else:
            image_cols.append(np.where(rng.random(n) < 0.3, rng.integers(1, 500, n), 0).astype(np.uint32))
        m = len(st.doc)
        pos.append(rng.permutation(m).astype(np.uint32))
        step.append(np.sort(rng.integers(0, steps, m)).astype(np.int32))
    items = object.__new__(StepItems)
    items._samples, items._tokens, items._images = samples, tokens, image_cols
    items._streams, items._lanes, items._asg = streams, lanes, StepAssignment(pos, step)
    for t0, t1 in ((0, steps), (5, 6), (10, 27), (39, 40)):
        got, want = items._assigned(t0, t1), _per_source(items, t0, t1)
        assert len(got) == len(want) == 7
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)


def _items(rng: np.random.Generator, lanes: Lanes, ids: str, order: str, steps: int) -> StepItems:
    """StepItems over 7 random sources with no images and a random assignment (`order`: positions shuffled, or
    in stream order as drawn, many splits in a row)."""
    tokens, streams, samples, image_cols, pos, step = [], [], [], [], [], []
    for k in range(7):
        n = int(rng.integers(1, 300)) if k != 3 else 5  # source 3: few segments, absent from most steps
        lengths = rng.integers(1, 3000, n).astype(np.uint32)
        st = build_stream(f"s{k}", 0, lengths, lanes, 1)
        tokens.append(lengths)
        streams.append(st)
        if ids == "stored":
            samples.append(np.arange(n, dtype=np.uint64) * 3 + 1)
        elif ids == "rows":
            samples.append(RowIds(np.sort(rng.choice(10 * n, n, replace=False)).astype(np.int64)))
        else:
            samples.append(DenseIds(n) if k % 2 else np.arange(n, dtype=np.uint64) * 5)
        image_cols.append(np.broadcast_to(np.zeros(1, np.uint32), (n,)))
        m = len(st.doc)
        pos.append((rng.permutation(m) if order == "shuffled" else np.arange(m)).astype(np.uint32))
        step.append(np.sort(rng.integers(0, steps, m)).astype(np.int32))
    items = object.__new__(StepItems)
    items._samples, items._tokens, items._images = samples, tokens, image_cols
    items._streams, items._lanes, items._asg = streams, lanes, StepAssignment(pos, step)
    items._step0 = 0
    items._seg_end = np.concatenate([[0], np.cumsum(items._asg.counts(steps, 0))])
    return items


@pytest.mark.parametrize("ids", ["mixed", "stored", "rows"])
@pytest.mark.parametrize("order", ["shuffled", "stream"])
@pytest.mark.parametrize("lanes", [Lanes(seq_len=256), Lanes(seq_len=512, long_seq_len=4096, threshold=1024)])
def test_placed_columns_are_the_assigned_ones_step_major(ids: str, order: str, lanes: Lanes) -> None:
    """_placed (each source's segments put straight into their step's slots) gives _assigned's columns in the
    stable order of their steps: value, type and place."""
    steps = 40
    items = _items(np.random.default_rng(len(ids) + len(order)), lanes, ids, order, steps)
    assert items._can_place()
    for t0, t1 in ((0, steps), (5, 6), (10, 27), (39, 40)):
        want = items._assigned(t0, t1)
        order_ = np.argsort(want[-1], kind="stable")
        got = items._placed(t0, t1)
        assert len(got) == 6
        for g, w in zip(got, want[:-1], strict=True):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g, w[order_])


def test_placing_only_without_images_and_with_uint64_ids() -> None:
    items = _items(np.random.default_rng(1), Lanes(seq_len=256), "mixed", "stream", 10)
    assert items._can_place()
    items._images = [np.zeros(len(x), dtype=np.uint32) for x in items._tokens]  # stored zeros: gathered as before
    assert not items._can_place()
    items = _items(np.random.default_rng(1), Lanes(seq_len=256), "stored", "stream", 10)
    items._samples[2] = items._samples[2].astype(np.int64)  # _assigned would give int64 ids
    assert not items._can_place()


def test_placed_refuses_counts_the_assignment_does_not_hold() -> None:
    items = _items(np.random.default_rng(2), Lanes(seq_len=256), "mixed", "stream", 10)
    items._seg_end = items._seg_end.copy()
    items._seg_end[5:] += 1  # step 4 said to hold one more segment than assigned
    with pytest.raises(AssertionError, match="do not match the assignment's counts"):
        items._placed(0, 10)


def test_split_search_is_searchsorted() -> None:
    """_items_kernel._split_at, searching on from the previous answer, is searchsorted(left) for any sequence of
    positions: runs of consecutive ones (the walk), jumps (the gallop) and steps back (the halving)."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        split = np.unique(rng.integers(0, 2000, int(rng.integers(0, 400)))).astype(np.int64)
        ps = np.concatenate([np.arange(a, a + int(rng.integers(1, 60))) for a in rng.integers(0, 2100, 30)])
        last_p, last_i = -1, 0
        for p in ps.tolist():
            i = _split_at(split, p, last_p, last_i)
            assert i == int(np.searchsorted(split, p, side="left"))
            last_p, last_i = p, i
