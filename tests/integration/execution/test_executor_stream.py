"""The executor on a real LocalCluster serves exactly the manifest's tokens, read independently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.execution.protocol import constructor_dataset, read_serve_info


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
