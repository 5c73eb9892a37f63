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


def _periods(dask_worker: Any) -> dict[str, float]:
    """The periods (ms) of a server's event-loop tick and system monitor callbacks (and a worker's memory monitor)."""
    out = {name: dask_worker.periodic_callbacks[name].callback_time for name in ("tick", "monitor")}
    if hasattr(dask_worker, "memory_manager"):
        out["memory"] = dask_worker.memory_manager.memory_monitor_interval * 1000
    return out


def test_a_users_dask_variables_keep_their_periods_hyphenated_keys_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """DASK_* variables spell `system-monitor` and `monitor-interval` with underscores: the user's setting is found
    all the same and left alone; the dashboard keeps Dask's tick and system monitor (it plots them)."""
    from loomdata.execution._cluster import QUIET_PERIODS, embedded_worker_config

    for var in ("ADMIN__TICK__INTERVAL", "ADMIN__SYSTEM_MONITOR__INTERVAL", "WORKER__MEMORY__MONITOR_INTERVAL"):
        monkeypatch.delenv(f"DASK_DISTRIBUTED__{var}", raising=False)
    assert set(QUIET_PERIODS) <= set(embedded_worker_config(dashboard=False))
    assert set(embedded_worker_config(dashboard=True)) == {"distributed.worker.memory.monitor-interval"}
    monkeypatch.setenv("DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL", "500ms")
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL", "100ms")
    assert set(embedded_worker_config(dashboard=False)) & set(QUIET_PERIODS) == {"distributed.admin.tick.interval"}


def test_the_embedded_clusters_housekeeping_is_slower_unless_the_user_configures_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dask's 20 ms loop tick and 500 ms system monitor run at QUIET_PERIODS' 1 s and 2 s in the workers and the
    scheduler (their idle CPU: the cluster's fixed cost a second); a user's DASK_* setting wins, this process's
    own config is left as it was."""
    from loomdata.execution._cluster import QUIET_PERIODS

    tick_key = "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL"
    monkeypatch.delenv(tick_key, raising=False)
    assert set(QUIET_PERIODS) >= {"distributed.admin.tick.interval", "distributed.admin.system-monitor.interval"}
    with open_cluster(n_workers=1, local_directory=tmp_path / "a") as client:
        assert list(client.run(_periods).values()) == [{"tick": 1000.0, "monitor": 2000.0, "memory": 500.0}]
        assert client.run_on_scheduler(_periods) == {"tick": 1000.0, "monitor": 2000.0}
    assert dask.config.get("distributed.admin.tick.interval") == "20ms"  # this process's config is left as it was
    monkeypatch.setenv(tick_key, "50ms")  # the user's own setting wins (Dask read DASK_* at import: set it too)
    user = dask.config.set({"distributed.admin.tick.interval": "50ms"})
    with user, open_cluster(n_workers=1, local_directory=tmp_path / "b") as client:
        assert list(client.run(_periods).values()) == [{"tick": 50.0, "monitor": 2000.0, "memory": 500.0}]


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


def test_the_embedded_cluster_makes_its_credentials_without_loading_cryptography_here(tmp_path: Path) -> None:
    """The serving process never imports `cryptography` (3 MiB it would keep for a use at start): a child interpreter
    makes the credentials, private files in the TLS folder, and the cluster runs over TLS with them. Checked in a
    fresh interpreter (this test process may have loaded it already)."""
    import subprocess
    import sys

    folder = tmp_path / "dask"
    code = (
        "import os, stat, sys\n"
        "from pathlib import Path\n"
        "from loomdata.execution import open_cluster\n"
        "if __name__ == '__main__':\n"
        f"    with open_cluster(n_workers=1, local_directory={str(folder)!r}) as client:\n"
        "        assert client.submit(sum, [1, 2]).result() == 3\n"
        "        assert client.scheduler.address.startswith('tls://'), client.scheduler.address\n"
        f"        tls = Path({str(folder)!r}) / '.loom-tls'\n"
        "        assert stat.S_IMODE(os.stat(tls).st_mode) == 0o700\n"
        "        names = ('ca.pem', 'cert.pem', 'key.pem')\n"
        "        assert all(stat.S_IMODE(os.stat(tls / f).st_mode) == 0o600 for f in names)\n"
        "    assert 'cryptography' not in sys.modules, 'cryptography loaded in the serving process'\n"
    )
    script = tmp_path / "serve_once.py"
    script.write_text(code)
    subprocess.run([sys.executable, str(script)], check=True, timeout=180)


def test_credentials_made_apart_name_the_folder_when_it_cannot_be_written(tmp_path: Path) -> None:
    from loomdata.execution._cluster import tls_apart
    from loomdata.schemas.errors import ExecutionError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ExecutionError, match=r"TLS credentials in .*file/tls"):
        tls_apart(blocker / "tls")


def test_credentials_made_apart_import_nothing_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `pathlib.py` planted in the working directory is not what the credentials' child imports."""
    from loomdata.execution._cluster import tls_apart

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "pathlib.py").write_text("raise SystemExit('the working directory was imported')\n")
    monkeypatch.chdir(cwd)
    files = tls_apart(tmp_path / "tls")
    assert Path(files.ca_file).is_file()


def test_credentials_made_apart_refuse_another_loomdata_first_on_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `loomdata` ahead of this one on PYTHONPATH is not what writes the cluster's private key."""
    from loomdata.execution._cluster import tls_apart
    from loomdata.schemas.errors import ExecutionError

    fake = tmp_path / "fake"
    (fake / "loomdata" / "execution").mkdir(parents=True)
    (fake / "loomdata" / "__init__.py").write_text("")
    (fake / "loomdata" / "execution" / "__init__.py").write_text("")
    (fake / "loomdata" / "execution" / "_security.py").write_text("def embedded_tls(folder):\n    folder.mkdir()\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    with pytest.raises(ExecutionError, match=r"imported loomdata from .*fake.*drop the other loomdata from PYTHONPATH"):
        tls_apart(tmp_path / "tls")
    assert not (tmp_path / "tls").exists()
