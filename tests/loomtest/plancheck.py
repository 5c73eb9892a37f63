"""Shared planner test checks: random planning cases, per-epoch coverage, slot capacity, plan files.

Imported as `from loomtest import plancheck`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import assume
from hypothesis import strategies as st

from loomdata.schemas.plan import PLAN_FORMAT_VERSION, PlanMeta, PlanParameters
from loomdata.schemas.spec import CostSpec, Spec

__all__ = ["check_coverage", "check_slots", "files_of", "longest_run", "plan_meta", "planning_cases"]


def plan_meta(**fields: Any) -> PlanMeta:
    """A PlanMeta for tests that need only some of its fields (the rest: a one-source spec, default parameters)."""
    sources = fields.get("sources", ["web"])
    spec = Spec.model_validate(
        {
            "name": "t",
            "workdir": ".",
            "sources": [{"name": n, "format": "parquet", "paths": ["x"], "tokens_field": "ids"} for n in sources],
            "mixture": {"weights": dict.fromkeys(sources, 1.0)},
            "training": {
                "seq_len": fields.get("seq_len", 8),
                "steps": fields.get("steps", 1),
                "dp_size": fields.get("dp_size", 1),
                "micro_batches": fields.get("micro_batches", 1),
            },
        }
    )
    parameters = PlanParameters(
        planner_version="test", fill=0.96, step_budget_tokens=1, cost=CostSpec(), short_cp_size=1, baseline="-"
    )
    base: dict[str, Any] = {
        "format_version": PLAN_FORMAT_VERSION,
        "plan_id": "p",
        "spec": spec,
        "spec_hash": "h",
        "sources": sources,
        "index_fingerprints": {},
        "seed": 0,
        "steps": 1,
        "dp_size": 1,
        "micro_batches": 1,
        "seq_len": 8,
        "parameters": parameters,
        "manifest": [],
    }
    return PlanMeta(**{**base, **fields})


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


def files_of(plan_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(plan_dir)): p.read_bytes() for p in sorted(plan_dir.rglob("*")) if p.is_file()}


def longest_run(flags: np.ndarray) -> int:
    best = run = 0
    for f in flags:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


def check_coverage(
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
        # what a full step defers (an image sample it had no room for, the rest of a split text segment) goes
        # into the next step: epoch ends blur by as many steps as deferrals ran in a row
        slack = 1 + longest_run(deferred) if deferred.any() else 0
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


def check_slots(meta: PlanMeta, m: pa.Table) -> None:
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
