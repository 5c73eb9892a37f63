"""Plan-driven read-ahead on a real LocalCluster: the served batches are those served without it, and it reads ahead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.schemas import ExecutorMetrics


def _serve(
    plan_dir: Path, client: Client, prefetch: int, oracle: Any
) -> tuple[list[tuple[bytes, ...]], ExecutorMetrics, int]:
    """Every batch of every rank (its arrays as bytes), the executor's metrics, the tokens the oracle checked."""
    out: list[tuple[bytes, ...]] = []
    checked = 0
    with Executor(plan_dir, client, loader_prefetch=prefetch, loaders_per_source=2) as ex:
        for r in range(2):
            with StreamClient(plan_dir, r) as stream:
                for b in stream:
                    checked += oracle.check(b)  # the manifest's tokens, read independently
                    arrays = (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.segments)
                    out.append(
                        (
                            str((b.step, b.dp_rank, b.micro_batch)).encode(),
                            *(np.ascontiguousarray(a).tobytes() for a in arrays),
                        )
                    )
        m = ex.metrics()
    return out, m, checked


@pytest.fixture(scope="module")
def long_plan(dask_client: Client, tmp_path_factory: pytest.TempPathFactory, loomtest: Any) -> Path:
    spec = loomtest.make_spec(tmp_path_factory.mktemp("prefetch"), steps=16)
    return Path(loomtest.index_and_plan(spec, dask_client))


def test_read_ahead_serves_the_same_batches_and_its_units_are_used(
    dask_client: Client, long_plan: Path, loomtest: Any
) -> None:
    oracle = loomtest.Oracle(long_plan)
    off, m_off, _ = _serve(long_plan, dask_client, 0, oracle)
    on, m_on, checked = _serve(long_plan, dask_client, 4, oracle)
    assert len(on) == len(off) > 0 and checked > 0
    assert on == off  # byte-identical batches, in the same order
    loaders_on = [lo.metrics for lo in m_on.loaders]
    assert sum(lo.prefetched for lo in loaders_on) > 0
    assert sum(lo.prefetch_hits for lo in loaders_on) > 0  # units read ahead were then served from
    assert sum(lo.prefetch_errors for lo in loaders_on) == 0
    assert sum(lo.metrics.prefetched for lo in m_off.loaders) == 0  # off means off
