"""The embedded cluster's workers: Arrow's allocator (jemalloc unless the user chose one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask
import pyarrow as pa
import pytest

from loomdata.execution import open_cluster
from loomdata.execution._arrow_pool import WORKER_JEMALLOC_CONF
from loomdata.execution._cluster import MALLOC_ARENA_ENV, WORKER_ARROW_POOL, WORKER_MALLOC_ARENAS
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


def _malloc_arenas_after_threads(n_threads: int = 8) -> int:
    """glibc arenas in this process after `n_threads` new threads each allocated (each takes a new arena while the
    limit allows), counted from `malloc_info`; -1 where the C library is not glibc."""
    import ctypes
    import re
    import tempfile
    import threading

    try:
        libc = ctypes.CDLL("libc.so.6")
        malloc_info, fdopen, fclose = libc.malloc_info, libc.fdopen, libc.fclose
    except (OSError, AttributeError):
        return -1
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    fdopen.restype = ctypes.c_void_p
    fclose.argtypes = malloc_info.argtypes = None
    barrier = threading.Barrier(n_threads)

    def allocate() -> None:
        barrier.wait()
        libc.free(libc.malloc(4096))

    threads = [threading.Thread(target=allocate) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with tempfile.TemporaryFile() as tmp:
        import os

        stream = fdopen(os.dup(tmp.fileno()), b"w")
        malloc_info(0, ctypes.c_void_p(stream))
        fclose(ctypes.c_void_p(stream))
        tmp.seek(0)
        return len(re.findall(rb"<heap nr=", tmp.read()))


def test_workers_limit_glibc_arenas_unless_the_user_sets_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MALLOC_ARENA_ENV, raising=False)
    with open_cluster(n_workers=1, local_directory=tmp_path / "a") as client:
        (arenas,) = client.run(_malloc_arenas_after_threads).values()
        if arenas == -1:
            pytest.skip("not glibc")
        assert arenas == WORKER_MALLOC_ARENAS
    monkeypatch.setenv(MALLOC_ARENA_ENV, "4")  # the user's own limit, inherited by the workers
    with open_cluster(n_workers=1, local_directory=tmp_path / "b") as client:
        assert list(client.run(_malloc_arenas_after_threads).values()) == [4]
    monkeypatch.delenv(MALLOC_ARENA_ENV)
    with (
        dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_ARENA_MAX": 3}),  # or in Dask's config
        open_cluster(n_workers=1, local_directory=tmp_path / "c") as client,
    ):
        assert list(client.run(_malloc_arenas_after_threads).values()) == [3]


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
