"""The look-ahead's compiled parts (_lookahead_kernel) against the NumPy code they replace: the natural steps of
a run of positions (each step repeated by how many positions fall in it; one binary search per position) and
the pass pushing overflowing lights on (_fit_lights step by step over a _Cum), per-step counts and the
per-source gather of segments."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._lookahead import _Cum, _fit_lights, segments_at
from loomdata.planning._lookahead_kernel import _cum_right, add_step_counts, run_steps
from loomdata.planning._mixture import Stream, build_stream
from loomdata.planning._packing import Lanes
from loomtest.lookahead_ref import natural_chunk


def _repeat_steps(col: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The NumPy code run_steps replaced (_lookahead._steps_of_run before it was compiled)."""
    ta, tb = (int(x) for x in np.searchsorted(col, [lo, hi - 1], side="right") - 1)
    bounds = np.empty(tb - ta + 2, dtype=np.int64)
    bounds[0], bounds[-1] = lo, hi
    np.clip(col[ta + 1 : tb + 1], lo, hi, out=bounds[1:-1])
    return np.repeat(np.arange(ta, tb + 1, dtype=np.int64), np.diff(bounds))


@pytest.mark.parametrize("seed", range(30))
def test_run_steps_is_searchsorted_right_minus_one(seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps = int(rng.integers(1, 400))
    density = float(rng.choice([0.05, 0.3, 1.0, 4.0]))  # positions a step: sparse (many sources) to dense
    grid = np.zeros((steps + 1, 3), dtype=np.int64)
    grid[1:] = np.cumsum(rng.poisson(density, (steps, 3)), axis=0)
    col = grid[:, 1]  # a strided column of a pointer grid, as the look-ahead passes it
    end = int(col[-1])
    for lo, hi in [(0, end), (0, 1), (end // 3, end // 2 + 1), (end - 1, end), (end // 2, end // 2)]:
        lo, hi = max(lo, 0), max(hi, 0)
        got = run_steps(col, lo, hi)
        want = np.searchsorted(col, np.arange(lo, hi), side="right") - 1
        assert got.dtype == np.int64 and np.array_equal(got, want)
        if hi > lo:
            assert np.array_equal(got, _repeat_steps(col, lo, hi))


def test_run_steps_edges() -> None:
    col = np.array([0, 0, 3, 3, 3, 7], dtype=np.int64)  # empty steps at the start and in the middle
    assert run_steps(col, 0, 7).tolist() == [1, 1, 1, 4, 4, 4, 4]
    assert run_steps(col, 7, 9).tolist() == [5, 5]  # past the last pointer: the last row
    assert run_steps(col, 3, 3).tolist() == []
    assert run_steps(np.array([0], dtype=np.int64), 0, 2).tolist() == [0, 0]


def _fit_lights_numpy(cnt: np.ndarray, lc: _Cum, room: np.ndarray) -> None:
    """The NumPy code _fit_lights ran before fit_lights (the oracle)."""
    n = len(cnt)
    prev = np.concatenate([[0], cnt[:-1]])
    bad = np.flatnonzero(lc[cnt] - lc[prev] > room)
    i = 0
    while i < len(bad):
        t = int(bad[i])
        dirty = True
        while dirty and t < n - 1:
            before = int(cnt[t - 1]) if t else 0
            limit = lc[before] + max(int(room[t]), 0)
            fit = int(lc.searchsorted(np.array([limit]), "right")[0]) - 1
            cnt[t] = max(min(int(cnt[t]), fit), before)
            t += 1
            if cnt[t] < cnt[t - 1]:
                cnt[t] = cnt[t - 1]
            dirty = lc[cnt[t]] - lc[cnt[t - 1]] > room[t]
        i = int(np.searchsorted(bad, t, side="right"))


@pytest.mark.parametrize("seed", range(30))
def test_fit_lights_matches_the_numpy_pass(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_light = int(rng.choice([0, 1, 63, 64, 65, 500, 5000]))
    steps = int(rng.integers(1, 300))
    lens = rng.integers(1, 200, n_light).astype(np.uint32)
    buf = _Cum.buffer(n_light)
    buf[:n_light] = lens
    lc = _Cum(buf, n_light)
    c = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    # cumulative light counts a step (non-decreasing, ending at all of them) and rooms some steps overflow
    cnt = np.sort(rng.integers(0, n_light + 1, steps)).astype(np.int64)
    cnt[-1] = n_light
    per_step = np.diff(c[np.concatenate([[0], cnt])])
    room = (per_step * rng.choice([0.5, 0.9, 1.0, 1.5], steps)).astype(np.int64) - rng.integers(-50, 50, steps)
    want, got = cnt.copy(), cnt.copy()
    _fit_lights_numpy(want, lc, room)
    _fit_lights(got, lc, room)
    assert np.array_equal(got, want)
    for x in [-1, 0, 1, int(c[-1]) // 2, int(c[-1]), int(c[-1]) + 1]:  # the block walk is searchsorted "right"
        assert _cum_right(lc.pre, lc.pad, n_light + 1, x) == int(np.searchsorted(c, x, side="right"))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_add_step_counts_is_the_search_per_step(dtype: type) -> None:
    """StepAssignment's per-step counts (one compiled pass) against one binary search a step, the code it replaced,
    for windows inside, across and outside the assigned steps."""
    rng = np.random.default_rng(7)
    for size in [0, 1, 5, 1000]:
        st = np.sort(rng.integers(3, 60, size)).astype(dtype)
        for first, steps in [(0, 70), (3, 1), (10, 20), (59, 5), (80, 3), (0, 0)]:
            out = np.zeros(steps, dtype=np.int64)
            add_step_counts(st, first, out)
            edges = np.arange(first, first + steps + 1, dtype=st.dtype)
            assert np.array_equal(out, np.diff(np.searchsorted(st, edges).astype(np.int64)))


def _segments_at_numpy(st: Stream, pos: np.ndarray, lengths: np.ndarray, lanes: Lanes) -> tuple[np.ndarray, ...]:
    """segments_at before segments_of (the oracle)."""
    doc = st.doc[pos]
    dl = lengths[doc]
    length = dl.astype(np.uint32, copy=True)
    offset = np.zeros(len(doc), dtype=np.uint32)
    if len(st.split_pos) and len(pos):
        i = np.minimum(np.searchsorted(st.split_pos, pos), len(st.split_pos) - 1)
        hit = st.split_pos[i] == pos
        offset[hit] = st.split_off[i[hit]]
        length[hit] = st.split_len[i[hit]]
    return doc, offset, length, lanes.lane_of(dl)


@pytest.mark.parametrize("long_lane", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_segments_at_matches_the_numpy_gather(seed: int, long_lane: bool) -> None:
    """Streams with split documents (pieces at sorted positions), positions in any order, with and without a
    long lane: the same columns and dtypes as the NumPy gather."""
    rng = np.random.default_rng(seed)
    lanes = Lanes(seq_len=64, long_seq_len=256, threshold=64) if long_lane else Lanes(seq_len=64)
    lengths = rng.integers(1, 300, 500).astype(np.uint32)
    st = build_stream(f"s{seed}", seed, lengths, lanes, 2)
    mostly_up = np.sort(rng.choice(len(st.doc), len(st.doc) // 3, replace=False)).astype(np.uint32)
    mostly_up[10:20] = mostly_up[10:20][::-1].copy()  # a few moved back (the look-ahead's later steps)
    for pos in [
        np.arange(len(st.doc), dtype=np.uint32),
        rng.permutation(len(st.doc))[:100].astype(np.int64),
        mostly_up,
        np.repeat(st.split_pos[:5], 2).astype(np.int64),  # split pieces themselves, each twice
        np.zeros(0, dtype=np.uint32),
    ]:
        want = _segments_at_numpy(st, pos, lengths, lanes)
        got = segments_at(st, pos, lengths, lanes)
        for w, g in zip(want, got, strict=True):
            assert g.dtype == w.dtype and np.array_equal(g, w)
    assert len(st.split_pos)  # the streams hold split pieces


def test_a_natural_chunk_is_the_sources_slices_sorted_stably_by_step() -> None:
    """A chunk of the natural order's global indices (natural_chunk) against the code it replaces: the per-source
    slices end to end, then a stable argsort by step; with empty slices, empty sources and negative steps (what
    a re-plan's base deferred)."""
    rng = np.random.default_rng(3)
    for trial in range(20):
        sizes = rng.integers(0, 40, 12)
        sizes[3] = 0
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        lo_step = -2 if trial % 2 else 0
        raw = np.concatenate([np.sort(rng.integers(lo_step, 30, n)) for n in sizes]).astype(np.int32)
        width = int(rng.integers(1, 12))
        edges = np.arange(lo_step, 30 + width, width, dtype=np.int64)
        cuts = np.stack(
            [np.searchsorted(raw[offs[s] : offs[s + 1]], edges.astype(raw.dtype)) for s in range(len(sizes))]
        ).astype(np.int64)
        for c, a in enumerate(range(lo_step, 30, width)):
            parts = [
                np.arange(offs[s] + cuts[s, c], offs[s] + cuts[s, c + 1], dtype=np.int64) for s in range(len(sizes))
            ]
            idx = np.concatenate(parts)
            want = idx[np.argsort(raw[idx], kind="stable")]
            got = natural_chunk(raw, offs, cuts, c, a, width)
            assert got.dtype == np.int64 and np.array_equal(got, want)
