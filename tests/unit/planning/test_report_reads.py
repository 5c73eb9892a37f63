"""Report tables and manifests are read by step range: only the row groups holding the steps asked for."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.cli import main
from loomdata.planning import make_plan, plan_report
from loomdata.planning._plan import PLANNER_VERSION
from loomdata.planning._report import step_range_figures
from loomdata.planning._resume import PlanResume, base_report_rows, open_base
from loomdata.schemas.plan import read_manifest
from loomdata.schemas.spec import Spec
from loomdata.schemas.tables import ReadCount, TableKind, read_steps, read_table, step_span, write_table

DP, STEPS = 4, 40


@pytest.fixture(scope="module")
def plan_dir(
    tmp_path_factory: pytest.TempPathFactory, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> Path:
    """A real plan whose report tables are re-written in small row groups (ranks: one step a group)."""
    rng = np.random.default_rng(3)
    index = {n: index_of(rng.integers(20, 400, 4000)) for n in ("web", "code")}
    spec = spec_of(tmp_path_factory.mktemp("plan"), ["web", "code"], steps=STEPS, dp=DP, seq_len=256)
    res = make_plan(spec, index=index)
    for name, kind, group in (("ranks", TableKind.PLAN_RANKS, DP), ("steps", TableKind.PLAN_STEPS, 8)):
        path = res.plan_dir / "report" / f"{name}.parquet"
        write_table(read_table(path, kind), path, kind, row_group_size=group)
    return res.plan_dir


def test_ranks_table_is_many_row_groups(plan_dir: Path) -> None:
    pf = pq.ParquetFile(plan_dir / "report" / "ranks.parquet")
    assert pf.num_row_groups == STEPS and pf.metadata.num_rows == STEPS * DP
    assert step_span(plan_dir / "report" / "ranks.parquet", TableKind.PLAN_RANKS) == (0, STEPS - 1)


def test_read_steps_reads_only_the_row_groups_of_the_range(plan_dir: Path) -> None:
    path = plan_dir / "report" / "ranks.parquet"
    count = ReadCount()
    got = read_steps(path, TableKind.PLAN_RANKS, 10, 12, ["dp_rank", "loom_cost"], count)
    assert count.row_groups == 3 and count.rows == 3 * DP
    full = read_table(path, TableKind.PLAN_RANKS)
    step = full.column("step").to_numpy()
    want = full.filter(pa.array((step >= 10) & (step <= 12))).select(["dp_rank", "loom_cost"])
    assert got.equals(want)
    # a range inside one row group of the steps table (groups of 8 steps) reads that group, keeps the range
    count = ReadCount()
    t = read_steps(plan_dir / "report" / "steps.parquet", TableKind.PLAN_STEPS, 9, 10, ["tokens"], count)
    assert (count.row_groups, count.rows, t.num_rows, t.column_names) == (1, 8, 2, ["tokens"])
    assert read_steps(path, TableKind.PLAN_RANKS, STEPS + 5, STEPS + 9).num_rows == 0


def test_plan_report_step_range_reads_part_of_the_ranks_table(plan_dir: Path) -> None:
    count = ReadCount()
    rep = plan_report(plan_dir, (10, 12), count=count)
    fig = rep["step_range"]
    # steps table: the one group of steps 8..15; ranks table: the three groups of steps 10..12
    assert count.row_groups == 1 + 3 and count.rows == 8 + 3 * DP
    assert fig["steps"] == 3 and fig["rank_steps"] == 3
    ranks = read_table(plan_dir / "report" / "ranks.parquet", TableKind.PLAN_RANKS)
    cost = ranks.column("loom_cost").to_numpy().reshape(STEPS, DP)[10:13]  # rows in (step, dp_rank) order
    want = cost.max(axis=1) / cost.mean(axis=1)
    assert fig["rank_max_over_mean"]["max"] == pytest.approx(float(want.max()))
    assert fig["rank_max_over_mean"]["mean"] == pytest.approx(float(want.mean()))
    steps = read_table(plan_dir / "report" / "steps.parquet", TableKind.PLAN_STEPS)
    assert fig["tokens"] == int(steps.column("tokens").to_numpy()[10:13].sum())
    with pytest.raises(ValueError, match="empty"):
        step_range_figures(plan_dir, 5, 4)


def test_inspect_steps_option(plan_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(plan_dir), "--steps", "3:5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_range"]["first"] == 3 and out["step_range"]["steps"] == 3


def test_replan_reads_base_report_by_step_range_and_manifest_by_columns(plan_dir: Path) -> None:
    from loomdata.schemas.plan import read_plan

    meta = read_plan(plan_dir)
    base = open_base(PlanResume(plan_dir=plan_dir, at_step=5), meta.spec, meta.index_fingerprints, PLANNER_VERSION)
    rows = base_report_rows(base, ["deferred_tokens"])
    assert rows is not None and list(rows) == ["deferred_tokens"] and len(rows["deferred_tokens"]) == 5
    t = read_manifest(plan_dir, meta, 0, 4, columns=["source", "sample", "offset", "length"])
    assert t.column_names == ["source", "sample", "offset", "length"] and t.num_rows > 0
    assert read_manifest(plan_dir, meta, 0, 4).num_rows == t.num_rows


def test_plot_reads_the_heatmap_steps_of_a_many_row_group_ranks_table(plan_dir: Path, tmp_path: Path) -> None:
    from loomdata.planning import plot_plan

    plot_plan(plan_dir, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 10_000
