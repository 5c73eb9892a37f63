"""Streams and look-ahead steps computed in one pass agree with their plain definitions (byte for byte)."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._lookahead import _steps_of_run
from loomdata.planning._mixture import build_stream, source_key
from loomdata.planning._packing import Lanes, expand_units
from loomdata.planning._permute import uniform_permutation


def _reference(lengths: np.ndarray, lanes: Lanes, epochs: int) -> tuple[np.ndarray, ...]:
    """Every epoch's permutation (planning._permute) expanded whole (expand_units), concatenated, and its counts."""
    docs = np.flatnonzero(lengths > 0).astype(np.uint32)
    parts, pos, off, seg, at = [], [], [], [], 0
    for e in range(epochs):
        perm = uniform_permutation(np.random.default_rng([*source_key(7, "s"), e]), len(docs), src=docs)
        d, o, ln = expand_units(perm, lengths, lanes)
        split = np.flatnonzero((o > 0) | (ln != lengths[d]))
        parts.append(d)
        pos.append(split + at)
        off.append(o[split])
        seg.append(ln[split])
        at += len(d)
    doc = np.concatenate(parts)
    length = lengths[doc].astype(np.uint32)
    split_pos = np.concatenate(pos).astype(np.int64)
    length[split_pos] = np.concatenate(seg)
    cum = np.concatenate([[0], np.cumsum(length, dtype=np.int64)])
    lane = lanes.lane_of(lengths[doc])
    cum_long = np.concatenate([[0], np.cumsum(lane, dtype=np.int64)])
    return doc, split_pos, np.concatenate(off), cum, cum_long


@pytest.mark.parametrize("lanes", [Lanes(seq_len=512), Lanes(seq_len=512, long_seq_len=4096, threshold=1024)])
@pytest.mark.parametrize("epochs", [1, 3])
def test_a_stream_is_its_permutations_expanded(lanes: Lanes, epochs: int) -> None:
    rng = np.random.default_rng(epochs)
    lengths = np.clip(rng.lognormal(5.5, 1.5, 3000), 0, 20000).astype(np.uint32)
    lengths[rng.integers(0, 3000, 200)] = 0  # empty documents are skipped
    st = build_stream("s", 7, lengths, lanes, epochs)
    doc, split_pos, split_off, cum, cum_long = _reference(lengths, lanes, epochs)
    assert len(split_pos) > 100  # documents were split
    assert st.doc.dtype == np.uint32 and np.array_equal(st.doc, doc)
    assert np.array_equal(st.split_pos, split_pos) and np.array_equal(st.split_off, split_off)
    assert np.array_equal(st.cum, cum)
    if lanes.has_long:
        assert st.cum_long is not None and np.array_equal(st.cum_long, cum_long)


def test_steps_of_a_run_are_the_binary_search_of_each_value() -> None:
    rng = np.random.default_rng(3)
    for _ in range(500):
        col = np.concatenate([[0], np.cumsum(rng.integers(0, 4, int(rng.integers(1, 30))))]).astype(np.int64)
        lo = int(rng.integers(0, col[-1] + 3))
        hi = int(rng.integers(lo + 1, col[-1] + 5))
        want = np.searchsorted(col, np.arange(lo, hi), side="right") - 1
        assert np.array_equal(_steps_of_run(col, lo, hi), want), (col, lo, hi)
