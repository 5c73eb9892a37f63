"""Streams and look-ahead steps computed in one pass agree with their plain definitions (byte for byte)."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning import _mixture, _permute
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


@pytest.mark.parametrize("lanes", [Lanes(seq_len=512), Lanes(seq_len=512, long_seq_len=4096, threshold=1024)])
def test_a_stream_built_to_a_need_is_the_prefix_of_the_whole(lanes: Lanes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expanding stops after the chunk (of documents) where the tokens reach `need`: the same segments and counts
    as the whole stream up to there, never fewer tokens than needed."""
    monkeypatch.setattr(_mixture, "_CHUNK", 256)
    rng = np.random.default_rng(9)
    lengths = np.clip(rng.lognormal(5.5, 1.5, 3000), 0, 20000).astype(np.uint32)
    whole = build_stream("s", 7, lengths, lanes, 3)
    for need in (1.0, float(whole.cum[len(whole.doc) // 2]) + 0.5, float(whole.cum[-1]) * 0.9):
        part = build_stream("s", 7, lengths, lanes, 3, need=need)
        n = len(part.doc)
        assert part.cum[-1] >= need and n < len(whole.doc)
        reach = int(np.searchsorted(whole.cum, need))  # the first prefix with the tokens needed
        assert reach <= n <= reach + 2 * 256 * (1 + int(lengths.max()) // 512)  # within a chunk of documents
        assert np.array_equal(part.doc, whole.doc[:n]) and np.array_equal(part.cum, whole.cum[: n + 1])
        keep = whole.split_pos < n
        assert np.array_equal(part.split_pos, whole.split_pos[keep])
        assert np.array_equal(part.split_off, whole.split_off[keep])
        if lanes.has_long:
            assert part.cum_long is not None and whole.cum_long is not None
            assert np.array_equal(part.cum_long, whole.cum_long[: n + 1])
    assert len(build_stream("s", 7, lengths, lanes, 3, need=float(whole.cum[-1]) * 2).doc) == len(whole.doc)


@pytest.mark.parametrize("lanes", [Lanes(seq_len=512), Lanes(seq_len=512, long_seq_len=4096, threshold=1024)])
def test_a_stream_built_to_a_need_stops_at_the_first_chunk_boundary_past_it(
    lanes: Lanes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefix ends exactly after the first chunk of an epoch's documents (chunks counted from each epoch's
    start, the epoch's end closing its last) whose cumulative tokens reach `need`, as the chunked NumPy code cut it."""
    monkeypatch.setattr(_mixture, "_CHUNK", 256)
    rng = np.random.default_rng(11)
    lengths = np.clip(rng.lognormal(5.5, 1.5, 1000), 1, 20000).astype(np.uint32)
    whole = build_stream("s", 7, lengths, lanes, 3)
    later_piece = set(whole.split_pos[whole.split_off > 0].tolist())
    doc_starts = np.array([p for p in range(len(whole.doc)) if p not in later_piece])  # each document's first segment
    per_epoch = len(whole.doc) // 3
    bounds = sorted(
        {int(doc_starts[i]) for e in range(3) for i in range(e * 1000 + 256, (e + 1) * 1000, 256)}
        | {per_epoch * (e + 1) for e in range(3)}
    )
    for need in (1.0, float(whole.cum[700]) + 0.5, float(whole.cum[per_epoch + 5]), float(whole.cum[-1]) - 1):
        part = build_stream("s", 7, lengths, lanes, 3, need=need)
        want = next(b for b in bounds if whole.cum[b] >= need)
        assert len(part.doc) == want, need
        assert np.array_equal(part.cum, whole.cum[: want + 1])


def _same_stream(a: _mixture.Stream, b: _mixture.Stream) -> None:
    for f in ("doc", "split_pos", "split_off", "split_len", "cum", "cum_short", "cum_long"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert a.epoch_tokens == b.epoch_tokens


@pytest.mark.parametrize("case", range(60))
def test_the_compiled_expansion_builds_the_numpy_codes_stream(case: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """planning._stream_kernel against the chunked NumPy expansion it replaced (tests/loomtest/stream_ref.py), on
    random sources: empty documents, documents split in either lane, block shuffles, streams built to a need at
    random points, several epochs and chunk sizes."""
    from loomdata.planning._shuffle import BlockLayout
    from loomtest.stream_ref import build_stream_ref

    rng = np.random.default_rng([32, case])
    n = int(rng.integers(1, 4000))
    lengths = np.clip(rng.lognormal(5.5, float(rng.uniform(0.5, 2.0)), n), 0, 30000).astype(np.uint32)
    if case % 3 == 0:
        lengths[rng.integers(0, n, max(1, n // 10))] = 0
    lanes = [Lanes(seq_len=512), Lanes(seq_len=512, long_seq_len=4096, threshold=1024), Lanes(seq_len=2048)][case % 3]
    blocks = None
    if case % 4 == 1:
        runs = np.unique(np.concatenate([[0, n], rng.integers(0, n, 5)])).astype(np.int64)
        blocks = BlockLayout.of(runs, None, int(rng.integers(1, 64)), int(rng.integers(1, 4)))
    chunk = int(rng.choice([7, 256, 1 << 16]))
    monkeypatch.setattr(_mixture, "_CHUNK", chunk)
    if case % 2:  # many buckets (the permutation worked out a prefix of buckets at a time)
        monkeypatch.setattr(_permute, "BUCKET_ITEMS", int(rng.choice([4, 32])))
    parts = int(rng.integers(1, 4))  # scattered, shuffled and expanded in parts on threads
    monkeypatch.setattr(_permute, "PART_ITEMS", int(rng.choice([8, 64])))
    epochs = int(rng.integers(1, 4))
    whole = build_stream("src", case, lengths, lanes, epochs, blocks, parts=parts)
    _same_stream(whole, build_stream_ref("src", case, lengths, lanes, epochs, blocks, None, chunk))
    if len(whole.cum) > 1 and whole.cum[-1] > 0:
        for need in (float(rng.uniform(0, whole.cum[-1])), float(whole.cum[-1]) + 1.0):
            got = build_stream("src", case, lengths, lanes, epochs, blocks, need, parts=parts)
            _same_stream(got, build_stream_ref("src", case, lengths, lanes, epochs, blocks, need, chunk))


def test_edge_needs_and_lanes_build_the_numpy_codes_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a need at or below zero still expands an epoch's first chunk (as one pass did), and a long
    lane without a threshold (no document long) counts every token short."""
    from loomtest.stream_ref import build_stream_ref

    monkeypatch.setattr(_mixture, "_CHUNK", 64)
    monkeypatch.setattr(_permute, "BUCKET_ITEMS", 4)
    lengths = np.full(1000, 10, dtype=np.uint32)
    for need in (-1e6, 0.0):
        got = build_stream("s", 1, lengths, Lanes(seq_len=512), 2, None, need)
        _same_stream(got, build_stream_ref("s", 1, lengths, Lanes(seq_len=512), 2, None, need, 64))
        assert len(got.doc) == 64
    lanes = Lanes(seq_len=8, long_seq_len=16)
    short = np.array([3, 8, 8, 4, 5, 30], dtype=np.uint32)
    got = build_stream("s", 1, short, lanes, 1)
    _same_stream(got, build_stream_ref("s", 1, short, lanes, 1, chunk=64))
    assert got.cum_short is not None and np.array_equal(got.cum_short, got.cum)
