"""A windowed-draw plan (planning.draw_window, dp 1) on a real LocalCluster (2 worker processes) is the one-process
plan byte for byte: the ranges gather their steps through the draw's StepAssignment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.unit.planning.conftest import index_table, make_spec

from loomdata.planning import _manifest as manifest_module
from loomdata.planning import make_plan
from loomdata.schemas.plan import read_plan


def _files(plan_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(plan_dir).as_posix(): p.read_bytes() for p in sorted(plan_dir.rglob("*")) if p.is_file()}


def test_a_windowed_plan_on_the_cluster_is_the_one_process_plan(
    tmp_path: Path, dask_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 150)
    rng = np.random.default_rng(11)
    index = {
        "web": index_table(np.clip(rng.lognormal(np.log(60), 0.8, 5000), 4, 700).astype(np.uint32)),
        "code": index_table(np.clip(rng.lognormal(np.log(220), 0.8, 2000), 4, 700).astype(np.uint32)),
    }
    spec = make_spec(tmp_path, ["web", "code"], weights={"web": 0.7, "code": 0.3}, seq_len=256, steps=300, dp=1)
    spec = spec.model_copy(update={"planning": spec.planning.model_copy(update={"draw_window": 4})})
    single = make_plan(spec, index=index).plan_dir
    kept = single.rename(single.with_name("single-process"))
    want = _files(kept)
    dist = make_plan(spec, index=index, client=dask_client, ranges=6).plan_dir
    assert dist.name == single.name and len(read_plan(kept).manifest) > 4
    got = _files(dist)
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []
