"""The executor on a real LocalCluster serves exactly the manifest's tokens, read independently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.execution.protocol import constructor_dataset, read_serve_info
from loomdata.schemas import IndexFiles, Spec, parse_spec, read_manifest, read_plan


def test_every_batch_matches_an_independent_read(dask_client: Client, stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)
    meta = oracle.meta
    with Executor(stream_plan, dask_client, constructors=2, loaders_per_source=2) as ex:
        info = read_serve_info(stream_plan)
        assert info.plan_id == meta.plan_id and len(info.constructors) == 2
        with dask_client.as_current():
            total = 0
            for c in info.constructors:
                actor = dask_client.get_dataset(c.name)
                for r in c.ranks:
                    for step in range(meta.steps):
                        batches = actor.take(r, step).result()
                        assert [b.micro_batch for b in batches] == list(range(meta.micro_batches))
                        for b in batches:
                            assert (b.step, b.dp_rank) == (step, r)
                            total += oracle.check(b)
        m = ex.metrics()
    assert total > 0
    assert m.loader_samples > 0
    assert set(m.sources) == set(meta.sources)
    assert m.to_dict()["sources"].keys() == set(meta.sources)  # the --json shape
    touched = _units_read(stream_plan)
    for name, src in m.sources.items():  # every row group the plan reads was decoded whole, at least once
        units, rows, tokens = touched[name]
        assert src.tokens_decoded is not None and src.samples_decoded is not None
        assert src.tokens_decoded >= tokens > src.tokens > 0  # decoded >= served: more, the groups are read in part
        assert src.samples_decoded >= rows
        assert sum(lo.metrics.units_decoded or 0 for lo in m.loaders if lo.metrics.source == name) >= units
    for lo in m.loaders:
        lm = lo.metrics
        assert lm.tokens_decoded is not None and lm.tokens_unserved == lm.tokens_decoded - lm.tokens >= 0
    assert not (stream_plan / "serve.json").exists()
    assert constructor_dataset(meta.plan_id, 0) not in dask_client.list_datasets()


def test_long_context_lane_is_served_at_its_length(
    dask_client: Client, tmp_path_factory: pytest.TempPathFactory, loomtest: Any
) -> None:
    spec = loomtest.make_spec(
        tmp_path_factory.mktemp("long"), steps=4, long_context={"threshold": 300, "seq_len": 1024}
    )
    plan_dir = Path(loomtest.index_and_plan(spec, dask_client))
    oracle = loomtest.Oracle(plan_dir)
    lanes = set()
    with Executor(plan_dir, dask_client):
        for r in range(oracle.meta.dp_size):
            with StreamClient(plan_dir, r) as stream:
                for b in stream:
                    oracle.check(b)  # also checks the lane's sequence length
                    lanes.add((b.lane, len(b.input_ids)))
    assert lanes == {(0, 256), (1, 1024)}


def _units_read(plan_dir: Path) -> dict[str, tuple[int, int, int]]:
    """Per source, the row groups the whole plan reads, with their rows and tokens (pyarrow over the files)."""
    meta = read_plan(plan_dir)
    spec = Spec.model_validate(meta.spec)
    t = read_manifest(plan_dir, meta, 0, meta.steps - 1)
    out = {}
    for sid, name in enumerate(meta.sources):
        files = IndexFiles.of(spec.workdir, name)
        idx = pq.read_table(str(files.samples), columns=["sample", "shard", "row"])
        shards = pq.read_table(str(files.shards))
        path_of = dict(zip(shards.column("shard").to_pylist(), shards.column("path").to_pylist(), strict=True))
        mine = np.isin(
            idx.column("sample").to_numpy(), t.column("sample").to_numpy()[t.column("source").to_numpy() == sid]
        )
        shard, row = idx.column("shard").to_numpy()[mine], idx.column("row").to_numpy()[mine]
        units = set(zip(shard.tolist(), (row // 16).tolist(), strict=True))
        rows = tokens = 0
        for s, g in units:  # the corpus is written with row groups of 16 rows
            group = pq.ParquetFile(path_of[s]).read_row_group(int(g), columns=["tokens"]).column(0)
            rows += len(group)
            tokens += sum(len(x) for x in group.to_pylist())
        out[name] = (len(units), rows, tokens)
    return out


def test_loader_metrics_count_the_one_row_group_a_plan_reads_in_part(
    dask_client: Client, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One file of one row group, a one-step plan that reads a few of its documents: the loader decoded that group
    once, all its rows and tokens, and served fewer."""
    from loomtest import stream

    tmp = tmp_path_factory.mktemp("one-group")
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 50_000, size=int(n), dtype=np.int32) for n in rng.integers(100, 300, size=48)]
    (tmp / "data").mkdir()
    pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), tmp / "data" / "a.parquet")
    spec = parse_spec(
        {
            "name": "one-group",
            "workdir": str(tmp / "work"),
            "seed": 3,
            "sources": [
                {
                    "name": "web",
                    "format": "parquet",
                    "paths": [str(tmp / "data" / "*.parquet")],
                    "tokens_field": "tokens",
                }
            ],
            "mixture": {"weights": {"web": 1.0}},
            "training": {"seq_len": 512, "steps": 1, "dp_size": 1, "micro_batches": 1},
        },
        tmp,
    )
    plan_dir = Path(stream.index_and_plan(spec, dask_client))
    assert pq.ParquetFile(tmp / "data" / "a.parquet").metadata.num_row_groups == 1
    served = 0
    with Executor(plan_dir, dask_client) as ex:
        with StreamClient(plan_dir, 0) as s:
            for b in s:
                served += int(b.segments["length"].sum())
        m = ex.metrics()
    (lo,) = [lo.metrics for lo in m.loaders]
    assert 0 < lo.tokens == served < sum(len(d) for d in docs)  # a few documents of the 48
    assert (lo.units_decoded, lo.samples_decoded, lo.tokens_decoded) == (1, 48, sum(len(d) for d in docs))
    assert lo.tokens_unserved == sum(len(d) for d in docs) - served
    assert m.to_dict()["sources"]["web"]["tokens_decoded"] == sum(len(d) for d in docs)


def test_a_unit_held_across_epochs_serves_more_than_it_decoded_and_unserved_stays_at_least_zero(
    dask_client: Client, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One row group of 48 documents, a plan of ~2.5 epochs over it: the loader's cache holds the group across its
    uses, so it is decoded once and its documents served more than once (`tokens` > `tokens_decoded`). Every one of
    its tokens was served, so none is unserved; a plain difference would report minus the repeats."""
    from loomtest import stream

    tmp = tmp_path_factory.mktemp("epochs")
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 50_000, size=int(n), dtype=np.int32) for n in rng.integers(100, 300, size=48)]
    (tmp / "data").mkdir()
    pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), tmp / "data" / "a.parquet")
    source = {"name": "web", "format": "parquet", "paths": [str(tmp / "data" / "*.parquet")], "tokens_field": "tokens"}
    spec = parse_spec(
        {
            "name": "epochs",
            "workdir": str(tmp / "work"),
            "seed": 3,
            "sources": [source],
            "mixture": {"weights": {"web": 1.0}},
            "training": {"seq_len": 512, "steps": 60, "dp_size": 1, "micro_batches": 1},
        },
        tmp,
    )
    plan_dir = Path(stream.index_and_plan(spec, dask_client))
    with Executor(plan_dir, dask_client) as ex:
        with StreamClient(plan_dir, 0) as s:
            for _ in s:
                pass
        m = ex.metrics()
    (lo,) = [lo.metrics for lo in m.loaders]
    assert (lo.units_decoded, lo.tokens_decoded) == (1, sum(len(d) for d in docs))
    assert lo.samples > 48 and lo.tokens > lo.tokens_decoded  # documents served again from the one decode
    assert lo.tokens_unserved == 0 and lo.to_dict()["tokens_unserved"] == 0
