"""The embedded cluster's workers: Arrow's allocator (jemalloc unless the user chose one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask
import pyarrow as pa
import pytest

from loomdata.execution import open_cluster
from loomdata.execution._arrow_pool import WORKER_JEMALLOC_CONF
from loomdata.execution._cluster import WORKER_ARROW_POOL
from loomdata.schemas import read_plan


def _backend() -> str:
    import pyarrow

    return str(pyarrow.default_memory_pool().backend_name)


def test_workers_use_jemalloc_and_a_users_choice_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        pa.jemalloc_memory_pool()
    except NotImplementedError:
        pytest.skip("this pyarrow build has no jemalloc")
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    with open_cluster(n_workers=1, local_directory=tmp_path / "a") as client:
        assert list(client.run(_backend).values()) == [WORKER_ARROW_POOL]
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "system")
    with open_cluster(n_workers=1, local_directory=tmp_path / "b") as client:
        assert list(client.run(_backend).values()) == ["system"]


def _jemalloc_opts() -> dict[str, object]:
    from loomdata.execution._heap import jemalloc_stats

    pa.array([1, 2]).cast(pa.int8())  # an Arrow allocation: jemalloc has started
    stats = jemalloc_stats()
    return {} if stats is None else {"tcache": stats["opt"]["tcache"], "narenas": stats["opt"]["narenas"]}


def test_workers_jemalloc_runs_without_thread_caches_unless_the_user_configures_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        pa.jemalloc_memory_pool()
    except NotImplementedError:
        pytest.skip("this pyarrow build has no jemalloc")
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    monkeypatch.delenv("JE_ARROW_MALLOC_CONF", raising=False)
    with open_cluster(n_workers=1, local_directory=tmp_path / "a") as client:
        (opts,) = client.run(_jemalloc_opts).values()
        if not opts:
            pytest.skip("this pyarrow does not export arrow::jemalloc_stats_print")
        assert opts["tcache"] is False
        assert opts["narenas"] == int(WORKER_JEMALLOC_CONF.rpartition("narenas:")[2])
    monkeypatch.setenv("JE_ARROW_MALLOC_CONF", "narenas:3")
    with open_cluster(n_workers=1, local_directory=tmp_path / "b") as client:
        (opts,) = client.run(_jemalloc_opts).values()
        assert opts == {"tcache": True, "narenas": 3}  # the user's options, and only theirs


def _profiling(dask_worker: Any) -> bool:
    return "profile" in dask_worker.periodic_callbacks


def test_workers_run_without_dasks_profiler_unless_the_user_configures_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", raising=False)
    with open_cluster(n_workers=1, local_directory=tmp_path / "a") as client:
        assert list(client.run(_profiling).values()) == [False]
    assert dask.config.get("distributed.worker.profile.enabled") is True  # this process's config is left as it was
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "True")  # the user's own setting wins
    with open_cluster(n_workers=1, local_directory=tmp_path / "b") as client:
        assert list(client.run(_profiling).values()) == [True]


def test_the_in_process_layout_serves_every_rank_exactly_over_tls(
    stream_plan: Path, tmp_path: Path, loomtest: Any
) -> None:
    """`n_workers=0`: the worker is a thread of this process; ranks still reach its gateway over mutual TLS."""
    import os

    from loomdata.client import StreamClient
    from loomdata.execution import Executor
    from loomdata.execution.protocol import read_serve_info

    meta = read_plan(stream_plan)
    with open_cluster(n_workers=0, local_directory=tmp_path / "dask") as client, Executor(stream_plan, client):
        assert list(client.run(os.getpid).values()) == [os.getpid()]  # one worker, in this process
        assert client.scheduler_info()["address"].startswith("tls://")
        info = read_serve_info(stream_plan)
        assert all(c.gateway is not None and c.gateway.startswith("tls://") for c in info.constructors)
        got = {}
        for r in range(meta.dp_size):
            with StreamClient(stream_plan, r) as stream:
                got[r] = list(stream)
    loomtest.check_exact(stream_plan, got)
