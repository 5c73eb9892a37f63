"""Membership's held pass (_mixture_kernel.held_membership: steps whose weights are all the held last row, worked
out without a (steps x sources) block) gives exactly the pointers of the chunked nearest-and-repair pass and of the
reference per-step loop, for a fixed mixture and a schedule that holds from a milestone on, across chunks."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from tests.unit.planning.test_membership_repair import _case, _reference

from loomdata.planning import _mixture
from loomdata.planning._mixture import CumulativeTargets, StepWeights, build_stream, membership
from loomdata.planning._packing import Lanes


def _weights(w: np.ndarray, steps: int, milestone: int | None) -> StepWeights:
    """A fixed mixture (milestone None) or one moving from uniform at step 0 to `w` at `milestone`, held after."""
    if milestone is None:
        xs, ys = np.zeros(1), w[None, :]
    else:
        xs = np.array([0.0, float(milestone)])
        ys = np.stack([np.full(len(w), 1.0 / len(w)), w])
    held = int(min(max(np.ceil(xs[-1]), 0), steps))
    sums = np.array([_mixture._interpolated(xs, ys, a, a + 1).sum() for a in range(held)])
    return StepWeights(xs, ys, ys[-1] / ys[-1].sum(), sums, held, 0, steps)


@pytest.mark.parametrize(
    ("seed", "n_src", "steps", "slots", "milestone", "chunk"),
    [(0, 40, 300, 2, None, 7), (1, 7, 400, 1, 150, 11), (4, 60, 250, 4, None, 1 << 14), (5, 1, 300, 1, 40, 5)],
)
def test_held_pass_matches_the_chunked_pass(
    seed: int, n_src: int, steps: int, slots: int, milestone: int | None, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    lanes = Lanes(seq_len=512)
    _, streams, step_slots = _case(seed, n_src, steps, slots, lanes)
    rng = np.random.default_rng(seed)
    w = rng.random(n_src) + 0.1
    w /= w.sum()
    targets = CumulativeTargets(_weights(w, steps, milestone), step_slots * int(lanes.seq_len * 0.96))
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", chunk * n_src)  # chunk boundaries get crossed
    got = membership(targets, streams, lanes, step_slots, targets.budget)
    monkeypatch.setattr(_mixture, "_held_from", lambda tg, st: np.iinfo(np.int64).max)
    want = membership(targets, streams, lanes, step_slots, targets.budget)
    np.testing.assert_array_equal(got.dense(), want.dense())
    grid = np.stack([targets.rows(0, steps, None)[:, k] for k in range(n_src)], 1)
    np.testing.assert_array_equal(got.dense(), _reference(grid, streams, lanes, step_slots, targets.budget))
    np.testing.assert_array_equal(got.totals(), want.totals())


@pytest.mark.parametrize("seed", range(24))
def test_held_pass_equals_the_pass_it_replaced(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The held pass of now (searches re-worked out only where a source's pick may change, the deferrals' argmax past
    a few from a heap) against the pass at main 8f9077a (tests/loomtest/held_membership_ref): every call's changes,
    steps done, targets, repaired row and running nearest pointers the same; its search answers at most one behind.
    Random mixes: segments from a few tokens (several picks a step) to several steps' targets, one to 40 sources,
    the give-back on or off, and small chunks, so that runs end, and windows close, at many points (a fill widening
    one: the resumed call too), and steps deferring more than HEAP_AFTER segments (their argmax from a heap: a
    min-heap in its place fails 4 of the 24)."""
    from tests.loomtest.held_membership_ref import held_membership_ref

    rng = np.random.default_rng(1000 + seed)
    n_src = int(rng.choice([1, 2, 5, 40]))
    steps = int(rng.integers(50, 400))
    slots = int(rng.integers(1, 5))
    lanes = Lanes(seq_len=int(rng.choice([64, 512])))
    fill = float(rng.choice([0.3, 0.96]))  # 0.3: steps whose nearest draws are empty take a fill's segment
    budget = int(slots * lanes.seq_len * fill)
    w = rng.random(n_src) + 0.05
    w /= w.sum()
    mu = float(rng.uniform(1.0, 7.0))  # log mean tokens a document: 3 to 1100
    streams = []
    for k in range(n_src):
        n = int(steps * budget * w[k] / np.exp(mu)) + 50
        lengths = np.clip(rng.lognormal(mu, 1.2, n), 1, 4 * lanes.seq_len).astype(np.uint32)
        epochs = int(steps * budget * w[k] // int(lengths.sum())) + 2
        streams.append(build_stream(f"s{k}", seed, lengths, lanes, epochs))
    step_slots = np.full(steps, slots, dtype=np.int64)
    targets = CumulativeTargets(_weights(w, steps, None), step_slots * int(lanes.seq_len * fill))
    give = targets.budget if rng.random() < 0.5 else np.zeros(steps, dtype=np.int64)
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", int(rng.integers(3, 40)) * n_src)
    monkeypatch.setattr(_mixture, "HELD_CHUNKS", 1)  # runs of 64 steps
    calls: list[tuple[Any, Any, Any]] = []
    held = _mixture.held_membership

    def recorded(*a: Any) -> Any:
        before = copy.deepcopy(a)
        out = held(*a)
        calls.append((before, copy.deepcopy(a), out))  # (acc and the others go on to later calls)
        return out

    monkeypatch.setattr(_mixture, "held_membership", recorded)
    got = membership(targets, streams, lanes, step_slots, give)
    assert calls
    for before, after, out in calls:
        args = copy.deepcopy(before)
        want = held_membership_ref(*args)
        for x, y in zip(out, want, strict=True):
            np.testing.assert_array_equal(x, y)
        for i in (3, 4, 6):  # acc, prior, cur
            np.testing.assert_array_equal(after[i], args[i])
        np.testing.assert_array_equal(after[5][:, 1], args[5][:, 1])  # running nearest pointers
        assert ((after[5][:, 0] <= args[5][:, 0]) & (after[5][:, 0] >= args[5][:, 0] - 1)).all()
    monkeypatch.setattr(_mixture, "held_membership", held_membership_ref)
    np.testing.assert_array_equal(got.dense(), membership(targets, streams, lanes, step_slots, give).dense())


def test_one_source_backlog_search_matches_the_reference() -> None:
    """One source at dp 1 with segments long against the budget's slack: each step keeps its row less part of its
    last segment, so the nearest pointer runs ahead of the repaired one by a backlog that grows every step (session
    28: a deferral walk over it made such plans quadratic). The held pass finds where the deferrals end by a search;
    its pointers must be the reference loop's, and the backlog must be there (else the search is not exercised)."""
    lanes = Lanes(seq_len=512)
    steps, slots = 300, 1
    rng = np.random.default_rng(7)
    lengths = np.clip(rng.lognormal(5.6, 0.6, 4000), 8, 2048).astype(np.uint32)  # many pieces of a whole row
    streams = [build_stream("s0", 7, lengths, lanes, 2)]
    step_slots = np.full(steps, slots, dtype=np.int64)
    targets = CumulativeTargets(_weights(np.ones(1), steps, None), step_slots * int(lanes.seq_len * 0.96))
    got = membership(targets, streams, lanes, step_slots, targets.budget)
    grid = targets.rows(0, steps, None)
    np.testing.assert_array_equal(got.dense(), _reference(grid, streams, lanes, step_slots, targets.budget))
    placed = int(streams[0].cum[got.dense()[-1, 0]])
    assert float(grid[-1, 0]) - placed > 20 * lanes.seq_len  # the backlog the deferrals would have walked


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize(("n_src", "seed"), [(2, 3), (5, 4), (2, 11)])
def test_backlog_deferrals_by_level_match_the_reference(
    n_src: int, seed: int, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several sources at dp 1 running a backlog ahead of what fits: past WALK_MAX deferrals in a step the held pass
    defers the rest by level (_to_level; `chunked`: the chunked pass's repair_rows, the same search); its
    pointers must be the reference loop's (the source furthest ahead first, the first source on ties, one segment
    at a time), with equal weights and lengths (seed 11) so that ties occur."""
    from loomdata.planning._mixture_kernel import WALK_MAX

    if chunked:
        monkeypatch.setattr(_mixture, "_held_from", lambda tg, st: np.iinfo(np.int64).max)

    lanes = Lanes(seq_len=512)
    steps, slots = 1500, 1
    rng = np.random.default_rng(seed)
    streams = []
    for k in range(n_src):
        if seed == 11:  # the same lengths in every source: equal keys across sources
            lengths = np.full(6000, 300 + 7 * (np.arange(6000) % 5), dtype=np.uint32)
        else:
            lengths = np.clip(rng.lognormal(5.7 + 0.2 * k, 0.7, 6000), 8, 2048).astype(np.uint32)
        streams.append(build_stream(f"s{k}", seed, lengths, lanes, 2))
    w = np.ones(n_src) if seed == 11 else rng.random(n_src) + 0.2
    w /= w.sum()
    step_slots = np.full(steps, slots, dtype=np.int64)
    targets = CumulativeTargets(_weights(w, steps, None), step_slots * int(lanes.seq_len * 0.96))
    got = membership(targets, streams, lanes, step_slots, targets.budget)
    grid = np.stack([targets.rows(0, steps, None)[:, k] for k in range(n_src)], 1)
    want = _reference(grid, streams, lanes, step_slots, targets.budget)
    np.testing.assert_array_equal(got.dense(), want)
    near = np.array([np.searchsorted(st.cum, grid[-1, k]) for k, st in enumerate(streams)])
    assert int((near - want[-1]).sum()) > 2 * WALK_MAX  # the last steps' deferrals went past the walk


def _held_windows_loop(
    tg: CumulativeTargets,
    streams: list[Any],
    b0: int,
    b1: int,
    before: np.ndarray | None,
    state: np.ndarray,
    prev: np.ndarray,
    reach: np.ndarray | None,
) -> tuple[np.ndarray, ...] | None:
    """_held_windows as it was before session 31 (a loop over the sources for the bounds and for the copy): the
    reference of the vectorised one."""
    n_src = len(streams)
    end = np.zeros(n_src) if before is None else np.array(before, dtype=np.float64)
    _mixture.held_targets(tg.weights.last, np.ascontiguousarray(tg.budget[b0:b1], dtype=np.int64), end)
    needle = np.ceil(end).astype(np.int64)
    lo = np.minimum(prev.astype(np.int64), np.maximum(state[:, 0] - 1, 0))
    n = np.array([len(s.cum) for s in streams], dtype=np.int64)
    hi = np.empty(n_src, dtype=np.int64)
    for k, s in enumerate(streams):
        top = max(int(state[k, 0]), int(np.searchsorted(s.cum, needle[k], side="left")), int(prev[k]))
        hi[k] = min(top if reach is None else max(top, int(reach[k])), n[k] - 1) + 1
    off = np.zeros(n_src + 1, dtype=np.int64)
    np.cumsum(hi - lo, out=off[1:])
    if n_src == 1:
        return streams[0].cum, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), n
    if int(off[-1]) > _mixture.REPAIR_WINDOW and reach is None:
        return None
    cw = np.empty(int(off[-1]), dtype=np.int64)
    for k, s in enumerate(streams):
        cw[off[k] : off[k + 1]] = s.cum[lo[k] : hi[k]]
    return cw, off[:-1].copy(), lo, n


@pytest.mark.parametrize(("seed", "n_src"), [(0, 1), (1, 3), (2, 40), (3, 40), (4, 2), (5, 40)])
def test_held_windows_equal_the_per_source_loop(seed: int, n_src: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """_held_windows' bounds and copy, worked out on all sources at once (session 31), are the per-source loop's:
    random search states and repaired rows (behind, at and past the targets' reach), with and without a `reach`
    (some sources at their stream's end), one source, and windows over REPAIR_WINDOW (None without a reach)."""
    rng = np.random.default_rng(seed)
    lanes = Lanes(seq_len=512)
    steps = 120
    _, streams, step_slots = _case(seed, n_src, steps, 2, lanes)
    w = rng.random(n_src) + 0.1
    w /= w.sum()
    tg = CumulativeTargets(_weights(w, steps, None), step_slots * int(lanes.seq_len * 0.96))
    n = np.array([len(s.cum) for s in streams])
    for small in (False, True):
        if small:  # every window over the limit: None, unless a reach is given
            monkeypatch.setattr(_mixture, "REPAIR_WINDOW", 5)
        for _ in range(8):
            b0 = int(rng.integers(0, steps - 1))
            b1 = int(rng.integers(b0 + 1, steps + 1))
            before = None if b0 == 0 else tg.rows(0, b0, None)[-1].copy()
            state = np.stack([rng.integers(0, n), rng.integers(0, n)], axis=1).astype(np.int64)
            prev = rng.integers(0, n).astype(np.int32)
            reach = None if rng.random() < 0.5 else rng.integers(0, n + 5).astype(np.int64)  # (past the end too)
            args = (tg, streams, b0, b1, before, state, prev)
            got = _mixture._held_windows(*args, reach)
            want = _held_windows_loop(*args, reach)
            if want is None:
                assert got is None
                continue
            assert got is not None
            for x, y in zip(got, want, strict=True):
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(x, y)
