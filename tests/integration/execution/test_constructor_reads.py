"""The Data Constructor in-process with real Source Loaders: unreachable loaders are retried, data errors are not."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from loomdata.execution._constructor import DataConstructor, Route
from loomdata.execution._loader import SegmentData, SourceLoader
from loomdata.execution._partition import partition_source
from loomdata.schemas import ExecutionError, IndexFiles, Spec


class _Failing:
    """A real loader behind a link that fails the first `n` calls (a lost worker, a bad file)."""

    def __init__(self, inner: SourceLoader, n: int, error: Exception) -> None:
        self.inner, self.n, self.error, self.calls = inner, n, error, 0

    async def read(self, request: np.ndarray) -> SegmentData:
        self.calls += 1
        if self.calls <= self.n:
            raise self.error
        return await self.inner.read(request)


def _routes(plan_dir: Path, wrap: Any) -> dict[int, Route]:
    from loomdata.schemas import read_plan

    meta = read_plan(plan_dir)
    spec = Spec.model_validate(meta.spec)
    routes = {}
    for sid, name in enumerate(meta.sources):
        shards = pq.read_table(str(IndexFiles.of(spec.workdir, name).samples), columns=["shard"]).column(0).to_numpy()
        parts = partition_source(sid, name, shards, 1)
        routes[sid] = Route(parts, [wrap(SourceLoader(str(plan_dir), p)) for p in parts])
    return routes


def test_unreachable_loader_is_retried(stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)

    async def run() -> tuple[list[Any], dict[str, Any]]:
        routes = _routes(stream_plan, lambda lo: _Failing(lo, 2, OSError("Unable to contact Actor's worker")))
        c = DataConstructor(str(stream_plan), [0, 1], routes, window=1)
        batches = await c.take(0, 0)
        metrics = await c.metrics()
        await c.stop()
        return batches, metrics

    batches, metrics = asyncio.run(run())
    assert [b.micro_batch for b in batches] == list(range(oracle.meta.micro_batches))
    assert all(oracle.check(b) >= 0 for b in batches)
    assert metrics["read_retries"] == 2


def test_data_errors_are_not_retried(stream_plan: Path) -> None:
    async def run() -> dict[str, Any]:
        routes = _routes(stream_plan, lambda lo: _Failing(lo, 1, ExecutionError("x.parquet, row 3: corrupt")))
        c = DataConstructor(str(stream_plan), [0, 1], routes, window=1)
        with pytest.raises(ExecutionError, match=r"x.parquet, row 3: corrupt"):
            await c.take(1, 0)
        metrics = await c.metrics()
        await c.stop()
        return metrics

    assert asyncio.run(run())["read_retries"] == 0
