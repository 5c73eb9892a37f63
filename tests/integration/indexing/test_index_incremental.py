"""Incremental re-runs of build_index: only new or changed shards are scanned; removed ones are dropped."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client, get_task_stream

from loomdata.indexing import IndexSummary, build_index
from loomdata.schemas import IndexFiles, Spec, StaleIndexError, check_fresh, read_index
from loomdata.schemas.plan import PlanMeta
from loomtest.plancheck import plan_meta


def _write(path: Path, lengths: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = [list(range(k)) for k in lengths]
    pq.write_table(pa.table({"ids": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=64)


def _source() -> dict[str, object]:
    return {"name": "web", "format": "parquet", "paths": ["data/*.parquet"], "tokens_field": "ids"}


def _scan_tasks(client: Client, spec: Spec) -> tuple[IndexSummary, list[str]]:
    """Build the index and return the keys of the scan tasks the cluster actually ran."""
    with get_task_stream(client) as ts:
        summary = build_index(spec, client)
    return summary, sorted(str(t["key"]) for t in ts.data if "loom-scan" in str(t["key"]))


def _plan_on(fp: str) -> PlanMeta:
    return plan_meta(index_fingerprints={"web": fp})


def test_reruns_scan_only_what_changed(tmp_path: Path, make_spec, dask_client: Client) -> None:
    data = tmp_path / "data"
    rng = np.random.default_rng(0)
    lengths = {i: rng.integers(1, 50, size=40 + 10 * i).tolist() for i in range(4)}
    for i, ls in lengths.items():
        _write(data / f"s{i}.parquet", ls)
    spec = make_spec(_source())
    files = IndexFiles.of(spec.workdir, "web")

    first, keys = _scan_tasks(dask_client, spec)
    s = first.sources["web"]
    assert (s.rescanned, s.reused, s.removed, s.shards) == (4, 0, 0, 4)
    assert len(keys) == 4
    samples_bytes = files.samples.read_bytes()
    plan = _plan_on(s.fingerprint)

    # Nothing changed: no task at all, same fingerprint, the index files are untouched.
    again, keys = _scan_tasks(dask_client, spec)
    assert keys == []
    assert (again.sources["web"].rescanned, again.sources["web"].reused) == (0, 4)
    assert again.sources["web"].fingerprint == s.fingerprint
    assert again.sources["web"].to_dict() | {"rescanned": 4, "reused": 0} == s.to_dict()
    assert files.samples.read_bytes() == samples_bytes
    check_fresh(plan, {"web": again.sources["web"].fingerprint})

    # One shard rewritten with other content: exactly that shard is scanned again.
    lengths[2] = [7, 8, 9]
    _write(data / "s2.parquet", lengths[2])
    changed, keys = _scan_tasks(dask_client, spec)
    c = changed.sources["web"]
    assert len(keys) == 1 and keys[0].startswith("loom-scan-web-2-")
    assert (c.rescanned, c.reused, c.removed) == (1, 3, 0)
    assert c.fingerprint != s.fingerprint
    with pytest.raises(StaleIndexError, match="older index of: web"):
        check_fresh(plan, {"web": c.fingerprint})
    samples, shards, _ = read_index(spec.workdir, "web")
    assert samples.column("num_tokens").to_pylist() == [x for i in range(4) for x in lengths[i]]
    assert shards.column("num_rows").to_pylist() == [len(lengths[i]) for i in range(4)]

    # Only the mtime changes (same bytes): the fingerprint covers mtime, so that shard is rescanned.
    st = os.stat(data / "s0.parquet")
    os.utime(data / "s0.parquet", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    touched, keys = _scan_tasks(dask_client, spec)
    assert len(keys) == 1 and keys[0].startswith("loom-scan-web-0-")
    assert touched.sources["web"].samples == c.samples

    # One shard removed: dropped, samples and shards renumbered densely, the fingerprint changes.
    (data / "s1.parquet").unlink()
    removed, keys = _scan_tasks(dask_client, spec)
    r = removed.sources["web"]
    assert keys == []
    assert (r.rescanned, r.reused, r.removed, r.shards) == (0, 3, 1, 3)
    assert r.fingerprint not in (s.fingerprint, c.fingerprint, touched.sources["web"].fingerprint)
    samples, shards, fp = read_index(spec.workdir, "web")
    kept = [0, 2, 3]
    assert fp == r.fingerprint
    assert samples.column("sample").to_pylist() == list(range(sum(len(lengths[i]) for i in kept)))
    assert samples.column("num_tokens").to_pylist() == [x for i in kept for x in lengths[i]]
    np.testing.assert_array_equal(
        samples.column("shard").to_numpy(), np.repeat([0, 1, 2], [len(lengths[i]) for i in kept])
    )
    assert shards.column("path").to_pylist() == [str(data / f"s{i}.parquet") for i in kept]
    assert len(list((files.root / "_parts").iterdir())) == 3  # the removed shard's cache is gone

    # A new shard: scanned alone and placed in path order.
    _write(data / "s1b.parquet", [5, 5])
    added, keys = _scan_tasks(dask_client, spec)
    assert len(keys) == 1 and keys[0].startswith("loom-scan-web-1-")
    _, shards, _ = read_index(spec.workdir, "web")
    assert shards.column("path").to_pylist()[1] == str(data / "s1b.parquet")
    assert added.sources["web"].samples == r.samples + 2


def test_corrupt_cache_file_is_a_miss_not_an_error(tmp_path: Path, make_spec, dask_client: Client) -> None:
    _write(tmp_path / "data" / "a.parquet", [3, 4, 5])
    spec = make_spec(_source())
    first = build_index(spec, dask_client).sources["web"]
    (cache,) = (IndexFiles.of(spec.workdir, "web").root / "_parts").iterdir()
    cache.write_bytes(b"not parquet")
    again, keys = _scan_tasks(dask_client, spec)
    assert len(keys) == 1
    assert again.sources["web"].to_dict() | {"rescanned": 0, "reused": 1} == first.to_dict() | {
        "rescanned": 0,
        "reused": 1,
    }


def test_metadata_list_change_rescans_and_carries_the_new_column(
    tmp_path: Path, make_spec, dask_client: Client
) -> None:
    path = tmp_path / "data" / "a.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"ids": pa.array([[1], [1, 2]], pa.list_(pa.int64())), "q": [0.5, 0.25]}), path)
    plain = build_index(make_spec(_source()), dask_client).sources["web"]
    spec = make_spec({**_source(), "metadata": ["q"]})
    with_q = build_index(spec, dask_client).sources["web"]
    assert with_q.rescanned == 1 and with_q.fingerprint != plain.fingerprint
    samples, _, _ = read_index(spec.workdir, "web")
    assert samples.column("q").to_pylist() == [0.5, 0.25]
