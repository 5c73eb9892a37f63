"""The membership repair (compiled, a chunk of steps at a time) gives exactly the pointers of the reference
per-step loop it replaced, with and without a long lane, on fixed and per-step slots, across chunks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from loomdata.planning import _mixture, make_plan
from loomdata.planning._mixture import Stream, build_stream, membership
from loomdata.planning._packing import Lanes
from loomdata.schemas.plan import read_manifest
from loomdata.schemas.spec import Spec


def _reference(
    targets: np.ndarray, streams: Sequence[Stream], lanes: Lanes, slots: np.ndarray, budget: np.ndarray | None = None
) -> np.ndarray:
    """The planner's membership as a plain loop: nearest pointers, then a per-step repair from the first bad step
    (deferrals, the give-back up to the step's `budget` of tokens (default: its slots'), the fill)."""
    give = slots * lanes.seq_len if budget is None else np.broadcast_to(budget, slots.shape)
    steps, n_src = targets.shape
    ptr = np.zeros((steps + 1, n_src), dtype=np.int64)
    for k, s in enumerate(streams):
        ptr[1:, k] = _mixture._nearest(s.cum, targets[:, k])
    np.maximum.accumulate(ptr, axis=0, out=ptr)
    for t in range(steps):
        sl = int(slots[t])
        top = np.maximum(ptr[t + 1], ptr[t])
        row = top.copy()
        while not _fits(streams, ptr[t], row, lanes, sl):
            ahead = np.array(
                [streams[k].cum[row[k]] - targets[t, k] if row[k] > ptr[t, k] else -np.inf for k in range(n_src)]
            )
            k = int(np.argmax(ahead))
            row[k] -= 1
        while True:  # the give-back: the deferred segment that fits again, of the source least ahead, one at a time
            back = [
                (streams[k].cum[row[k] + 1] - targets[t, k], k)
                for k in range(n_src)
                if row[k] < top[k]
                and _fits(streams, ptr[t], row + (np.arange(n_src) == k), lanes, sl)
                and _tokens(streams, ptr[t], row + (np.arange(n_src) == k), lanes) <= give[t]
            ]
            if not back:
                break
            row[min(back)[1]] += 1
        if (row == ptr[t]).all():  # the fill: the next segment of the weighted source it leaves least ahead
            k = _fill(targets, t, streams, row, lanes, sl)
            row[k] += k >= 0  # (-1: none fits: the step stays empty, make_plan refuses it)
        ptr[t + 1] = row
    return ptr


def _drawn(streams: Sequence[Stream], before: np.ndarray, row: np.ndarray) -> tuple[int, int]:
    """(short-lane tokens, long-lane segments) between the pointer rows `before` and `row`."""
    short = n_long = 0
    for k, s in enumerate(streams):
        cs = s.cum if s.cum_short is None else s.cum_short
        short += int(cs[row[k]] - cs[before[k]])
        if s.cum_long is not None:
            n_long += int(s.cum_long[row[k]] - s.cum_long[before[k]])
    return short, n_long


def _fits(streams: Sequence[Stream], before: np.ndarray, row: np.ndarray, lanes: Lanes, sl: int) -> bool:
    """Whether the segments between the pointer rows `before` and `row` fit a step's `sl` slots."""
    short, n_long = _drawn(streams, before, row)
    return n_long <= sl and short <= (sl - n_long) * lanes.seq_len


def _tokens(streams: Sequence[Stream], before: np.ndarray, row: np.ndarray, lanes: Lanes) -> int:
    """The step's tokens as slots count them: its short-lane tokens plus a sequence's for each long segment."""
    short, n_long = _drawn(streams, before, row)
    return short + n_long * lanes.seq_len


def _fill(targets: np.ndarray, t: int, streams: Sequence[Stream], row: np.ndarray, lanes: Lanes, sl: int) -> int:
    """The fill's source (a plain loop): argmin of cum[row + 1] - target over the sources weighted at step t whose
    next segment fits the step alone; first on ties; -1 where there is none; StreamRunOut where a weighted source
    has no next segment (the first such source)."""
    best, bv = -1, np.inf
    for k, s in enumerate(streams):
        weighted = targets[t, k] > (targets[t - 1, k] if t else 0.0)
        if not weighted:
            continue
        if row[k] + 1 >= len(s.cum):
            raise _mixture.StreamRunOut(t, k)
        j = int(row[k]) + 1
        n_long = int(s.cum_long[j] - s.cum_long[j - 1]) if s.cum_long is not None else 0
        short = int(
            (s.cum if s.cum_short is None else s.cum_short)[j] - (s.cum if s.cum_short is None else s.cum_short)[j - 1]
        )
        if n_long > sl or short > (sl - n_long) * lanes.seq_len:
            continue
        if s.cum[j] - targets[t, k] < bv:
            best, bv = k, s.cum[j] - targets[t, k]
    return best


def _case(seed: int, n_src: int, steps: int, slots: int, lanes: Lanes) -> tuple[np.ndarray, list[Stream], np.ndarray]:
    rng = np.random.default_rng(seed)
    budget = int(slots * lanes.seq_len * 0.96)
    w = rng.random(n_src) + 0.1
    w /= w.sum()
    streams = []
    for k in range(n_src):
        n = int(steps * budget * w[k] / 300) + 50
        lengths = np.clip(rng.lognormal(5.0, 1.3, n), 1, 6 * lanes.seq_len).astype(np.uint32)
        tokens = int(lengths.sum())
        epochs = int(steps * budget * w[k] // tokens) + 2
        streams.append(build_stream(f"s{k}", seed, lengths, lanes, epochs))
    step_slots = np.full(steps, slots, dtype=np.int64)
    step_slots[steps // 2 :] = max(1, slots // 2)  # an elastic re-plan halves the slots
    targets = np.cumsum(w * (step_slots * lanes.seq_len * 0.96)[:, None], axis=0)
    return targets, streams, step_slots


@pytest.mark.parametrize(
    ("seed", "n_src", "steps", "slots", "long"),
    [(0, 40, 300, 2, False), (1, 7, 400, 1, False), (2, 30, 200, 4, True), (3, 3, 500, 1, True)],
)
def test_repair_matches_the_reference_loop(
    seed: int, n_src: int, steps: int, slots: int, long: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    lanes = Lanes(seq_len=512, long_seq_len=2048, long_cp=2, threshold=512) if long else Lanes(seq_len=512)
    targets, streams, step_slots = _case(seed, n_src, steps, slots, lanes)
    budget = (step_slots * lanes.seq_len * 0.96).astype(np.int64)  # the give-back's room: the targets' budget
    want = _reference(targets, streams, lanes, step_slots, budget)
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", 7 * n_src)  # many chunks: boundaries get crossed
    got = membership(targets, streams, lanes, step_slots, budget).dense()
    near = np.zeros_like(want)
    for k, s in enumerate(streams):
        near[1:, k] = _mixture._nearest(s.cum, targets[:, k])
    assert (want != np.maximum.accumulate(near, axis=0)).any()  # the case does need repairs
    np.testing.assert_array_equal(got, want)
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", 1 << 20)
    np.testing.assert_array_equal(membership(targets, streams, lanes, step_slots, budget).dense(), want)
    monkeypatch.setattr(_mixture, "REPAIR_WINDOW", 50)  # chunks ended by their windows' segments, some of one step
    np.testing.assert_array_equal(membership(targets, streams, lanes, step_slots, budget).dense(), want)


@pytest.mark.parametrize(("micro_batches", "held"), [(1, True), (2, True), (1, False)])
def test_a_step_keeps_the_deferred_segments_that_fit_again(
    micro_batches: int, held: bool, tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> None:
    """dp 1: a long document of the light source overflows its step; deferring it frees room that the other
    source's deferred documents fill again (the give-back), so steps stay full and the light source is not starved
    behind them (without the give-back: 60 % real tokens and its share 15 points low at one micro-batch). `held`:
    constant weights (the held pass); else the same weights as a schedule to its last step (the chunked repair)."""
    rng = np.random.default_rng(0)
    web = np.clip(rng.lognormal(np.log(350) - 0.5, 1.0, 150_000), 16, 100_000)
    books = np.clip(rng.lognormal(np.log(1400) - 0.5, 1.0, 60_000), 16, 100_000)
    steps, seq = 300, 4096
    w = {"web": 0.75, "books": 0.25}
    mix: dict[str, Any] = (
        {"weights": w} if held else {"schedule": [{"step": 0, "weights": w}, {"step": steps - 1, "weights": w}]}
    )
    spec = spec_of(
        tmp_path,
        ["web", "books"],
        **mix,
        seq_len=seq,
        steps=steps,
        dp=1,
        micro_batches=micro_batches,
    )
    res = make_plan(spec, index={"web": index_of(web), "books": index_of(books)})
    m = read_manifest(res.plan_dir, res.meta)
    tokens = np.bincount(m["source"].to_numpy(), weights=m["length"].to_numpy().astype(np.float64), minlength=2)
    assert tokens.sum() / (steps * micro_batches * seq) > 0.85  # the budget is 0.96 of the rows (planning.fill)
    assert abs(tokens[1] / tokens.sum() - 0.25) < 0.025
    per_step = np.bincount(m["step"].to_numpy(), weights=m["length"].to_numpy().astype(np.float64), minlength=steps)
    assert np.median(per_step) > 0.85 * micro_batches * seq


def test_with_more_ranks_the_repair_gives_nothing_back_and_the_look_ahead_keeps_its_room(tmp_path: Path) -> None:
    """dp 2, three sources, the look-ahead on: its lights move through the steps' spare room, so the give-back stays
    at dp 1 (given back here, full steps pushed lights to the last step and back onto step 0: refused)."""
    from loomtest.golden_plans import _index, _lognormal, _spec

    sizes = (6712, 3356, 6712)  # (plan_identity_ab.py's src3_dp2_mb1)
    index = {
        f"s{k:03d}": _index(_lognormal(100 + k, n, 6.0 if k % 2 == 0 else 6.7, 1.1 if k % 2 == 0 else 1.3))
        for k, n in enumerate(sizes)
    }
    weights = {f"s{k:03d}": 1.0 + k for k in range(3)}
    spec = _spec(
        tmp_path,
        list(index),
        {"seq_len": 4096, "steps": 400, "dp_size": 2, "micro_batches": 1},
        mixture={"weights": weights},
    )
    res = make_plan(spec, index=index)
    m = read_manifest(res.plan_dir, res.meta)
    per_step = np.bincount(m["step"].to_numpy(), weights=m["length"].to_numpy().astype(np.float64), minlength=400)
    assert per_step.max() <= 2 * 4096


@pytest.mark.parametrize(
    ("n_src", "long", "ties"), [(1, False, False), (2, False, False), (2, False, True), (3, True, False)]
)
def test_backlog_deferrals_by_level_match_the_reference_loop(n_src: int, long: bool, ties: bool) -> None:
    """dp 1 with segments long against the budget's slack: the nearest pointers run a backlog ahead of what fits
    that grows every step, so steps defer far more than WALK_MAX segments and repair_rows defers the rest by level
    (_to_level, session 28: a walk over the backlog made such plans quadratic). Its pointers must be the
    reference loop's, with equal weights and lengths (`ties`) and with a long lane (long segments count a slot)."""
    from loomdata.planning._mixture_kernel import WALK_MAX

    lanes = Lanes(seq_len=512, long_seq_len=2048, long_cp=2, threshold=1024) if long else Lanes(seq_len=512)
    steps = 3000 if long else 1200
    rng = np.random.default_rng(5 + n_src)
    streams = []
    for k in range(n_src):
        if ties:
            lengths = np.full(16000, 300 + 7 * (np.arange(16000) % 5), dtype=np.uint32)
        else:
            lengths = np.clip(rng.lognormal(5.7 + 0.2 * k, 0.7, 16000), 8, 1800).astype(np.uint32)
        streams.append(build_stream(f"s{k}", 3, lengths, lanes, 2))
    w = np.ones(n_src) if ties else rng.random(n_src) + 0.2
    w /= w.sum()
    step_slots = np.ones(steps, dtype=np.int64)
    budget = (step_slots * lanes.seq_len * 0.96).astype(np.int64)
    targets = np.cumsum(w * budget[:, None].astype(np.float64), axis=0)
    want = _reference(targets, streams, lanes, step_slots, budget)
    got = membership(targets, streams, lanes, step_slots, budget).dense()  # (a grid of targets: the chunked pass)
    np.testing.assert_array_equal(got, want)
    near = np.array([_mixture._nearest(s.cum, targets[-1:, k])[0] for k, s in enumerate(streams)])
    assert int((near - want[-1]).sum()) > 2 * WALK_MAX  # the last steps' deferrals went past the walk
