"""The unit-test rules the conftest enforces: no cluster, no sleep (a zero-delay yield is allowed)."""

from __future__ import annotations

import asyncio
import time

import distributed
import pytest


def test_sleeping_is_refused_with_a_pointer_to_integration() -> None:
    with pytest.raises(RuntimeError, match=r"may not sleep \(time\.sleep\(0\.01\)\); move this test to tests/int"):
        time.sleep(0.01)
    time.sleep(0)


def test_async_sleeping_is_refused() -> None:
    async def nap(delay: float) -> str:
        return str(await asyncio.sleep(delay, "woke"))

    assert asyncio.run(nap(0)) == "woke"
    with pytest.raises(RuntimeError, match=r"may not sleep \(asyncio\.sleep\(1\)\); move this test"):
        asyncio.run(nap(1))


def test_starting_a_cluster_is_refused() -> None:
    with pytest.raises(RuntimeError, match="may not start a Dask cluster"):
        distributed.LocalCluster(n_workers=1, processes=False)
