"""Gathering a block's segments from a look-ahead assignment (StepItems._assigned): the columns made once for all
sources are those the per-source code made, value and type."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._items import StepItems
from loomdata.planning._lookahead import StepAssignment, segments_at
from loomdata.planning._mixture import build_stream
from loomdata.planning._packing import Lanes
from loomdata.planning._segments import DenseIds


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
