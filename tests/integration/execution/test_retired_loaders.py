"""Retired loaders leave the workers: after resizes a worker's actor table holds only live loaders."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor


def _loaders_on_workers(client: Client) -> set[str]:
    def keys(dask_worker: Any) -> list[str]:
        return [str(k) for k in dask_worker.state.actors]

    return {k for ks in client.run(keys).values() for k in ks if k.startswith("loom-loader-")}


def test_resized_loaders_are_gone_from_the_workers(dask_client: Client, stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)
    mb = oracle.meta.micro_batches
    with (
        Executor(stream_plan, dask_client, loaders_per_source={"web": 1, "code": 1}) as ex,
        StreamClient(stream_plan, 0) as stream,
    ):
        got = [next(stream) for _ in range(mb)]
        for n in (3, 2, 1):  # six loaders retired in all
            assert ex.set_loaders("web", n) == n
            got += [next(stream) for _ in range(mb)]
        got += list(stream)
        live = {lo.name for lo in ex.info.loaders} if ex.info else set()
        deadline = time.monotonic() + 20  # releases reach the workers asynchronously (no garbage collection needed)
        while (held := _loaders_on_workers(dask_client)) != live and time.monotonic() < deadline:
            time.sleep(0.1)
    assert len(live) == 2  # web 1 + code 1
    assert held == live, f"retired loaders still on the workers: {sorted(held - live)}"
    assert len(got) == oracle.meta.steps * mb
    for b in got:
        oracle.check(b)
