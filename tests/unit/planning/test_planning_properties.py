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

from loomdata.planning import make_plan
from loomdata.schemas.errors import PlanError
from loomdata.schemas.plan import read_manifest, read_plan
from loomtest import plancheck as pc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=pc.planning_cases())
def test_plans_cover_each_epoch_once_fit_capacity_track_the_mixture_and_are_deterministic(
    case: dict[str, Any], spec_of: Callable[..., Any], index_of: Callable[..., pa.Table]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        spec = spec_of(Path(d), case["names"], **case["kwargs"])
        index = {n: index_of(ln, case["images"][n]) for n, ln in case["lengths"].items()}
        try:
            res = make_plan(spec, index=index)
        except PlanError as e:
            assume("found no room" not in str(e))  # (every step draws: membership fills an empty one)
            raise
        meta = read_plan(res.plan_dir)
        assert meta == res.meta
        m = read_manifest(res.plan_dir, meta)
        assert m.num_rows == sum(f.rows for f in meta.manifest)
        pc.check_slots(meta, m)
        steps = pq.read_table(res.plan_dir / "report" / "steps.parquet")
        deferred = steps["deferred_tokens"].to_numpy() > 0
        pc.check_coverage(meta, m, case["lengths"], case["images"], deferred)
        slots = spec.training.dp_size * spec.training.micro_batches
        assert meta.summary["unplaced_after_last_step"] == [] or any(v.any() for v in case["images"].values())
        if spec.long_context is None and slots >= 16:
            assert meta.summary["worst_mixture_error_pp"] <= 1.0
        # max rank cost / LB >= 1 on every step that neither deferred nor split a segment (split pieces cost
        # less than the whole segment the LB counts, L^2 being convex: such steps may dip just below 1)
        lb, loom_max = steps["lb"].to_numpy(), steps["loom_max"].to_numpy()
        src, smp = m["source"].to_numpy(), m["sample"].to_numpy().astype(np.int64)
        full = np.zeros(len(src), dtype=np.int64)
        for k, name in enumerate(meta.sources):
            sel = src == k
            full[sel] = np.asarray(case["lengths"][name], dtype=np.int64)[smp[sel]]
        piece = (m["offset"].to_numpy() > 0) | (m["length"].to_numpy().astype(np.int64) < full)
        split = np.zeros(len(lb), dtype=bool)
        split[m["step"].to_numpy()[piece]] = True
        whole = ~deferred & ~split & (lb > 0)
        assert (loom_max[whole] >= lb[whole] * (1.0 - 1e-9)).all()
        first = pc.files_of(res.plan_dir)
        shutil.rmtree(res.plan_dir)
        again = make_plan(spec, index=index)
        assert again.plan_dir == res.plan_dir
        assert pc.files_of(again.plan_dir) == first
