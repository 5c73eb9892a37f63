"""A worker's client that loses its scheduler connection mid-stream does not cut its constructor off.

Distributed cancels every future a client holds when it reconnects, and an actor handle whose future
is cancelled refuses every call ("Worker holding Actor was lost"), even to a live actor. Constructor
loader handles therefore hold no future (`_dask_actors.detach`): reads go on at once, exact.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from loomdata.execution import Executor
from loomtest.stream import check_exact, stream_with_fault


def _drop_scheduler_comm(dask_worker: Any) -> bool:
    """Abort the worker's client connection to the scheduler (as a timeout on a busy machine does)."""
    client = dask_worker._client
    if client is None or client.scheduler_comm is None:
        return False
    client.scheduler_comm.comm.abort()
    return True


def _reconnected(client: Client, workers: list[str]) -> bool:
    def running(dask_worker: Any) -> bool:
        c = dask_worker._client
        return c is not None and c.status == "running" and c.scheduler_comm is not None

    return all(client.run(running, workers=workers).values())


def test_reads_survive_a_worker_client_reconnect(dask_client: Client, stream_plan: Path) -> None:
    with Executor(stream_plan, dask_client, constructors=1, loaders_per_source=2, window=2, bytes_in_flight=0) as ex:
        assert ex.info is not None
        worker = ex.info.constructor_for(0).worker
        assert any(lo.worker != worker for lo in ex.info.loaders), f"no remote loader: {ex.info}"

        def fault(_: dict[int, Any]) -> None:
            assert dask_client.run(_drop_scheduler_comm, workers=[worker])[worker]
            deadline = time.monotonic() + 30
            while not _reconnected(dask_client, [worker]):
                assert time.monotonic() < deadline, "the worker's client did not reconnect"
                time.sleep(0.05)

        got, took = stream_with_fault(stream_plan, fault)
        reads = ex.metrics().constructors[0]
    assert took < 20, f"reads waited {took:.1f}s after the reconnect (the read deadline is 60 s)"
    assert reads.loader_calls > 0
    check_exact(stream_plan, got)


def test_a_rank_whose_dask_client_reconnects_goes_on(
    dask_client: Client, stream_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_TRANSPORT", "dask")  # ranks call their constructor through a Dask client

    def fault(streams: dict[int, Any]) -> None:
        rank_client = streams[0].dask_client
        assert rank_client is not None and rank_client.scheduler_comm is not None
        comm = rank_client.scheduler_comm.comm
        rank_client.loop.add_callback(comm.abort)
        deadline = time.monotonic() + 10
        while not comm.closed():
            assert time.monotonic() < deadline, "the rank's comm did not close"
            time.sleep(0.01)

    with Executor(stream_plan, dask_client, window=2, bytes_in_flight=0):
        got, took = stream_with_fault(stream_plan, fault)
    assert took < 20, f"rank 0 waited {took:.1f}s after its client reconnected"
    check_exact(stream_plan, got)
