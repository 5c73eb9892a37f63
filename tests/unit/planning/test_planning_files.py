"""The plan dir: plan.json and manifest readable by the schemas readers, idempotence, partitions, report, plot."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from loomdata.planning import _manifest as manifest_module
from loomdata.planning import make_plan, plan_report, plot_plan
from loomdata.schemas.errors import ContractError, StaleIndexError
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.plan import check_fresh, read_manifest, read_plan
from loomdata.schemas.spec import parse_spec
from loomdata.schemas.tables import SHARDS_SCHEMA, TableKind, read_table, table_metadata, write_table
from loomtest.golden_plans import plan_hashes


def _web(n: int = 3000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.0, 1.0, n), 1, 1000).astype(np.int64)


def test_plan_files_are_readable_and_planning_again_is_a_no_op(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Any
) -> None:
    spec = spec_of(tmp_path, ["web", "code"], weights={"web": 3, "code": 1}, steps=30, dp=8, micro_batches=4)
    index = {"web": index_of(_web()), "code": index_of(_web(seed=1))}
    res = make_plan(spec, index=index)
    assert res.plan_dir == tmp_path / "plans" / res.meta.plan_id
    meta = read_plan(res.plan_dir)
    assert meta.sources == ["web", "code"] and meta.steps == 30 and meta.dp_size == 8
    assert meta.index_fingerprints["web"].startswith("mem-")
    m = read_manifest(res.plan_dir, meta, first_step=5, last_step=6, dp_ranks=[3])
    assert set(m["step"].to_pylist()) == {5, 6} and set(m["dp_rank"].to_pylist()) == {3}
    mtime = (res.plan_dir / "plan.json").stat().st_mtime_ns
    again = make_plan(spec, index=index)
    assert again.meta == meta and (res.plan_dir / "plan.json").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "plans").iterdir()] == [meta.plan_id]  # no temp dir left behind
    other = make_plan(spec.model_copy(update={"seed": 8}), index=index)
    assert other.meta.plan_id != meta.plan_id


def test_manifest_is_partitioned_by_step_range(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 50)
    spec = spec_of(tmp_path, ["web"], steps=25, dp=4, micro_batches=2)
    res = make_plan(spec, index={"web": index_of(_web())})
    files = res.meta.manifest
    assert len(files) > 3
    assert files[0].first_step == 0 and files[-1].last_step == 24
    assert all(a.last_step + 1 == b.first_step for a, b in itertools.pairwise(files))
    for f in files:
        steps = pq.read_table(res.plan_dir / f.path, columns=["step"])["step"].to_numpy()
        assert steps.min() >= f.first_step and steps.max() <= f.last_step and len(steps) == f.rows
    whole = read_manifest(res.plan_dir, res.meta)
    assert whole.num_rows == sum(f.rows for f in files)


def test_report_and_plot(tmp_path: Path, spec_of: Callable[..., Any], index_of: Any) -> None:
    spec = spec_of(
        tmp_path,
        ["web", "books"],
        steps=30,
        dp=8,
        micro_batches=4,
        seq_len=512,
        schedule=[
            {"step": 0, "weights": {"web": 0.9, "books": 0.1}},
            {"step": 20, "weights": {"web": 0.6, "books": 0.4}},
        ],
    )
    books = np.random.default_rng(2).integers(500, 3000, 300)
    res = make_plan(spec, index={"web": index_of(_web()), "books": index_of(books)})
    rep = plan_report(res.plan_dir)
    json.dumps(rep)
    assert rep["plan_id"] == res.meta.plan_id and rep["steps"] == 30
    loom, base = rep["imbalance"]["loomdata"], rep["imbalance"]["baseline"]
    assert 1.0 <= loom["mean"] <= loom["p99"] <= loom["max"]
    assert loom["mean"] < base["mean"] and rep["simulated_gain"] > 1.0
    assert rep["worst_mixture_error_pp"] < 1.0
    assert abs(rep["mixture"]["books"]["target_share"] - rep["mixture"]["books"]["realized_share"]) < 0.01
    steps = pq.read_table(res.plan_dir / "report" / "steps.parquet")
    assert steps.num_rows == 30 and sum(steps["tokens"].to_pylist()) == rep["tokens"]
    png = tmp_path / "out" / "plan.png"
    plot_plan(res.plan_dir, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write_index(workdir: Path, name: str, lengths: np.ndarray, fingerprint: str, index_of: Any) -> None:
    files = IndexFiles.of(workdir, name)
    write_table(index_of(lengths), files.samples, TableKind.INDEX, {"fingerprint": fingerprint})
    shards = SHARDS_SCHEMA.empty_table()
    write_table(shards, files.shards, TableKind.SHARDS)


def test_plans_from_index_files_and_refuses_a_stale_index(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Any
) -> None:
    _write_index(tmp_path, "web", _web(), "fp-1", index_of)
    spec = spec_of(tmp_path, ["web"], steps=12)
    meta = make_plan(spec).meta
    assert meta.index_fingerprints == {"web": "fp-1"}
    check_fresh(meta, {"web": IndexFiles.of(tmp_path, "web").fingerprint()})
    _write_index(tmp_path, "web", _web(seed=5), "fp-2", index_of)
    with pytest.raises(StaleIndexError, match=r"web \(plan fp-1, index fp-2\).*re-plan"):
        check_fresh(meta, {"web": IndexFiles.of(tmp_path, "web").fingerprint()})
    assert make_plan(spec).meta.plan_id != meta.plan_id  # a new index gives a new plan


def test_plan_json_holds_a_typed_spec_and_parameters_and_stamped_report_tables(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Any
) -> None:
    spec = spec_of(tmp_path, ["web"], steps=12, dp=2, micro_batches=2)
    res = make_plan(spec, index={"web": index_of(_web())})
    meta = read_plan(res.plan_dir)
    assert meta.spec == spec and meta.parameters.fill == spec.planning.fill == 0.96
    assert meta.parameters.resume is None and meta.parameters.shape_schedule is None
    for name, kind in (("steps", TableKind.PLAN_STEPS), ("ranks", TableKind.PLAN_RANKS)):
        path = res.plan_dir / "report" / f"{name}.parquet"
        assert table_metadata(path)["kind"] == kind.value
        assert read_table(path, kind).num_rows > 0
    # an unstamped report (as older planners wrote it) is refused where it is read back
    steps = res.plan_dir / "report" / "steps.parquet"
    pq.write_table(pq.read_table(steps).replace_schema_metadata(None), steps)
    with pytest.raises(ContractError, match="expected a loomdata plan_steps table, found kind 'none'"):
        plot_plan(res.plan_dir, tmp_path / "p.png")
    # a plan.json of the previous format is refused with the fix
    raw = json.loads((res.plan_dir / "plan.json").read_text())
    (res.plan_dir / "plan.json").write_text(json.dumps({**raw, "format_version": 1}))
    with pytest.raises(ContractError, match=r"plan format version 1 is not supported.*re-plan"):
        read_plan(res.plan_dir)


def test_plan_id_and_rows_do_not_depend_on_where_the_spec_data_and_workdir_are(tmp_path: Path, index_of: Any) -> None:
    def spec_in(root: Path) -> Any:
        raw = {
            "name": "t",
            "workdir": "work",  # relative: resolved against the spec's folder
            "tokenizer": {"kind": "huggingface", "path": "tok/tokenizer.json", "pad_token_id": 3},
            "sources": [{"name": "web", "format": "parquet", "paths": ["data/*.parquet"], "tokens_field": "ids"}],
            "mixture": {"weights": {"web": 1.0}},
            "training": {"seq_len": 128, "steps": 20, "dp_size": 4, "micro_batches": 2},
        }
        return parse_spec(raw, root, check_paths=False)

    a, b = spec_in(tmp_path / "here"), spec_in(tmp_path / "there" / "deeper")
    assert a.workdir != b.workdir and a.tokenizer.path != b.tokenizer.path
    index = {"web": index_of(_web())}
    pa_, pb = make_plan(a, index=index), make_plan(b, index=index)
    assert pa_.meta.plan_id == pb.meta.plan_id
    assert plan_hashes(pa_.plan_dir) == plan_hashes(pb.plan_dir)
    # what the spec asks for still counts: another pad token id is another plan
    other = b.model_copy(update={"tokenizer": b.tokenizer.model_copy(update={"pad_token_id": 4})})
    assert make_plan(other, index=index).meta.plan_id != pa_.meta.plan_id
