"""The Data Constructor in-process with real Source Loaders: unreachable loaders are retried, data errors are not."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from loomdata.execution._constructor import DataConstructor, Route
from loomdata.execution._loader import REQUEST_DTYPE, SegmentData, SourceLoader
from loomdata.execution._partition import partition_source
from loomdata.schemas import ConstructorMetrics, ExecutionError, IndexFiles, Spec


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

    async def run() -> tuple[list[Any], ConstructorMetrics]:
        routes = _routes(stream_plan, lambda lo: _Failing(lo, 2, OSError("Unable to contact Actor's worker")))
        c = DataConstructor(str(stream_plan), [0, 1], routes, window=1)
        batches = await c.take(0, 0)
        metrics = await c.metrics()
        await c.stop()
        return batches, metrics

    batches, metrics = asyncio.run(run())
    assert [b.micro_batch for b in batches] == list(range(oracle.meta.micro_batches))
    assert all(oracle.check(b) >= 0 for b in batches)
    assert metrics.read_retries == 2


def test_data_errors_are_not_retried(stream_plan: Path) -> None:
    async def run() -> ConstructorMetrics:
        routes = _routes(stream_plan, lambda lo: _Failing(lo, 1, ExecutionError("x.parquet, row 3: corrupt")))
        c = DataConstructor(str(stream_plan), [0, 1], routes, window=1)
        with pytest.raises(ExecutionError, match=r"x.parquet, row 3: corrupt"):
            await c.take(1, 0)
        metrics = await c.metrics()
        await c.stop()
        return metrics

    assert asyncio.run(run()).read_retries == 0


def test_retired_loader_fails_fast_and_is_not_a_data_error(stream_plan: Path) -> None:
    from loomdata.execution._loader import LoaderRetired
    from loomdata.schemas import LoomError

    async def run() -> None:
        route = _routes(stream_plan, lambda lo: lo)[0]
        loader = route.loaders[0]
        req = np.zeros(1, dtype=REQUEST_DTYPE)
        req["sample"], req["length"] = route.partitions[0].first_sample, 1
        assert len((await loader.read(req)).tokens) == 1
        await loader.close()
        await loader.close()  # idempotent
        with pytest.raises(LoaderRetired) as e:
            await loader.read(req)
        assert not isinstance(e.value, LoomError)

    asyncio.run(run())


class _SwitchedUnderRead:
    """A loader whose read lands after its constructor switched routes and it was retired (the resize race)."""

    def __init__(self, inner: SourceLoader) -> None:
        self.inner, self.calls = inner, 0
        self.constructor: DataConstructor | None = None
        self.new_routes: dict[int, Route] = {}

    async def read(self, request: np.ndarray) -> SegmentData:
        self.calls += 1
        assert self.constructor is not None
        for sid, route in self.new_routes.items():
            await self.constructor.set_routes({sid: route})  # the executor re-routes ...
        await self.inner.close()  # ... and retires this loader before the request arrives
        return await self.inner.read(request)


def test_read_on_a_retired_loader_is_retried_on_the_new_route(stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)

    async def run() -> tuple[list[Any], ConstructorMetrics, list[_SwitchedUnderRead]]:
        old: list[_SwitchedUnderRead] = []

        def wrap(lo: SourceLoader) -> _SwitchedUnderRead:
            old.append(_SwitchedUnderRead(lo))
            return old[-1]

        routes = _routes(stream_plan, wrap)
        c = DataConstructor(str(stream_plan), [0, 1], routes, window=1)
        fresh = _routes(stream_plan, lambda lo: lo)
        for w in old:
            w.constructor, w.new_routes = c, fresh
        batches = await c.take(0, 0)
        metrics = await c.metrics()
        await c.stop()
        return batches, metrics, old

    batches, metrics, old = asyncio.run(run())
    assert all(oracle.check(b) >= 0 for b in batches)
    assert sum(w.calls for w in old) >= 1 and metrics.read_retries >= 1


def test_a_source_data_error_reaches_the_take_intact(stream_plan: Path) -> None:
    from loomdata.schemas import SourceDataError

    bad = SourceDataError("/data/web-3.parquet", "column 'ids': null value", row=17, hint="re-export the shard")

    async def run() -> ConstructorMetrics:
        routes = _routes(stream_plan, lambda lo: _Failing(lo, 1, bad))
        c = DataConstructor(str(stream_plan), [0, 1], routes, window=1)
        with pytest.raises(SourceDataError) as e:
            await c.take(0, 0)
        assert (e.value.path, e.value.row, e.value.hint) == ("/data/web-3.parquet", 17, "re-export the shard")
        assert len(await c.take(0, 0)) > 0  # reported once: the next take builds the step again
        metrics = await c.metrics()
        await c.stop()
        return metrics

    assert asyncio.run(run()).read_retries == 0


def test_a_read_gives_up_after_the_deadline_with_the_last_error(stream_plan: Path) -> None:
    from loomdata.execution._reads import Reads

    async def run() -> None:
        routes = _routes(stream_plan, lambda lo: _Failing(lo, 10**6, OSError("Unable to contact Actor's worker")))
        c = DataConstructor(str(stream_plan), [0, 1], routes, window=1)
        c._reads = Reads(routes, c._meta.plan_id, deadline_s=0.5)
        with pytest.raises(
            ExecutionError, match=r"unreachable for 0.5s, \d+ attempts \(last: OSError: Unable to contact"
        ):
            await c.take(0, 0)
        await c.stop()

    asyncio.run(run())


class _Hangs:
    """A loader lost with its worker: its reads never answer (Dask waits on the lost actor's future)."""

    def __init__(self) -> None:
        self.calls = 0

    async def read(self, request: np.ndarray) -> SegmentData:
        self.calls += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_set_route_abandons_a_hanging_read_and_asks_the_new_loaders(stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)

    async def run() -> tuple[list[Any], ConstructorMetrics, list[_Hangs]]:
        lost: list[_Hangs] = []

        def wrap(lo: SourceLoader) -> _Hangs:
            lost.append(_Hangs())
            return lost[-1]

        c = DataConstructor(str(stream_plan), [0, 1], _routes(stream_plan, wrap), window=1)
        take = asyncio.ensure_future(c.take(1, 0))
        while not any(h.calls for h in lost):
            await asyncio.sleep(0.01)
        assert not take.done()
        for sid, route in _routes(stream_plan, lambda lo: lo).items():  # the executor recreated the loaders
            await c.set_routes({sid: route})
        batches = await asyncio.wait_for(take, timeout=30)
        metrics = await c.metrics()
        await c.stop()
        return batches, metrics, lost

    batches, metrics, lost = asyncio.run(run())
    assert all(oracle.check(b) >= 0 for b in batches)
    assert metrics.read_retries >= 1 and all(h.calls <= 1 for h in lost)


class _Counting:
    """A real loader that records the steps each request names."""

    def __init__(self, inner: SourceLoader) -> None:
        self.inner, self.steps_per_request = inner, []

    async def read(self, request: np.ndarray) -> SegmentData:
        self.steps_per_request.append(len(np.unique(request["step"])))
        return await self.inner.read(request)


def test_take_steps_carries_every_held_step_read_in_few_requests(stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)
    steps = oracle.meta.steps

    async def run() -> tuple[list[list[Any]], list[list[Any]], ConstructorMetrics, list[_Counting]]:
        links: list[_Counting] = []

        def wrap(lo: SourceLoader) -> _Counting:
            links.append(_Counting(lo))
            return links[-1]

        c = DataConstructor(str(stream_plan), [0, 1], _routes(stream_plan, wrap), window=steps)
        await c.start()
        while (await c.metrics()).held_steps < 2 * steps:  # the whole plan is in the window: all built ahead
            await asyncio.sleep(0.02)
        with pytest.raises(ExecutionError, match="count must be an int >= 1"):
            await c.take_steps(0, 0, 0)
        all_of_0 = await c.take_steps(0, 0, steps + 5)  # asking past the plan's end is capped at it
        two_of_1 = await c.take_steps(1, 0, 2)
        metrics = await c.metrics()
        await c.stop()
        return all_of_0, two_of_1, metrics, links

    all_of_0, two_of_1, metrics, links = asyncio.run(run())
    assert [[b.step for b in bs] for bs in all_of_0] == [[s] * oracle.meta.micro_batches for s in range(steps)]
    assert [{b.dp_rank for b in bs} for bs in all_of_0 + two_of_1] == [{0}] * steps + [{1}] * 2
    assert all(oracle.check(b) >= 0 for bs in all_of_0 + two_of_1 for b in bs)
    assert metrics.rank_takes == {0: steps, 1: 2} and metrics.on_demand_steps == 0
    # one loader request per group of steps (1, 2, 4 ... steps), not one per step
    assert metrics.loader_calls < steps * len(links) and max(n for lo in links for n in lo.steps_per_request) > 1
