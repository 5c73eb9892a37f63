"""Index assembly from per-shard scans, and the scan task run in-process (no cluster)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomdata.indexing import IndexSummary, SourceSummary
from loomdata.indexing._assemble import assemble, write_tables
from loomdata.indexing._cache import ShardScan
from loomdata.indexing._fingerprint import ShardStat
from loomdata.indexing._task import FailureKind, ScanJob, run_scan
from loomdata.schemas import (
    ImageSpec,
    IndexBuildError,
    IndexFiles,
    OnError,
    SourceDataError,
    SourceFormat,
    SourceSpec,
    TableKind,
    TokenizerSpec,
    read_index,
    read_table,
)
from loomdata.sources import make_reader


def _rows(rows: list[int], tokens: list[int], **meta: pa.Array) -> pa.Table:
    return pa.table(
        {
            "row": pa.array(rows, pa.uint64()),
            "num_tokens": pa.array(tokens, pa.uint32()),
            "num_image_tokens": pa.array([0] * len(rows), pa.uint32()),
            "checksum": pa.array([r * 7 + 1 for r in rows], pa.uint32()),
            **meta,
        }
    )


def _stat(name: str) -> ShardStat:
    return ShardStat(Path(f"/d/{name}"), 10, 20, f"fp-{name}")


def test_assemble_dense_ids_skipped_shards_errors_and_metadata_promotion() -> None:
    stats = [_stat("a"), _stat("b"), _stat("c")]
    scans = [
        ShardScan(_rows([0, 1, 3], [4, 5, 6], q=pa.array([1, 2, 3], pa.int32())), [(2, "bad row two")]),
        ShardScan(_rows([], []), [(None, "corrupt file")], skipped=True),
        ShardScan(_rows([0, 1], [7, 8], q=pa.array([4, 5], pa.int64()))),
    ]
    t = assemble("web", stats, scans, ["q"])
    assert t.samples.column_names == ["sample", "shard", "row", "num_tokens", "num_image_tokens", "checksum", "q"]
    assert t.samples.column("sample").to_pylist() == [0, 1, 2, 3, 4]
    assert t.samples.column("shard").to_pylist() == [0, 0, 0, 1, 1]  # dense over indexed shards
    assert t.samples.column("row").to_pylist() == [0, 1, 3, 0, 1]
    assert t.samples.column("num_tokens").to_pylist() == [4, 5, 6, 7, 8]
    assert t.samples.schema.field("q").type == pa.int64()  # int32 and int64 shards promote
    assert t.shards.column("path").to_pylist() == ["/d/a", "/d/c"]
    assert t.shards.column("num_rows").to_pylist() == [3, 2]
    assert t.errors is not None
    assert t.errors.to_pylist() == [
        {"path": "/d/a", "row": 2, "message": "bad row two"},
        {"path": "/d/b", "row": None, "message": "corrupt file"},
    ]


def test_assemble_rejects_metadata_types_that_cannot_be_unified() -> None:
    scans = [
        ShardScan(_rows([0], [1], q=pa.array([1.5]))),
        ShardScan(_rows([0], [1], q=pa.array([[1]], pa.list_(pa.int32())))),
    ]
    with pytest.raises(IndexBuildError, match="source 'web': shards disagree on a metadata column's type"):
        assemble("web", [_stat("a"), _stat("b")], scans, ["q"])


def test_empty_and_all_skipped_sources_give_valid_empty_tables(tmp_path: Path) -> None:
    t = assemble("web", [_stat("a")], [ShardScan(_rows([], []), [(None, "x")], skipped=True)], ["lang"])
    assert t.samples.num_rows == 0 and t.shards.num_rows == 0 and t.errors is not None
    files = IndexFiles.of(tmp_path, "web")
    write_tables(t, files.samples, files.shards, files.errors, "fp1")
    samples, shards, fp = read_index(tmp_path, "web")
    assert (samples.num_rows, shards.num_rows, fp) == (0, 0, "fp1")
    assert read_table(files.errors, TableKind.ERRORS).num_rows == 1
    # Nothing skipped any more: the stale errors table goes away.
    write_tables(assemble("web", [], [], []), files.samples, files.shards, files.errors, "fp2")
    assert not files.errors.exists()
    assert sorted(p.name for p in files.root.iterdir()) == ["samples.parquet", "shards.parquet"]


def test_summary_to_dict_is_what_loom_index_json_prints() -> None:
    s = SourceSummary(
        shards=2, samples=5, tokens=30, image_tokens=0, skipped=1, rescanned=1, reused=1, removed=0, fingerprint="f"
    )
    d = IndexSummary(sources={"web": s}, elapsed_s=1.23456).to_dict()
    assert d == {
        "sources": {
            "web": {
                "shards": 2,
                "samples": 5,
                "tokens": 30,
                "image_tokens": 0,
                "skipped": 1,
                "rescanned": 1,
                "reused": 1,
                "removed": 0,
                "fingerprint": "f",
            }
        },
        "elapsed_s": 1.235,
    }


def _job(path: Path, on_error: OnError = OnError.ERROR) -> ScanJob:
    source = SourceSpec(name="w", format=SourceFormat.PARQUET, paths=["x"], tokens_field="ids", on_error=on_error)
    return ScanJob(0, 3, path, source, TokenizerSpec(), ImageSpec(), target_bytes=100)


def test_run_scan_splits_scans_and_returns_failures_as_data(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    docs = [list(range(k)) for k in np.arange(40) % 7]
    pq.write_table(pa.table({"ids": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=10)
    first = run_scan(_job(path), None, None)
    assert first.failure is None and first.num_parts > 1 and first.part == 0 and first.shard_idx == 3
    rest = [run_scan(_job(path), p, first.num_parts) for p in range(1, first.num_parts)]
    tokens = [x for o in [first, *rest] if o.rows is not None for x in o.rows.column("num_tokens").to_pylist()]
    assert tokens == [len(d) for d in docs]

    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"nope")
    out = run_scan(_job(bad), None, None)
    assert out.failure is not None and out.failure.kind is FailureKind.SOURCE and out.rows is None
    reader = make_reader(_job(bad).source, TokenizerSpec(), ImageSpec())
    with pytest.raises(SourceDataError) as direct:
        reader.num_parts(bad, 100)
    rebuilt = out.failure.error
    assert type(rebuilt) is SourceDataError
    assert (str(rebuilt), rebuilt.path, rebuilt.row, rebuilt.reason) == (
        str(direct.value),
        direct.value.path,
        direct.value.row,
        direct.value.reason,
    )

    gone = run_scan(_job(tmp_path / "missing.parquet"), None, None)
    assert gone.failure is not None and gone.failure.kind is FailureKind.SOURCE

    # A reader bug (here: a part out of range) is reported as internal, with its traceback.
    bug = run_scan(_job(path), 5, 2)
    assert bug.failure is not None and bug.failure.kind is FailureKind.INTERNAL
    assert "ValueError" in bug.failure.message and "Traceback" in bug.failure.detail


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.booleans(), st.lists(st.integers(0, 40), max_size=3)),
        max_size=8,
    )
)
def test_assemble_invariants(shards: list[tuple[int, bool, list[int]]]) -> None:
    """For any mix of shard sizes, whole-shard skips and bad rows: dense ids, counts and errors add up."""
    stats = [_stat(f"s{i:02d}") for i in range(len(shards))]
    scans = []
    for n, skipped, bad in shards:
        if skipped:
            scans.append(ShardScan(_rows([], []), [(None, "bad shard")], skipped=True))
        else:
            scans.append(ShardScan(_rows(list(range(n)), [r % 7 for r in range(n)]), [(b, "bad") for b in bad]))
    t = assemble("web", stats, scans, [])
    kept = [n for n, skipped, _ in shards if not skipped]
    assert t.samples.column("sample").to_pylist() == list(range(sum(kept)))
    assert t.samples.column("shard").to_pylist() == [i for i, n in enumerate(kept) for _ in range(n)]
    assert t.shards.column("num_rows").to_pylist() == kept
    assert t.shards.column("shard").to_pylist() == list(range(len(kept)))
    n_errors = sum(1 if skipped else len(bad) for _, skipped, bad in shards)
    assert (0 if t.errors is None else t.errors.num_rows) == n_errors
