"""make_plan end to end on index tables written to a workdir (as `loom index` leaves them), long lane included."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc_compute
import pyarrow.parquet as pq
import pytest

from loomdata.planning import PlanResume, make_plan, plan_report, plot_plan
from loomdata.schemas.errors import StaleIndexError
from loomdata.schemas.layout import IndexFiles, read_index
from loomdata.schemas.plan import ResumeInfo, check_fresh, read_manifest, read_plan
from loomdata.schemas.spec import Spec, parse_spec
from loomdata.schemas.tables import SHARDS_SCHEMA, TableKind, write_table
from loomtest import plancheck

SEQ_LEN, LONG_SEQ_LEN = 1024, 4096


def _write_source(workdir: Path, name: str, lengths: np.ndarray, images: np.ndarray, shards: int) -> None:
    n = len(lengths)
    shard = (np.arange(n) * shards // max(n, 1)).astype(np.uint32)
    row = (np.arange(n) - np.searchsorted(shard, shard)).astype(np.uint64)
    samples = pa.table(
        {
            "sample": pa.array(np.arange(n, dtype=np.uint64)),
            "shard": pa.array(shard),
            "row": pa.array(row),
            "num_tokens": pa.array(lengths.astype(np.uint32)),
            "num_image_tokens": pa.array(images.astype(np.uint32)),
            "quality": pa.array(np.linspace(0, 1, n)),  # a carried metadata column
        }
    )
    files = IndexFiles.of(workdir, name)
    fingerprint = f"{name}-{int(lengths.sum())}-{n}"
    write_table(samples, files.samples, TableKind.INDEX, {"fingerprint": fingerprint})
    shards_table = pa.table(
        {
            "shard": pa.array(np.arange(shards, dtype=np.uint32)),
            "path": pa.array([f"/data/{name}/{i}.parquet" for i in range(shards)]),
            "size_bytes": pa.array(np.full(shards, 1000, dtype=np.uint64)),
            "mtime_ns": pa.array(np.zeros(shards, dtype=np.int64)),
            "fingerprint": pa.array([f"f{i}" for i in range(shards)]),
            "num_rows": pa.array(np.bincount(shard, minlength=shards).astype(np.uint64)),
        },
        schema=SHARDS_SCHEMA,
    )
    write_table(shards_table, files.shards, TableKind.SHARDS)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(3)
    web = np.clip(rng.lognormal(5.0, 1.0, 6000), 1, 20_000).astype(np.int64)
    books = rng.integers(2_000, 30_000, 150)
    caps = rng.integers(20, 80, 3000)
    cap_img = np.where(rng.random(3000) < 0.9, 256, 0)
    _write_source(tmp_path, "web", web, np.zeros_like(web), shards=4)
    _write_source(tmp_path, "books", books, np.zeros_like(books), shards=2)
    _write_source(tmp_path, "captions", caps + cap_img, cap_img, shards=3)
    return tmp_path


def _spec(workdir: Path, dp_size: int = 8, steps: int = 40) -> Spec:
    """Three sources (web, books with max_epochs, image captions), a curriculum and a long-context lane."""
    return parse_spec(
        {
            "name": "e2e",
            "workdir": str(workdir),
            "seed": 11,
            "sources": [
                {"name": "web", "format": "parquet", "paths": ["x"], "tokens_field": "ids"},
                {"name": "books", "format": "jsonl", "paths": ["x"], "text_field": "text", "max_epochs": 3},
                {"name": "captions", "format": "webdataset", "paths": ["x"], "text_field": "txt", "image_field": "jpg"},
            ],
            "mixture": {
                "schedule": [
                    {"step": 0, "weights": {"web": 0.7, "books": 0.1, "captions": 0.2}},
                    {"step": 30, "weights": {"web": 0.5, "books": 0.3, "captions": 0.2}},
                ]
            },
            "training": {"seq_len": SEQ_LEN, "steps": steps, "dp_size": dp_size, "micro_batches": 4},
            "long_context": {"threshold": SEQ_LEN, "seq_len": LONG_SEQ_LEN, "cp_size": 2},
        },
        workdir,
        check_paths=False,
    )


def test_plan_from_index_files_with_a_long_lane(workdir: Path) -> None:
    spec = _spec(workdir)
    res = make_plan(spec, progress=True)
    meta = read_plan(res.plan_dir)
    assert meta.long_seq_len == LONG_SEQ_LEN and meta.long_cp_size == 2
    current = {n: read_index(workdir, n, columns=["sample"])[2] for n in meta.sources}
    check_fresh(meta, current)

    m = read_manifest(res.plan_dir, meta)
    src = m["source"].to_numpy()
    lane = m["lane"].to_numpy()
    length = m["length"].to_numpy().astype(np.int64)
    offset = m["offset"].to_numpy().astype(np.int64)
    sample = m["sample"].to_numpy().astype(np.int64)
    for k, name in enumerate(meta.sources):
        samples, _, _ = read_index(workdir, name)
        ntok = samples["num_tokens"].to_numpy().astype(np.int64)
        img = samples["num_image_tokens"].to_numpy()
        sel = src == k
        assert (offset[sel] + length[sel] <= ntok[sample[sel]]).all()
        whole_img = img[sample[sel]] > 0
        assert (length[sel][whole_img] == ntok[sample[sel]][whole_img]).all(), "an image sample was split"
        # lanes: documents above the threshold are planned in the long lane, all others in the short one
        assert ((ntok[sample[sel]] > SEQ_LEN) == (lane[sel] == 1)).all()
    slot = (m["step"].to_numpy().astype(np.int64) * 8 + m["dp_rank"].to_numpy()) * 4 + m["micro_batch"].to_numpy()
    used = np.bincount(slot, weights=length)
    lane_of_slot = np.zeros(len(used), dtype=np.int64)
    lane_of_slot[slot] = lane
    assert (used <= np.where(lane_of_slot == 1, LONG_SEQ_LEN, SEQ_LEN)).all()
    assert (lane == 1).any() and (lane == 0).any()

    rep = plan_report(res.plan_dir)
    assert rep["imbalance"]["loomdata"]["mean"] <= 1.03 < rep["imbalance"]["baseline"]["mean"]
    assert rep["worst_mixture_error_pp"] < 1.0
    plot_plan(res.plan_dir, workdir / "plan.png")
    assert (workdir / "plan.png").stat().st_size > 10_000

    # the index changes: the stored plan is stale, and planning again makes a new plan beside it
    rng = np.random.default_rng(4)
    _write_source(workdir, "web", rng.integers(1, 500, 6000), np.zeros(6000, dtype=np.int64), shards=4)
    with pytest.raises(StaleIndexError, match="re-plan"):
        check_fresh(meta, {n: read_index(workdir, n, columns=["sample"])[2] for n in meta.sources})
    assert make_plan(spec).meta.plan_id != meta.plan_id


def test_replan_from_index_files_dp4_to_dp2_at_half_the_steps(workdir: Path) -> None:
    """A job planned for dp 4 resumes at step 20 of 40 on dp 2: same stream, nothing lost or repeated."""
    pc = plancheck
    base = make_plan(_spec(workdir, dp_size=4))
    at = base.meta.steps // 2
    spec = _spec(workdir, dp_size=2)
    res = make_plan(spec, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=at))
    meta = read_plan(res.plan_dir)
    assert meta.parameters.resume == ResumeInfo(
        base_plan_id=base.meta.plan_id, at_step=at, base_dp_size=4, base_micro_batches=4
    )
    check_fresh(meta, {n: read_index(workdir, n, columns=["sample"])[2] for n in meta.sources})
    # steps < S: the base's rows; steps >= S: the new shape
    assert read_manifest(res.plan_dir, meta, 0, at - 1).equals(read_manifest(base.plan_dir, base.meta, 0, at - 1))
    m = read_manifest(res.plan_dir, meta)
    new_rows = m.filter(pc_compute.greater_equal(m["step"], at))
    pc.check_slots(meta, new_rows)
    assert set(new_rows["dp_rank"].to_numpy().tolist()) == {0, 1}
    # every token of every source once per epoch across the base's steps and the new ones
    lengths, images = {}, {}
    for name in meta.sources:
        samples, _, _ = read_index(workdir, name)
        lengths[name] = samples["num_tokens"].to_numpy().astype(np.int64)
        images[name] = samples["num_image_tokens"].to_numpy().astype(np.int64)
    deferred = pq.read_table(res.plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy() > 0
    pc.check_coverage(meta, m, lengths, images, deferred)
    # the new steps are as balanced as a fresh plan's, and the mixture stays on target across the change
    rep = plan_report(res.plan_dir)
    assert rep["resumed"]["imbalance"]["loomdata"]["mean"] <= 1.03 < rep["resumed"]["imbalance"]["baseline"]["mean"]
    assert rep["worst_mixture_error_pp"] < 1.0
    plot_plan(res.plan_dir, workdir / "replan.png")
    assert (workdir / "replan.png").stat().st_size > 10_000
    # deterministic: the same inputs give the same plan, byte for byte
    files = {p.relative_to(res.plan_dir): p.read_bytes() for p in sorted(res.plan_dir.rglob("*")) if p.is_file()}
    shutil.rmtree(res.plan_dir)
    again = make_plan(spec, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=at))
    assert {
        p.relative_to(again.plan_dir): p.read_bytes() for p in sorted(again.plan_dir.rglob("*")) if p.is_file()
    } == files
