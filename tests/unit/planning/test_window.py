"""The windowed draw at dp 1 (planning.draw_window, planning._window): the kernel's contracts on random streams
(every position placed once, bounded waits, the mixture near its target on every prefix, causal prefixes, stream
ends refused, curricula) and whole plans (coverage, default plans unchanged, dp > 1 unchanged, re-plans, the
cluster's ranges, image mixes, refusals)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from tests.loomtest.plancheck import check_coverage, check_slots
from tests.unit.planning.conftest import index_table, make_spec
from tests.unit.planning.test_distributed_planning import _files, _PicklingPool
from tests.unit.planning.test_membership_held import _weights

from loomdata.planning import PlanResume, _mixture, make_plan
from loomdata.planning import _manifest as manifest_module
from loomdata.planning._mixture import StepWeights, Stream, StreamRunOut, build_stream
from loomdata.planning._packing import Lanes
from loomdata.planning._window import MAX_WAIT, window_membership
from loomdata.schemas.errors import PlanError
from loomdata.schemas.plan import read_manifest
from loomdata.schemas.spec import Spec

_SEQ = 256


def _lengths(rng: np.random.Generator, mean: float, n: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(mean), 0.8, n), 4, 3 * _SEQ).astype(np.uint32)


def _streams(seed: int, means: list[float], n: int = 3000, epochs: int = 2) -> list[Stream]:
    rng = np.random.default_rng(seed)
    lanes = Lanes(seq_len=_SEQ)
    return [build_stream(f"s{k}", seed, _lengths(rng, m, n), lanes, epochs) for k, m in enumerate(means)]


def _check_run(streams: list[Stream], w: np.ndarray, steps: int, slots: int, window: int) -> tuple[Any, Any]:
    """Run the windowed draw and check its contracts; returns (dense pointers, assignment)."""
    weights = _weights(w, steps, None)
    ptr, asg = window_membership(weights, streams, _SEQ, np.full(steps, slots), window)
    dense = ptr.dense()
    assert (np.diff(dense, axis=0) >= 0).all()
    used = np.zeros(steps)
    per_src = np.zeros((steps, len(streams)))
    for k, st in enumerate(streams):
        pos, step = asg.pos[k].astype(np.int64), asg.step[k].astype(np.int64)
        assert len(np.unique(pos)) == len(pos), "a position taken twice"
        assert (np.diff(step) >= 0).all()
        # every position below each step's pointer was placed at an earlier step; none at or above was
        below = np.zeros(len(st.cum), dtype=bool)
        below[: dense[-1, k]] = True
        placed = np.zeros(len(st.cum), dtype=bool)
        placed[pos] = True
        assert (placed[below]).all(), "a position below the last pointer is not placed"
        for t in range(0, steps, max(1, steps // 17)):
            assert (step[pos < dense[t, k]] < t).all()
        ln = np.diff(st.cum)[pos]
        np.add.at(used, step, ln)
        np.add.at(per_src[:, k], step, ln)
        # a position waits from the step a later one of its source was taken at
        order = np.argsort(pos)
        skipped_at = np.minimum.accumulate(step[order][::-1])[::-1]  # the least step of this or a later position
        later = np.concatenate([skipped_at[1:], [np.iinfo(np.int64).max]])
        wait = step[order] - np.minimum(later, step[order])
        assert wait.max(initial=0) <= MAX_WAIT + len(streams) * (window - 1)
    assert (used <= slots * _SEQ).all(), "a step holds more than its rows"
    ws = weights.grid()
    target = np.cumsum(ws * used[:, None], axis=0)
    drawn = np.cumsum(per_src, axis=0)
    # greedy takes keep a source within seq_len ahead; the waiting segments' forced takes add to that (measured at
    # most 2.3 x seq_len here, 40 sources on one row)
    assert np.abs(drawn - target).max() <= 3 * _SEQ, np.abs(drawn - target).max()
    return dense, asg


@pytest.mark.parametrize(
    ("seed", "means", "window", "slots"),
    [(0, [40.0, 160.0], 4, 1), (1, [40.0, 160.0], 8, 2), (2, [30.0, 60.0, 200.0], 2, 1), (3, [80.0] * 12, 4, 1)],
)
def test_the_draw_places_every_position_once_with_bounded_waits_and_the_mixture_near_target(
    seed: int, means: list[float], window: int, slots: int
) -> None:
    streams = _streams(seed, means)
    w = np.linspace(1.0, 2.0, len(means))
    _, asg = _check_run(streams, w / w.sum(), 400, slots, window)
    # the point of it: the rows are nearly full (the default membership reaches ~0.9 here)
    used = sum(np.diff(st.cum)[asg.pos[k].astype(np.int64)].sum() for k, st in enumerate(streams))
    assert used / (400 * slots * _SEQ) > 0.95


def test_a_shorter_run_is_the_prefix_of_a_longer_one() -> None:
    streams = _streams(5, [40.0, 160.0])
    w = np.array([0.7, 0.3])
    short, a = _check_run(streams, w, 150, 1, 4)
    long, b = _check_run(streams, w, 400, 1, 4)
    assert (long[:151] == short).all()
    for k in range(2):
        sel = b.step[k] < 150
        assert (b.pos[k][sel] == a.pos[k]).all() and (b.step[k][sel] == a.step[k]).all()


def test_only_sources_weighted_at_a_step_are_drawn_but_their_waiting_segments() -> None:
    streams = _streams(6, [40.0, 160.0, 90.0])
    steps = 300
    # source 1 off for steps 100..199 (milestones held in between)
    xs = np.array([0.0, 99.0, 100.0, 199.0, 200.0])
    ys = np.array([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.0, 0.2], [0.5, 0.0, 0.2], [0.5, 0.3, 0.2]])
    held = 200
    sums = np.array([_mixture._interpolated(xs, ys, a, a + 1).sum() for a in range(held)])
    weights = StepWeights(xs, ys, ys[-1] / ys[-1].sum(), sums, held, 0, steps)
    assert (weights.grid()[100:200, 1] == 0).all() and (weights.grid()[:100, 1] > 0).all()
    _, asg = window_membership(weights, streams, _SEQ, np.ones(steps, dtype=np.int64), 4)
    pos, step = asg.pos[1].astype(np.int64), asg.step[1]
    off = (step >= 100) & (step < 200)
    before = pos[step < 100]
    # while unweighted, source 1 only gives back what it skipped before (positions below its frontier then)
    assert off.sum() <= 3 and (pos[off] < before.max()).all()
    assert ((step >= 200) & (step < 210)).any()


def test_a_window_past_the_stream_built_is_refused_naming_the_source() -> None:
    rng = np.random.default_rng(7)
    lanes = Lanes(seq_len=_SEQ)
    streams = [
        build_stream("big", 7, _lengths(rng, 40, 5000), lanes, 1),
        build_stream("small", 7, _lengths(rng, 40, 30), lanes, 1),
    ]
    with pytest.raises(StreamRunOut) as e:
        window_membership(_weights(np.array([0.5, 0.5]), 200, None), streams, _SEQ, np.ones(200, dtype=np.int64), 4)
    assert e.value.source == 1


# ---- whole plans -------------------------------------------------------------------------------------------------


def _index(seed: int = 0, images: bool = False) -> dict[str, pa.Table]:
    rng = np.random.default_rng(seed)
    web, code = _lengths(rng, 60, 6000), _lengths(rng, 220, 2000)
    img = np.where(rng.random(len(web)) < 0.05, 16, 0) if images else None
    if img is not None:  # image samples cannot be split: within a row
        web = np.where(img > 0, np.clip(web, 17, _SEQ - 1), web).astype(np.uint32)
    return {"web": index_table(web, img), "code": index_table(code)}


def _spec(tmp: Path, window: int, **kw: Any) -> Spec:
    spec = make_spec(tmp, ["web", "code"], weights={"web": 0.7, "code": 0.3}, seq_len=_SEQ, **kw)
    return spec.model_copy(update={"planning": spec.planning.model_copy(update={"draw_window": window})})


def _lengths_of(index: dict[str, pa.Table]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    return (
        {k: t["num_tokens"].to_numpy() for k, t in index.items()},
        {k: t["num_image_tokens"].to_numpy() for k, t in index.items()},
    )


def test_the_default_keeps_plan_ids_and_a_window_plans_full_rows_covering_each_epoch(tmp_path: Path) -> None:
    index = _index()
    plain = make_spec(tmp_path, ["web", "code"], weights={"web": 0.7, "code": 0.3}, seq_len=_SEQ, steps=300, dp=1)
    zero = _spec(tmp_path, 0, steps=300, dp=1, micro_batches=2)
    assert "draw_window" not in zero.canonical_json() and zero.canonical_json() == plain.canonical_json()
    assert '"draw_window":4' in _spec(tmp_path, 4, steps=300, dp=1).content_json()
    reals = {}
    for w in (0, 4):
        spec = _spec(tmp_path, w, steps=300, dp=1, micro_batches=2)
        res = make_plan(spec, index=index)
        m = read_manifest(res.plan_dir, res.meta)
        check_slots(res.meta, m)
        lengths, images = _lengths_of(index)
        check_coverage(res.meta, m, lengths, images, np.zeros(300, dtype=bool))
        assert res.meta.summary["unplaced_after_last_step"] == []
        reals[w] = m["length"].to_numpy().sum() / (300 * 2 * _SEQ)
        tok = np.bincount(m["source"].to_numpy(), weights=m["length"].to_numpy())
        if w:  # (the default membership draws code at ~0.28 here)
            assert abs(tok[1] / tok.sum() - 0.3) < 0.01
        if w == 0:
            assert res.meta.plan_id == make_plan(zero, index=index).meta.plan_id
            assert "draw_window" not in (res.plan_dir / "plan.json").read_text()
    assert reals[4] > reals[0] + 0.03 and reals[4] > 0.95, reals


def test_at_dp_above_one_the_window_changes_nothing_but_the_id(tmp_path: Path) -> None:
    index = _index(1)
    a = make_plan(_spec(tmp_path, 0, steps=120, dp=4, micro_batches=1), index=index)
    b = make_plan(_spec(tmp_path, 8, steps=120, dp=4, micro_batches=1), index=index)
    assert a.meta.plan_id != b.meta.plan_id
    assert any(k.startswith("manifest/") for k in _files(a.plan_dir))
    assert read_manifest(a.plan_dir, a.meta).equals(read_manifest(b.plan_dir, b.meta))


def test_a_replan_at_dp_one_continues_exactly_and_another_dp_or_window_is_refused(tmp_path: Path) -> None:
    index = _index(2)
    base = make_plan(_spec(tmp_path, 4, steps=200, dp=1, micro_batches=1), index=index)
    fresh = make_plan(_spec(tmp_path, 4, steps=260, dp=1, micro_batches=1), index=index)
    at = 90
    re = make_plan(
        _spec(tmp_path, 4, steps=260, dp=1, micro_batches=1),
        index=index,
        resume_from=PlanResume(plan_dir=base.plan_dir, at_step=at),
    )
    got, want = read_manifest(re.plan_dir, re.meta), read_manifest(fresh.plan_dir, fresh.meta)
    assert got.equals(want)  # base steps < 90 and the new steps: the fresh longer plan's rows exactly
    lengths, images = _lengths_of(index)
    check_coverage(re.meta, got, lengths, images, np.zeros(260, dtype=bool))
    with pytest.raises(PlanError, match=r"planning\.draw_window"):
        make_plan(
            _spec(tmp_path, 4, steps=260, dp=2, micro_batches=1),
            index=index,
            resume_from=PlanResume(plan_dir=base.plan_dir, at_step=at),
        )
    with pytest.raises(PlanError, match=r"planning\.draw_window differs"):
        make_plan(
            _spec(tmp_path, 2, steps=260, dp=1, micro_batches=1),
            index=index,
            resume_from=PlanResume(plan_dir=base.plan_dir, at_step=at),
        )


def test_the_clusters_ranges_give_the_one_process_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 200)  # several ranges (cut at manifest file bounds)
    index = _index(3)
    spec = _spec(tmp_path, 4, steps=400, dp=1, micro_batches=2)
    single = make_plan(spec, index=index).plan_dir
    want = _files(single.rename(single.with_name("single")))  # (the same id again would be a no-op)
    pool = _PicklingPool()
    got = _files(make_plan(spec, index=index, client=pool, ranges=4).plan_dir)
    assert len(pool.sent) >= 3
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    assert [k for k in want if got[k] != want[k]] == []


def test_image_mixes_keep_membership_as_drawn_and_long_lanes_are_refused(tmp_path: Path) -> None:
    index = _index(4, images=True)
    a = make_plan(_spec(tmp_path, 0, steps=80, dp=1, micro_batches=2), index=index)
    b = make_plan(_spec(tmp_path, 4, steps=80, dp=1, micro_batches=2), index=index)
    assert read_manifest(a.plan_dir, a.meta).equals(read_manifest(b.plan_dir, b.meta))
    spec = _spec(tmp_path, 4, steps=40, dp=1, micro_batches=2, long_context={"seq_len": 2 * _SEQ, "threshold": _SEQ})
    with pytest.raises(PlanError, match="draw_window 4 does not take a long_context"):
        make_plan(spec, index=_index(5))
