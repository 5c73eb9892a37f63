"""The fill: a step whose nearest-and-repaired pointers draw nothing draws the next segment of the source it leaves
least ahead of its target (many equal sources on one slot: the nearest rule alone leaves the first steps empty).
Compiled passes (chunked, held, across chunk edges and widened windows) against the plain reference loop; plans
that used to fail now plan, resume and run on one process or the cluster's ranges alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.unit.planning.test_distributed_planning import _files, _PicklingPool
from tests.unit.planning.test_membership_held import _weights
from tests.unit.planning.test_membership_repair import _reference

from loomdata.planning import PlanResume, _mixture, make_plan
from loomdata.planning import _manifest as manifest_module
from loomdata.planning._mixture import CumulativeTargets, Stream, build_stream, membership
from loomdata.planning._packing import Lanes
from loomdata.schemas.plan import read_manifest

_SEQ = 64
_BUDGET = int(_SEQ * 0.96)


def _equal_sources(
    seed: int, n_src: int, steps: int, lo: int = 20, hi: int = 41, lanes: Lanes | None = None
) -> tuple[CumulativeTargets, list[Stream], np.ndarray, Lanes]:
    """n_src equally weighted sources of documents of lo..hi-1 tokens on one slot of 64 tokens a step."""
    lanes = lanes or Lanes(seq_len=_SEQ)
    rng = np.random.default_rng(seed)
    streams = [build_stream(f"s{k}", seed, rng.integers(lo, hi, 200).astype(np.uint32), lanes, 2) for k in range(n_src)]
    slots = np.ones(steps, dtype=np.int64)
    tg = CumulativeTargets(_weights(np.full(n_src, 1.0 / n_src), steps, None), slots * _BUDGET)
    return tg, streams, slots, lanes


def _drawn(ptr: np.ndarray, streams: list[Stream]) -> np.ndarray:
    """(steps, sources) tokens each source has drawn through each step."""
    return np.stack([s.cum[ptr[1:, k]] for k, s in enumerate(streams)], 1)


def test_fifty_equal_sources_on_one_slot_draw_every_step_near_their_targets() -> None:
    tg, streams, slots, lanes = _equal_sources(0, 50, 400)
    ptr = membership(tg, streams, lanes, slots, tg.budget).dense()
    per_step = np.diff(ptr.sum(axis=1))
    assert (per_step > 0).all()  # the nearest rule alone leaves the first ~10 steps empty (below)
    assert (np.diff(ptr, axis=0) >= 0).all()
    off = _drawn(ptr, streams) - tg.rows(0, 400, None)
    assert off.max() <= 40  # the fill never puts a source more than a document ahead of its target
    assert -off.min() <= 2 * _BUDGET + 40  # behind: the repair's deferrals (many sources crossing at once)
    # the same targets drawn by the nearest rule and the repair alone: the first steps draw nothing
    near = np.stack([_mixture._nearest(s.cum, tg.rows(0, 400, None)[:, k]) for k, s in enumerate(streams)], 1)
    assert (np.diff(np.maximum.accumulate(near, axis=0).sum(axis=1), prepend=0)[:5] == 0).all()


@pytest.mark.parametrize(
    ("seed", "n_src", "chunk", "window", "docs"),
    [(1, 50, 7, 50, (20, 41)), (2, 30, 3, 1 << 22, (20, 41)), (3, 1, 5, 50, (64, 65)), (4, 2, 5, 1 << 22, (64, 65))],
)
def test_chunked_and_held_passes_match_the_reference_across_chunks_and_widened_windows(
    seed: int, n_src: int, chunk: int, window: int, docs: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 300
    tg, streams, slots, lanes = _equal_sources(seed, n_src, steps, *docs)
    want = _reference(tg.rows(0, steps, None), streams, lanes, slots, tg.budget)
    widened = {"held": 0, "chunked": 0}
    held_windows, repair_window = _mixture._held_windows, _mixture._repair_window

    def counting_held(*a: Any) -> Any:
        widened["held"] += len(a) > 7 and a[7] is not None
        return held_windows(*a)

    def counting_repair(*a: Any) -> Any:
        widened["chunked"] += a[6] > 0
        return repair_window(*a)

    monkeypatch.setattr(_mixture, "_held_windows", counting_held)
    monkeypatch.setattr(_mixture, "_repair_window", counting_repair)
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", chunk * n_src)
    monkeypatch.setattr(_mixture, "REPAIR_WINDOW", window)
    held = membership(tg, streams, lanes, slots, tg.budget)  # constant weights: the held pass from step 0
    monkeypatch.setattr(_mixture, "_held_from", lambda tg, st: np.iinfo(np.int64).max)
    chunked = membership(tg, streams, lanes, slots, tg.budget)
    np.testing.assert_array_equal(held.dense(), want)
    np.testing.assert_array_equal(chunked.dense(), want)
    assert (np.diff(want.sum(axis=1)) > 0).all()
    # where the fills read past the windows first gathered (one source: the held pass reads its whole stream)
    assert (widened["chunked"] > 0, widened["held"] > 0) == {1: (True, False), 2: (False, False)}.get(
        seed, (True, seed == 4)
    ), widened


@st.composite
def _small_cases(draw: st.DrawFn) -> dict[str, Any]:
    n_src = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    long = draw(st.booleans())
    lanes = Lanes(seq_len=64, long_seq_len=256, threshold=64) if long else Lanes(seq_len=64)
    streams = []
    for k in range(n_src):
        n = int(rng.integers(5, 60))
        top = 300 if long else 64 * 3
        streams.append(build_stream(f"s{k}", seed, rng.integers(1, top, n).astype(np.uint32), lanes, 3))
    steps = draw(st.integers(1, 60))
    slots = rng.integers(1, 3, steps).astype(np.int64)
    w = rng.random(n_src) * (rng.random(n_src) < 0.8)  # some sources weightless: never filled from
    w[int(rng.integers(n_src))] += 0.05
    w /= w.sum()
    budget = (slots * 64 * draw(st.sampled_from([0.3, 0.96]))).astype(np.int64)
    targets = np.cumsum(w * budget[:, None], axis=0)
    return {"targets": targets, "streams": streams, "slots": slots, "lanes": lanes, "chunk": draw(st.integers(1, 9))}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_small_cases())
def test_the_compiled_fill_matches_a_plain_loop_on_random_small_cases(case: dict[str, Any]) -> None:
    streams, slots, lanes, targets = case["streams"], case["slots"], case["lanes"], case["targets"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_mixture, "REPAIR_CHUNK_CELLS", case["chunk"] * len(streams))
        mp.setattr(_mixture, "REPAIR_WINDOW", 40)
        got = _dense_or_refused(lambda: membership(targets, streams, lanes, slots, slots * lanes.seq_len).dense())
    want = _dense_or_refused(lambda: _reference(targets, streams, lanes, slots))
    if isinstance(want, tuple) or isinstance(got, tuple):  # a stream run out: both refuse the same step and source
        assert got == want
    else:
        np.testing.assert_array_equal(got, want)


def _dense_or_refused(run: Callable[[], np.ndarray]) -> np.ndarray | tuple[int, int]:
    """The pointers, or (step, source) of the StreamRunOut refusing a fill."""
    try:
        return run()
    except _mixture.StreamRunOut as e:
        return (e.step, e.source)


def _plan_50(tmp_path: Path, spec_of: Callable[..., Any], steps: int, **kw: Any) -> Any:
    names = [f"s{i}" for i in range(50)]
    return spec_of(tmp_path, names, seq_len=_SEQ, dp=1, micro_batches=1, steps=steps, **kw), names


def _index_50(names: list[str], index_of: Callable[..., pa.Table]) -> dict[str, pa.Table]:
    rng = np.random.default_rng(5)
    return {n: index_of(rng.integers(20, 41, 300)) for n in names}


def test_fifty_equal_sources_at_dp1_plan_every_step_with_their_shares(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Callable[..., pa.Table]
) -> None:
    spec, names = _plan_50(tmp_path, spec_of, 300)
    index = _index_50(names, index_of)
    res = make_plan(spec, index=index)
    m = read_manifest(res.plan_dir, res.meta)
    step = m["step"].to_numpy()
    assert set(np.unique(step).tolist()) == set(range(300))  # every step draws
    tokens = np.bincount(m["source"].to_numpy(), weights=m["length"].to_numpy().astype(np.float64), minlength=50)
    share = tokens / tokens.sum()
    assert np.abs(share - 1 / 50).max() < 0.25 / 50  # each source within a quarter of its 2 % over the run
    # no segment lost or twice: every (source, sample) at most once (the run draws under one epoch of each)
    key = m["source"].to_numpy().astype(np.int64) * 1_000_000 + m["sample"].to_numpy().astype(np.int64)
    assert len(np.unique(key)) == len(key)


def test_resuming_fifty_equal_sources_reproduces_the_straight_plan(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Callable[..., pa.Table]
) -> None:
    spec, names = _plan_50(tmp_path, spec_of, 60)
    spec = spec.model_copy(update={"planning": spec.planning.model_copy(update={"lookahead": 0})})
    index = _index_50(names, index_of)
    base = make_plan(spec, index=index)
    for at in (3, 25):  # inside the filled first steps, and after them
        res = make_plan(spec, index=index, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=at))
        assert read_manifest(res.plan_dir, res.meta).equals(read_manifest(base.plan_dir, base.meta))


def test_fifty_equal_sources_at_dp1_plan_in_ranges_as_on_one_process(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Callable[..., pa.Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)  # several ranges (cut at manifest file bounds)
    spec, names = _plan_50(tmp_path, spec_of, 120)
    index = _index_50(names, index_of)
    single = make_plan(spec, index=index).plan_dir
    want = _files(single.rename(single.with_name("single")))
    pool = _PicklingPool()
    got = _files(make_plan(spec, index=index, client=pool, ranges=4).plan_dir)
    assert len(pool.sent) > 3  # several ranges
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []


@pytest.mark.parametrize("seed", range(60))
def test_the_held_pass_fills_as_the_plain_loop_with_milestones_weightless_sources_and_small_windows(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CumulativeTargets (the held pass from the milestone on, the chunked pass before it), weightless sources,
    per-step slots, budgets below the documents, windows of 30 counts: the same pointers as the plain loop, or
    the same step and source refused where a weighted source's stream runs out."""
    rng = np.random.default_rng(seed)
    n_src, steps = int(rng.integers(1, 15)), int(rng.integers(1, 120))
    lanes = Lanes(seq_len=64)
    streams = [
        build_stream(f"s{k}", seed, rng.integers(1, 150, int(rng.integers(3, 80))).astype(np.uint32), lanes, 3)
        for k in range(n_src)
    ]
    w = rng.random(n_src) * (rng.random(n_src) < 0.7)
    w[int(rng.integers(n_src))] += 0.05
    w /= w.sum()
    slots = rng.integers(1, 3, steps).astype(np.int64)
    budget = (slots * 64 * rng.choice([0.3, 0.96])).astype(np.int64)
    milestone = None if rng.random() < 0.5 else int(rng.integers(1, steps + 1))
    tg = CumulativeTargets(_weights(w, steps, milestone), budget)
    want = _dense_or_refused(lambda: _reference(tg.rows(0, steps, None), streams, lanes, slots, tg.budget))
    monkeypatch.setattr(_mixture, "REPAIR_WINDOW", 30)
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", int(rng.integers(1, 9)) * n_src)
    got = _dense_or_refused(lambda: membership(tg, streams, lanes, slots, tg.budget).dense())
    if isinstance(want, tuple) or isinstance(got, tuple):
        assert got == want
    else:
        np.testing.assert_array_equal(got, want)
