"""The report's (steps x sources) tables without whole grids: weights worked out when written, token counts in
uint32 until one does not fit, report/steps.parquet, sources.parquet and weights.parquet written a row group of
steps at a time (the (step, source) cells that place tokens, the steps whose weights change)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.planning import _report, make_plan
from loomdata.planning._mixture import step_weights
from loomdata.planning._report import ReportBuilder, StepFigures, source_columns
from loomdata.planning._resume import PlanResume
from loomdata.schemas.spec import Spec
from loomdata.schemas.tables import TableKind, read_table, write_table, write_table_parts

STEPS, DP = 60, 4
SCHEDULE = [
    {"step": 0, "weights": {"web": 0.7, "code": 0.2, "books": 0.1}},
    {"step": 25, "weights": {"web": 0.2, "code": 0.5, "books": 0.3}},
]


def _plan(root: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table], name: str) -> tuple[Spec, Path]:
    rng = np.random.default_rng(11)
    index = {n: index_of(rng.integers(20, 400, 3000)) for n in ("web", "code", "books")}
    spec = spec_of(root / name, ["web", "code", "books"], schedule=SCHEDULE, steps=STEPS, dp=DP, seq_len=256)
    return spec, make_plan(spec, index=index).plan_dir


def test_steps_table_in_row_groups_holds_what_one_table_does(
    tmp_path: Path,
    spec_of: Callable[..., Spec],
    index_of: Callable[..., pa.Table],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec, whole = _plan(tmp_path, spec_of, index_of, "whole")
    monkeypatch.setattr(_report, "step_rows", lambda n_sources: 7)
    _, parts = _plan(tmp_path, spec_of, index_of, "parts")
    for name, kind, groups in (
        ("steps", TableKind.PLAN_STEPS, -(-STEPS // 7)),
        ("sources", TableKind.PLAN_SOURCES, -(-STEPS // 7)),
        ("weights", TableKind.PLAN_WEIGHTS, -(-26 // 7)),  # only blocks of steps with a change (steps 0..25)
    ):
        a, b = (p / "report" / f"{name}.parquet" for p in (whole, parts))
        assert pq.ParquetFile(a).num_row_groups == 1
        assert pq.ParquetFile(b).num_row_groups == groups
        assert read_table(b, kind).equals(read_table(a, kind))
    # the weights are the schedule's, interpolated, every step (worked out a row group at a time)
    grid = step_weights(spec).grid()
    got = source_columns(parts, spec.source_names)
    for k, name in enumerate(spec.source_names):
        assert np.array_equal(got[f"weight__{name}"], grid[:, k])
    # only the steps whose weights change have a row: the interpolated ones, then the held one once
    changes = np.flatnonzero(np.r_[True, (grid[1:] != grid[:-1]).any(axis=1)])
    weights = read_table(parts / "report" / "weights.parquet", TableKind.PLAN_WEIGHTS)
    assert weights.column("step").to_numpy().tolist() == changes.tolist() and len(changes) < STEPS
    # the (step, source) cells that place tokens, step-major, each source's tokens the steps' totals
    cells = read_table(parts / "report" / "sources.parquet", TableKind.PLAN_SOURCES)
    step, src, tok = (cells.column(c).to_numpy().astype(np.int64) for c in ("step", "source", "tokens"))
    assert (tok > 0).all() and (np.diff(step * 8 + src) > 0).all()
    steps = read_table(parts / "report" / "steps.parquet", TableKind.PLAN_STEPS)
    assert np.array_equal(np.bincount(step, weights=tok, minlength=STEPS), steps.column("tokens").to_numpy())
    assert "tokens__web" not in steps.column_names and got["tokens__web"].dtype == np.int64
    # a step range reads only its rows (and each step's weights row, the last at or before it)
    part = source_columns(parts, spec.source_names, 30, 44)
    for key, col in got.items():
        assert np.array_equal(part[key], col[30:45])
    # any of the plan's sources in any order: each named source's own columns (the table keeps plan.json's ids)
    some = source_columns(parts, ["books", "web"])
    assert set(some) == {"tokens__books", "weight__books", "tokens__web", "weight__web"}
    for key, col in some.items():
        assert np.array_equal(col, got[key])
    with pytest.raises(KeyError, match="no source"):
        source_columns(parts, ["nope"])


def test_a_fixed_mixture_writes_one_weights_row(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> None:
    rng = np.random.default_rng(3)
    index = {n: index_of(rng.integers(20, 400, 3000)) for n in ("web", "code")}
    spec = spec_of(tmp_path, ["web", "code"], steps=20, dp=DP, seq_len=256)
    res = make_plan(spec, index=index)
    weights = read_table(res.plan_dir / "report" / "weights.parquet", TableKind.PLAN_WEIGHTS)
    assert weights.num_rows == 1 and weights.column("step").to_pylist() == [0]
    got = source_columns(res.plan_dir, spec.source_names)
    assert np.array_equal(got["weight__web"], np.full(20, step_weights(spec).grid()[0, 0]))


def test_one_part_is_the_bytes_of_write_table(tmp_path: Path) -> None:
    t = pa.table({"step": np.arange(100, dtype=np.uint32), "dp_rank": np.zeros(100, dtype=np.uint32)})
    t = t.append_column("loom_cost", pa.array(np.linspace(0, 1, 100)))
    t = t.append_column("concat_cost", pa.array(np.linspace(1, 2, 100)))
    t = t.append_column("packed_cost", pa.array(np.linspace(2, 3, 100)))
    write_table(t, tmp_path / "a.parquet", TableKind.PLAN_RANKS)
    write_table_parts([t], tmp_path / "b.parquet", TableKind.PLAN_RANKS)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    with pytest.raises(ValueError, match="no rows to write"):
        write_table_parts([], tmp_path / "c.parquet", TableKind.PLAN_RANKS)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize(("step_tokens", "first"), [(1000, np.uint16), (70_000, np.uint32)])
def test_token_counts_widen_when_one_does_not_fit(step_tokens: int, first: type, sparse: bool) -> None:
    """A step's capacity sizes the dense counts' type (uint16 at dp 4), the sparse counts' type is that of the
    largest count held; a count beyond it widens the type, exactly."""
    r = ReportBuilder(3, ["a", "b"], 2, step_tokens=step_tokens, sparse=sparse)
    assert r.tokens.dtype == (np.uint16 if sparse else first)

    def fig(tokens: list[int]) -> StepFigures:
        one = np.ones(2)
        return StepFigures(
            tokens=np.array(tokens, dtype=np.int64),
            lb=1.0,
            loom_rank=one,
            concat_rank=one,
            packed_rank=one,
            slot_cost=np.ones((2, 1)),
            packed_waiting_tokens=0,
            deferred_tokens=0,
            rank_max_item=one,
        )

    r.add(0, fig([5, 7]))
    r.add(1, fig([3, 70_000]))
    assert r.tokens.dtype == np.uint32 and r.tokens.rows(1, 2)[0, 1] == 70_000
    r.add(2, fig([1, 2**33 + 1]))
    assert r.tokens.dtype == np.int64
    got = r.tokens.rows(0, 3)
    assert got[:, 1].tolist() == [7, 70_000, 2**33 + 1] and got[:, 0].tolist() == [5, 3, 1]
    assert r.summary()["mixture"]["b"]["tokens"] == 7 + 70_000 + 2**33 + 1


def test_a_replan_onto_a_smaller_shape_keeps_its_bases_larger_counts(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> None:
    """A re-plan's counts are sized by the largest shape of its steps (its base's): the base's rows stay exact."""
    rng = np.random.default_rng(5)
    index = {"web": index_of(rng.integers(200, 4000, 40_000))}
    base = make_plan(spec_of(tmp_path / "base", ["web"], steps=12, dp=16, seq_len=4096), index=index)
    small = spec_of(tmp_path / "small", ["web"], steps=12, dp=2, seq_len=4096)
    res = make_plan(small, index=index, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=4))
    base_tokens = source_columns(base.plan_dir, ["web"])["tokens__web"]
    got = source_columns(res.plan_dir, ["web"])["tokens__web"]
    assert int(base_tokens[0]) > 65_535  # beyond uint16, which the small shape alone would take
    assert got.tolist()[:4] == base_tokens.tolist()[:4]
