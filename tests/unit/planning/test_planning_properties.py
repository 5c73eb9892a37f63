"""Property tests of make_plan on random indexes and specs: coverage per epoch, capacity, mixture, determinism."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from loomdata.planning import make_plan
from loomdata.schemas.errors import PlanError
from loomdata.schemas.plan import PlanMeta, read_manifest, read_plan


@st.composite
def planning_cases(draw: st.DrawFn) -> dict[str, Any]:
    seq_len = draw(st.sampled_from([64, 128]))
    long = draw(st.booleans())
    n_src = draw(st.integers(1, 3))
    names = [f"s{i}" for i in range(n_src)]
    lengths = {}
    images = {}
    for name in names:
        n = draw(st.integers(5, 120))
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        ln = rng.integers(1, seq_len + 1, n)
        big = rng.random(n) < 0.1
        ln[big] = rng.integers(seq_len, 6 * seq_len, int(big.sum()))
        ln[rng.random(n) < 0.05] = 0  # empty samples are skipped, never planned
        if ln.sum() == 0:
            ln[0] = 1
        lengths[name] = ln
        img = np.zeros(n, dtype=np.int64)
        if draw(st.booleans()):  # a multimodal source: image samples are never split
            mm = (rng.random(n) < 0.3) & (ln > 1) & (ln <= seq_len)
            img[mm] = rng.integers(1, ln[mm] + 1) if mm.any() else 0
        images[name] = img
    dp = draw(st.sampled_from([1, 2, 3, 5, 8]))
    mb = draw(st.sampled_from([1, 2, 4]))
    assume(dp * mb >= 4)
    steps = draw(st.integers(21, 30))
    milestones = []
    for step in sorted(draw(st.sets(st.integers(1, steps - 1), max_size=2)) | {0}):
        w = {n: draw(st.sampled_from([0.0, 0.2, 1.0, 3.0])) for n in names}
        if not any(w.values()):
            w[names[0]] = 1.0
        milestones.append({"step": step, "weights": w})
    return {
        "names": names,
        "lengths": lengths,
        "images": images,
        "kwargs": {
            "schedule": milestones,
            "seq_len": seq_len,
            "steps": steps,
            "dp": dp,
            "micro_batches": mb,
            "seed": draw(st.integers(0, 1000)),
            "long_context": {"threshold": seq_len, "seq_len": 4 * seq_len, "cp_size": 2} if long else None,
        },
    }


def _files(plan_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(plan_dir)): p.read_bytes() for p in sorted(plan_dir.rglob("*")) if p.is_file()}


def _longest_run(flags: np.ndarray) -> int:
    best = run = 0
    for f in flags:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


def _check_coverage(
    meta: PlanMeta, m: pa.Table, lengths: dict[str, np.ndarray], images: dict[str, np.ndarray], deferred: np.ndarray
) -> None:
    """Per source epoch: no token planned twice before the epoch ends, every token planned once it has."""
    step = m["step"].to_numpy().astype(np.int64)
    for k, name in enumerate(meta.sources):
        sel = m["source"].to_numpy() == k
        ln = lengths[name].astype(np.int64)
        base = np.concatenate([[0], np.cumsum(ln)])
        sample = m["sample"].to_numpy()[sel].astype(np.int64)
        off = m["offset"].to_numpy()[sel].astype(np.int64)
        size = m["length"].to_numpy()[sel].astype(np.int64)
        assert (size > 0).all()
        assert (off + size <= ln[sample]).all(), "a segment runs past its sample's end"
        mm = images[name][sample] > 0
        assert (off[mm] == 0).all() and (size[mm] == ln[sample[mm]]).all(), "an image sample was split"
        if not sel.any():
            continue
        s_step = step[sel]
        epoch = int(base[-1])
        cum = np.cumsum(np.bincount(s_step, weights=size, minlength=meta.steps))
        start, end = base[sample] + off, base[sample] + off + size
        # an image sample a full step had no room for moves to the next step: epoch ends blur by as many
        # steps as deferrals ran in a row
        slack = 1 + _longest_run(deferred) if images[name].any() else 0
        for e in range(int(cum[-1] // epoch) + 1):
            # steps entirely before the end of epoch e: every token at most e+1 times
            t_end = int(np.searchsorted(cum, (e + 1) * epoch, side="left"))
            before = s_step < t_end - slack
            cov = np.zeros(epoch + 1, dtype=np.int64)
            np.add.at(cov, start[before], 1)
            np.add.at(cov, end[before], -1)
            assert np.cumsum(cov)[:-1].max(initial=0) <= e + 1, f"{name}: a token repeats within epoch {e}"
            if t_end + slack < meta.steps:  # epoch e ends in step t_end: by then every token appeared e+1 times
                upto = s_step <= t_end + slack
                cov[:] = 0
                np.add.at(cov, start[upto], 1)
                np.add.at(cov, end[upto], -1)
                assert np.cumsum(cov)[:-1].min() >= e + 1, f"{name}: a token is missing from epoch {e}"


def _check_slots(meta: PlanMeta, m: pa.Table) -> None:
    step = m["step"].to_numpy().astype(np.int64)
    rank = m["dp_rank"].to_numpy().astype(np.int64)
    mb = m["micro_batch"].to_numpy().astype(np.int64)
    lane = m["lane"].to_numpy().astype(np.int64)
    assert rank.max() < meta.dp_size and mb.max() < meta.micro_batches
    slot = (step * meta.dp_size + rank) * meta.micro_batches + mb
    assert (np.diff(slot) >= 0).all(), "manifest not sorted by (step, dp_rank, micro_batch)"
    used = np.bincount(slot, weights=m["length"].to_numpy())
    lane_of_slot = np.zeros(len(used), dtype=np.int64)
    lane_of_slot[slot] = lane
    assert (np.bincount(slot, weights=lane == lane_of_slot[slot]) == np.bincount(slot)).all(), "mixed lanes"
    cap = np.array([meta.lane_seq_len(0), meta.long_seq_len or 0])[lane_of_slot]
    assert (used <= cap).all(), "a micro-batch exceeds its capacity"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=planning_cases())
def test_plans_cover_each_epoch_once_fit_capacity_track_the_mixture_and_are_deterministic(
    case: dict[str, Any], spec_of: Callable[..., Any], index_of: Callable[..., pa.Table]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        spec = spec_of(Path(d), case["names"], **case["kwargs"])
        index = {n: index_of(ln, case["images"][n]) for n, ln in case["lengths"].items()}
        try:
            res = make_plan(spec, index=index)
        except PlanError as e:
            assume("draws no document" not in str(e) and "found no room" not in str(e))
            raise
        meta = read_plan(res.plan_dir)
        assert meta == res.meta
        m = read_manifest(res.plan_dir, meta)
        assert m.num_rows == sum(f.rows for f in meta.manifest)
        _check_slots(meta, m)
        deferred = pq.read_table(res.plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy() > 0
        _check_coverage(meta, m, case["lengths"], case["images"], deferred)
        slots = spec.training.dp_size * spec.training.micro_batches
        assert meta.summary["unplaced_after_last_step"] == [] or any(v.any() for v in case["images"].values())
        if spec.long_context is None and slots >= 16:
            assert meta.summary["worst_mixture_error_pp"] <= 1.0
        assert meta.summary["imbalance"]["loomdata"]["max"] >= 1.0 - 1e-9
        first = _files(res.plan_dir)
        shutil.rmtree(res.plan_dir)
        again = make_plan(spec, index=index)
        assert again.plan_dir == res.plan_dir
        assert _files(again.plan_dir) == first
