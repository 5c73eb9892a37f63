"""The plan report's context-parallel figures: every long-lane sequence priced per CP rank, from the manifest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loomdata.planning import make_plan, plan_report
from loomdata.schemas import cp_positions, read_manifest
from loomtest.golden_plans import CASES


def test_long_lane_sequences_are_priced_per_cp_rank(tmp_path: Path) -> None:
    spec, index, kw = CASES["long_lane_cp4"](tmp_path)
    res = make_plan(spec, index=index, **kw)
    rep = plan_report(res.plan_dir)
    cp = rep["context_parallel"]
    m = read_manifest(res.plan_dir, res.meta)
    lane = m.column("lane").to_numpy()
    key = [m.column(c).to_numpy()[lane == 1].astype(np.int64) for c in ("step", "dp_rank", "micro_batch")]
    slots = {tuple(k) for k in np.stack(key, 1).tolist()}
    assert cp["cp_size"] == 4 and cp["sequences"] == len(slots) > 0
    # the obvious count, token by token, for every long sequence: attention (2p + 1) + linear per real token
    length = m.column("length").to_numpy()[lane == 1].astype(np.int64)
    seq_len, cost = spec.long_context.seq_len if spec.long_context else 0, spec.cost
    ratios, worst, even = [], 0.0, 0.0
    for slot in sorted(slots):
        mask = np.all(np.stack(key, 1) == np.array(slot), axis=1)
        per_pos = np.zeros(seq_len)
        at = 0
        for n in length[mask].tolist():
            per_pos[at : at + n] = cost.attention * (2 * np.arange(n) + 1) + cost.linear
            at += n
        ranks = np.array([per_pos[cp_positions(seq_len, 4, i)].sum() for i in range(4)])
        ratios.append(ranks.max() / ranks.mean())
        worst += ranks.max()
        even += ranks.mean()
    assert cp["imbalance"]["mean"] == pytest.approx(np.mean(ratios), rel=1e-9)
    assert cp["imbalance"]["max"] == pytest.approx(np.max(ratios), rel=1e-9)
    assert cp["time_ratio"] == pytest.approx(worst / even, rel=1e-9)
    assert cp["time_ratio"] >= 1.0


def test_no_figures_without_a_context_parallel_long_lane(tmp_path: Path) -> None:
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    res = make_plan(spec, index=index, **kw)
    assert "context_parallel" not in plan_report(res.plan_dir)
