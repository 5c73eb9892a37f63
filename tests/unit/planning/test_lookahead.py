"""Look-ahead membership (planning.lookahead): every drawn position once, bounded moves, balance, mixture."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import pytest

from loomdata.planning import PlanResult, PlanResume, make_plan
from loomdata.planning._lookahead import HEAVY_SHARE, assign_steps, natural_positions
from loomdata.planning._mixture import build_stream, give_back_room, membership, step_weights
from loomdata.planning._packing import Lanes
from loomdata.schemas.plan import read_manifest
from loomdata.schemas.spec import Spec
from loomtest import plancheck as pc

SEQ = 4096


def _books_corpus(index_of: Callable[..., pa.Table], seed: int = 3) -> dict[str, pa.Table]:
    """Short web documents beside books several sequences long: many segments that fill a sequence."""
    rng = np.random.default_rng(seed)
    web = np.clip(rng.lognormal(6.2, 1.1, 8000), 16, 100_000).astype(np.uint32)
    papers = np.clip(rng.lognormal(8.8, 0.6, 600), 1000, 60_000).astype(np.uint32)
    books = np.clip(rng.lognormal(11.0, 0.7, 60), 8000, 1_000_000).astype(np.uint32)
    return {"web": index_of(web), "papers": index_of(papers), "books": index_of(books)}


def _spec(spec_of: Callable[..., Spec], wd: Path, lookahead: int, dp: int = 8, steps: int = 40) -> Spec:
    spec = spec_of(
        wd,
        ["web", "papers", "books"],
        weights={"web": 0.5, "papers": 0.25, "books": 0.25},
        seq_len=SEQ,
        steps=steps,
        dp=dp,
    )
    # linear = 6 * seq_len: a full sequence of one document costs about 1.17x one of short ones (4K at 7B)
    return spec.model_copy(
        update={
            "planning": spec.planning.model_copy(update={"lookahead": lookahead}),
            "cost": spec.cost.model_copy(update={"linear": 6.0 * SEQ}),
        }
    )


def _placed(plan: PlanResult) -> np.ndarray:
    """(source, sample) -> tokens placed over all steps plus those listed unplaced, as a sorted key table."""
    m = read_manifest(plan.plan_dir, plan.meta)
    key = m["source"].to_numpy().astype(np.int64) << 40 | m["sample"].to_numpy().astype(np.int64)
    extra = [
        (plan.meta.sources.index(u["source"]) << 40 | u["sample"], u["length"])
        for u in plan.meta.summary["unplaced_after_last_step"]
    ]
    keys = np.concatenate([key, np.array([e[0] for e in extra], dtype=np.int64)])
    tok = np.concatenate([m["length"].to_numpy().astype(np.int64), np.array([e[1] for e in extra], dtype=np.int64)])
    uk, inv = np.unique(keys, return_inverse=True)
    return np.stack([uk, np.bincount(inv, weights=tok).astype(np.int64)], 1)


def _stats(plan: PlanResult) -> tuple[float, float]:
    s = plan.meta.summary
    return s["imbalance"]["loomdata"]["mean"], s["worst_mixture_error_pp"]


def test_lookahead_places_every_drawn_token_once_and_balances(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> None:
    index = _books_corpus(index_of)
    off = make_plan(_spec(spec_of, tmp_path / "off", 0), index=index)
    on = make_plan(_spec(spec_of, tmp_path / "on", 3), index=index)
    assert off.meta.plan_id != on.meta.plan_id
    # the same segments, moved between steps: per sample the same tokens (nothing lost or doubled)
    np.testing.assert_array_equal(_placed(off), _placed(on))
    (lb_off, _), (lb_on, mix_on) = _stats(off), _stats(on)
    assert lb_on < lb_off - 0.005, (lb_on, lb_off)
    assert mix_on <= 1.0, mix_on


def test_lookahead_plans_are_deterministic(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> None:
    index = _books_corpus(index_of)
    a = make_plan(_spec(spec_of, tmp_path / "a", 2, steps=20), index=index)
    b = make_plan(_spec(spec_of, tmp_path / "b", 2, steps=20), index=index)
    assert a.meta.plan_id == b.meta.plan_id
    for fa, fb in zip(a.meta.manifest, b.meta.manifest, strict=True):
        assert (a.plan_dir / fa.path).read_bytes() == (b.plan_dir / fb.path).read_bytes()


@pytest.mark.parametrize("k", [1, 2, 5])
def test_assign_steps_covers_positions_and_bounds_heavy_moves(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table], k: int
) -> None:
    index = _books_corpus(index_of)
    spec = _spec(spec_of, tmp_path, k)
    lanes = Lanes.of(spec)
    n_steps, dp = spec.training.steps, spec.training.dp_size
    slots = np.full(n_steps, dp * spec.training.micro_batches, dtype=np.int64)
    lengths = [index[n].column("num_tokens").to_numpy() for n in spec.source_names]
    budget = slots * SEQ * spec.planning.fill
    targets = np.cumsum(step_weights(spec).grid() * budget[:, None], axis=0)
    streams = [build_stream(n, spec.seed, ln, lanes, 3) for n, ln in zip(spec.source_names, lengths, strict=True)]
    ptr = membership(targets, streams, lanes, slots, give_back_room(np.full(n_steps, dp), budget))
    pos, nat = natural_positions(ptr, 0, n_steps)
    asg = assign_steps(pos, nat, streams, lanes, slots, np.full(n_steps, dp), k, 0, n_steps)
    heavy_per_step = np.zeros(n_steps, dtype=np.int64)
    natural_heavy = np.zeros(n_steps, dtype=np.int64)
    for s, st in enumerate(streams):
        got = np.sort(asg.pos[s])
        np.testing.assert_array_equal(got, pos[s])  # every drawn position exactly once
        assert (np.diff(asg.step[s]) >= 0).all() and asg.step[s].min() >= 0 and asg.step[s].max() < n_steps
        natural = np.searchsorted(ptr.column(s), asg.pos[s], side="right") - 1
        seg_len = st.cum[asg.pos[s] + 1] - st.cum[asg.pos[s]]
        heavy = seg_len > HEAVY_SHARE * SEQ
        assert (np.abs(asg.step[s][heavy] - natural[heavy]) <= k).all()
        heavy_per_step += np.bincount(asg.step[s][heavy], minlength=n_steps)
        natural_heavy += np.bincount(natural[heavy], minlength=n_steps)
        # within a step, stream order
        for t in (0, n_steps // 2, n_steps - 1):
            p, _ = asg.range(s, t, t + 1)
            assert (np.diff(p) > 0).all()
    # after the first steps (where the mixture tolerance keeps moves small) most steps hold multiples of dp
    mult_on, mult_off = ((h[20:] % dp == 0).mean() for h in (heavy_per_step, natural_heavy))
    assert mult_on >= 0.5 and mult_on > mult_off + 0.2, (heavy_per_step, natural_heavy)
    assert heavy_per_step.sum() == sum(
        int(((st.cum[p + 1] - st.cum[p]) > HEAVY_SHARE * SEQ).sum()) for st, p in zip(streams, pos, strict=True)
    )


def test_lookahead_two_is_the_default_and_zero_keeps_membership() -> None:
    from loomdata.schemas.spec import PlanningSpec

    assert PlanningSpec().lookahead == 2
    with pytest.raises(ValueError):
        PlanningSpec(lookahead=-1)


def test_lookahead_keeps_every_epoch_before_the_next(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> None:
    """A source that wraps its epoch within the plan: no segment of the next epoch before one of the last."""
    rng = np.random.default_rng(4)
    web = np.clip(rng.lognormal(6.2, 1.1, 8000), 16, 100_000).astype(np.uint32)
    papers = np.clip(rng.lognormal(8.8, 0.6, 120), 1000, 60_000).astype(np.uint32)  # ~1M tokens an epoch
    index = {"web": index_of(web), "papers": index_of(papers)}
    plans = {}
    for k in (0, 2):
        mix = {"web": 0.4, "papers": 0.6}
        spec = spec_of(tmp_path / str(k), ["web", "papers"], weights=mix, seq_len=SEQ, steps=60, dp=8)
        spec = spec.model_copy(update={"planning": spec.planning.model_copy(update={"lookahead": k})})
        plans[k] = make_plan(spec, index=index)
    on = plans[2]
    m = read_manifest(on.plan_dir, on.meta)
    assert not read_manifest(plans[0].plan_dir, plans[0].meta).equals(m)
    epochs = m.filter(pa.compute.equal(m["source"], 1))["length"].to_numpy().sum() / papers.sum()
    assert epochs > 2.0, epochs  # the epoch boundaries fall inside the plan
    deferred = pq.read_table(on.plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy() > 0
    zeros = {n: np.zeros(len(v), dtype=np.int64) for n, v in (("web", web), ("papers", papers))}
    pc.check_coverage(on.meta, m, {"web": web, "papers": papers}, zeros, deferred)
    assert on.meta.summary["unplaced_after_last_step"] == []


def _crossings(spec: Spec, index: dict[str, pa.Table]) -> np.ndarray:
    """Per step S, how many heavy segments the look-ahead moves across the boundary before S (either way)."""
    lanes = Lanes.of(spec)
    n_steps, dp = spec.training.steps, spec.training.dp_size
    slots = np.full(n_steps, dp * spec.training.micro_batches, dtype=np.int64)
    lengths = [index[n].column("num_tokens").to_numpy() for n in spec.source_names]
    budget = slots * SEQ * spec.planning.fill
    targets = np.cumsum(step_weights(spec).grid() * budget[:, None], axis=0)
    streams = [build_stream(n, spec.seed, ln, lanes, 3) for n, ln in zip(spec.source_names, lengths, strict=True)]
    ptr = membership(targets, streams, lanes, slots, give_back_room(np.full(n_steps, dp), budget))
    pos, nat = natural_positions(ptr, 0, n_steps)
    asg = assign_steps(pos, nat, streams, lanes, slots, np.full(n_steps, dp), spec.planning.lookahead, 0, n_steps)
    out = np.zeros(n_steps + 1, dtype=np.int64)
    for k in range(len(streams)):
        natural = np.searchsorted(ptr.column(k), asg.pos[k], side="right") - 1
        lo, hi = np.minimum(natural, asg.step[k]), np.maximum(natural, asg.step[k])
        moved = lo < hi  # crosses every boundary before S for lo < S <= hi
        np.add.at(out, lo[moved] + 1, 1)
        np.add.at(out, hi[moved] + 1, -1)
    return np.cumsum(out)[:n_steps]


def _mean_from(plan: PlanResult, at: int) -> float:
    """Mean max rank cost / LB over steps >= at, from the plan's report."""
    t = pq.read_table(plan.plan_dir / "report" / "steps.parquet")
    return float((t["loom_max"].to_numpy() / t["lb"].to_numpy())[at:].mean())


def _check_replan(base: PlanResult, res: PlanResult, at: int, index: dict[str, pa.Table]) -> None:
    """Steps < at are the base's rows; base and new steps plan every token once per epoch; new steps fit."""
    assert read_manifest(res.plan_dir, res.meta, 0, at - 1).equals(read_manifest(base.plan_dir, base.meta, 0, at - 1))
    m = read_manifest(res.plan_dir, res.meta)
    lengths = {n: t.column("num_tokens").to_numpy() for n, t in index.items()}
    images = {n: t.column("num_image_tokens").to_numpy() for n, t in index.items()}
    deferred = pq.read_table(res.plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy() > 0
    pc.check_coverage(res.meta, m, lengths, images, deferred)
    pc.check_slots(res.meta, m.filter(pa.compute.greater_equal(m["step"], at)))


@pytest.mark.parametrize(("dp_from", "dp_to"), [(8, 4), (4, 8)])
def test_replan_inside_a_lookahead_window_plans_every_token_once(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., Any], dp_from: int, dp_to: int
) -> None:
    index = _books_corpus(index_of)
    base_spec = _spec(spec_of, tmp_path, 2, dp=dp_from)
    cross = _crossings(base_spec, index)
    at = int(np.flatnonzero(cross[10:] >= 2)[0]) + 10  # the base moved heavy segments across this boundary
    base = make_plan(base_spec, index=index)
    spec = _spec(spec_of, tmp_path, 2, dp=dp_to, steps=44)
    res = make_plan(spec, index=index, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=at))
    _check_replan(base, res, at, index)
    # the new steps still balance better than membership as drawn would (a fresh plan of the new shape, K = 0)
    fresh_off = make_plan(_spec(spec_of, tmp_path / "off", 0, dp=dp_to, steps=44), index=index)
    resumed = res.meta.summary["resumed"]["imbalance"]["loomdata"]["mean"]
    assert resumed == pytest.approx(_mean_from(res, at))
    assert resumed < _mean_from(fresh_off, at) - 0.005, (resumed, _mean_from(fresh_off, at))
    assert res.meta.summary["worst_mixture_error_pp"] <= 1.0
    # deterministic: the same inputs give the same id and byte-identical files
    first = pc.files_of(res.plan_dir)
    shutil.rmtree(res.plan_dir)
    again = make_plan(spec, index=index, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=at))
    assert again.plan_dir == res.plan_dir and pc.files_of(again.plan_dir) == first


@pytest.mark.parametrize(("k_base", "k_new"), [(2, 0), (0, 2), (2, 5)])
def test_replans_may_change_the_lookahead_and_chain(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., Any], k_base: int, k_new: int
) -> None:
    """Look-ahead switched on, off or widened at a re-plan, then re-planned again: every token once per epoch."""
    index = _books_corpus(index_of)
    base = make_plan(_spec(spec_of, tmp_path, k_base, dp=8, steps=30), index=index)
    mid = make_plan(
        _spec(spec_of, tmp_path, k_new, dp=4, steps=30),
        index=index,
        resume_from=PlanResume(plan_dir=base.plan_dir, at_step=11),
    )
    _check_replan(base, mid, 11, index)
    last = make_plan(
        _spec(spec_of, tmp_path, k_new, dp=6, steps=36),
        index=index,
        resume_from=PlanResume(plan_dir=mid.plan_dir, at_step=19),
    )
    _check_replan(mid, last, 19, index)
    assert [s.dp_size for s in last.meta.parameters.shape_schedule or []] == [8, 4, 6]


def test_assign_steps_keeps_a_deferred_position_within_k_of_its_natural_step() -> None:
    """A position a re-plan's base deferred (natural step before t0) is assigned by its natural step + K."""
    lanes = Lanes(seq_len=SEQ)
    lengths = np.full(64, SEQ - 10, dtype=np.uint32)  # all heavy
    st = build_stream("h", 0, lengths, lanes, 1)
    pos = [np.arange(40, dtype=np.int64)]
    nat = [np.concatenate([[3, 4], np.repeat(np.arange(5, 24), 2)]).astype(np.int64)]  # two deferred from 3, 4
    slots, dp = np.full(24, 16, dtype=np.int64), np.full(24, 3, dtype=np.int64)
    asg = assign_steps(pos, nat, [st], lanes, slots, dp, 2, 5, 24)
    step_of = dict(zip(asg.pos[0].tolist(), asg.step[0].tolist(), strict=True))
    assert step_of[0] <= 5 and step_of[1] <= 6
    assert sorted(step_of) == list(range(40))


def _with_tolerance(spec: Spec, tolerance: float, micro_batches: int = 1) -> Spec:
    """One micro-batch a rank: a step holds few sequence-long segments, so the mixture tolerance decides moves."""
    return spec.model_copy(
        update={
            "planning": spec.planning.model_copy(update={"lookahead": 4, "lookahead_tolerance": tolerance}),
            "training": spec.training.model_copy(update={"micro_batches": micro_batches}),
        }
    )


def _sum_step_max(plan: PlanResult) -> float:
    """The plan's simulated time: each step's slowest rank, summed (report/steps.parquet)."""
    t = pq.read_table(plan.plan_dir / "report" / "steps.parquet", columns=["loom_max"])
    return float(pa.compute.sum(t["loom_max"]).as_py())


def test_a_looser_lookahead_tolerance_moves_more_and_keeps_every_token(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> None:
    index = _books_corpus(index_of)
    base = _spec(spec_of, tmp_path / "spec", 2, dp=8, steps=40)
    tight = make_plan(_with_tolerance(base, 0.0075).model_copy(update={"workdir": tmp_path / "tight"}), index=index)
    loose = make_plan(_with_tolerance(base, 0.1).model_copy(update={"workdir": tmp_path / "loose"}), index=index)
    assert tight.meta.plan_id != loose.meta.plan_id
    np.testing.assert_array_equal(_placed(tight), _placed(loose))  # the same tokens, moved between steps
    assert tight.meta.summary["tokens"] == loose.meta.summary["tokens"]
    # the looser bound lets heavy segments gather into steps of dp of them: less simulated time, same tokens
    assert _sum_step_max(loose) < 0.97 * _sum_step_max(tight), (_sum_step_max(loose), _sum_step_max(tight))
    # and it is what bounds the mixture: the worst prefix error stays near the tolerance it allows
    assert _stats(loose)[1] <= 100 * 0.1 + 1.0


def test_the_default_lookahead_tolerance_keeps_plan_ids(spec_of: Callable[..., Spec], tmp_path: Path) -> None:
    from loomdata.schemas.spec import LOOKAHEAD_TOLERANCE, PlanningSpec

    spec = _spec(spec_of, tmp_path, 2)
    explicit = spec.model_copy(
        update={"planning": spec.planning.model_copy(update={"lookahead_tolerance": LOOKAHEAD_TOLERANCE})}
    )
    assert PlanningSpec().lookahead_tolerance == LOOKAHEAD_TOLERANCE == 0.0075
    assert "lookahead_tolerance" not in spec.content_json()  # specs written before the key plan as they did
    assert explicit.content_hash() == spec.content_hash()
    assert _with_tolerance(spec, 0.05, micro_batches=2).content_hash() != spec.content_hash()
    with pytest.raises(ValueError):
        PlanningSpec(lookahead_tolerance=0)
