"""Shared fixtures: a real Dask LocalCluster (processes) for integration tests; unit tests may not start one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/integration is marked `integration`."""
    for item in items:
        if f"{os.sep}integration{os.sep}" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_cluster(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test that starts a cluster or sleeps fails: those belong in tests/integration.

    `time.sleep` and `asyncio.sleep` with a positive delay raise (a zero delay, a bare yield, is allowed).
    """
    if f"{os.sep}unit{os.sep}" not in str(request.node.fspath):
        return
    import asyncio
    import time

    import distributed

    def _refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unit tests may not start a Dask cluster; move this test to tests/integration")

    monkeypatch.setattr(distributed.LocalCluster, "__init__", _refuse)
    monkeypatch.setattr(distributed.Client, "__init__", _refuse)

    real_sleep = time.sleep
    real_async_sleep = asyncio.sleep

    def _sleep_refused(how: str, delay: float) -> RuntimeError:
        return RuntimeError(f"unit tests may not sleep ({how}({delay!r})); move this test to tests/integration")

    def _no_sleep(seconds: float) -> None:
        if seconds > 0:
            raise _sleep_refused("time.sleep", seconds)
        real_sleep(seconds)

    async def _no_async_sleep(delay: float, result: object = None) -> object:
        if delay > 0:
            raise _sleep_refused("asyncio.sleep", delay)
        return await real_async_sleep(delay, result)

    monkeypatch.setattr(time, "sleep", _no_sleep)
    monkeypatch.setattr(asyncio, "sleep", _no_async_sleep)


@pytest.fixture(scope="session")
def scratch_dir() -> Iterator[Path]:
    """A session-wide scratch folder (Dask spill, worker dirs) so nothing lands in the system temp."""
    with tempfile.TemporaryDirectory(prefix="loom-test-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def dask_client(scratch_dir: Path) -> Iterator[object]:
    """A real LocalCluster of 2 worker processes shared by the integration tests of one session.

    Secured like the clusters loomdata starts (TLS, credentials in files), so StreamClients find the
    files through serve.json.
    """
    from distributed import Client, LocalCluster

    from loomdata.execution._security import embedded_tls, security_of

    security = security_of(embedded_tls(scratch_dir / "tls"))
    cluster = LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        protocol="tls://",
        security=security,
        dashboard_address=None,
        local_directory=str(scratch_dir / "dask"),
    )
    client = Client(cluster, security=security)
    try:
        yield client
    finally:
        client.close()
        cluster.close()
