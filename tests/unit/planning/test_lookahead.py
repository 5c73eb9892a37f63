"""Look-ahead membership (planning.lookahead): every drawn position once, bounded moves, balance, mixture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from loomdata.planning import PlanResult, PlanResume, make_plan
from loomdata.planning._lookahead import HEAVY_SHARE, assign_steps, natural_positions
from loomdata.planning._mixture import build_stream, membership, step_weights
from loomdata.planning._packing import Lanes
from loomdata.schemas.errors import PlanError
from loomdata.schemas.plan import read_manifest
from loomdata.schemas.spec import Spec

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
    targets = np.cumsum(step_weights(spec) * budget[:, None], axis=0)
    streams = [build_stream(n, spec.seed, ln, lanes, 3) for n, ln in zip(spec.source_names, lengths, strict=True)]
    ptr = membership(targets, streams, lanes, slots)
    pos, nat = natural_positions(ptr, 0, n_steps)
    asg = assign_steps(pos, nat, streams, lanes, slots, np.full(n_steps, dp), k, 0, n_steps)
    heavy_per_step = np.zeros(n_steps, dtype=np.int64)
    natural_heavy = np.zeros(n_steps, dtype=np.int64)
    for s, st in enumerate(streams):
        got = np.sort(asg.pos[s])
        np.testing.assert_array_equal(got, pos[s])  # every drawn position exactly once
        assert (np.diff(asg.step[s]) >= 0).all() and asg.step[s].min() >= 0 and asg.step[s].max() < n_steps
        natural = np.searchsorted(ptr[:, s], asg.pos[s], side="right") - 1
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


def test_lookahead_zero_is_the_default_and_keeps_membership() -> None:
    from loomdata.schemas.spec import PlanningSpec

    assert PlanningSpec().lookahead == 0
    with pytest.raises(ValueError):
        PlanningSpec(lookahead=-1)


def test_replan_of_a_lookahead_plan_is_refused(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., Any]
) -> None:
    index = _books_corpus(index_of)
    base = make_plan(_spec(spec_of, tmp_path, 2, steps=12), index=index)
    spec = _spec(spec_of, tmp_path, 2, dp=4, steps=12)
    with pytest.raises(PlanError, match="look-ahead membership are not supported"):
        make_plan(spec, index=index, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=6))
