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


def _start() -> dict[str, Any]:
    import gc
    import os
    import sys

    with open("/proc/self/smaps_rollup") as f:
        roll = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if v.strip().endswith("kB")}
    return {
        "parent": os.getppid(),
        "preloaded": "loomdata.execution._worker_preload" in sys.modules,
        "frozen": gc.get_freeze_count(),
        "shared_dirty_mib": roll.get("Shared_Dirty", 0) / 1024,
        "pool": _backend(),
        "mark": os.environ.get("LOOM_TEST_MARK"),
    }


_FORKED = """
import json, os, sys
from loomdata.execution import open_cluster
from tests.integration.execution.test_cluster import _start

if __name__ == "__main__":
    out = {"me": os.getpid()}
    with open_cluster(n_workers=2, local_directory=sys.argv[1] + "/a") as client:
        out["first"] = list(client.run(_start).values())
    os.environ["LOOM_TEST_MARK"] = "set later"
    with open_cluster(n_workers=1, local_directory=sys.argv[1] + "/b") as client:
        out["later"] = list(client.run(_start).values())
    print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc")
def test_workers_are_forked_from_one_preloaded_server_and_share_its_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both workers come from one fork server that imported what a worker imports (frozen for the collector): the
    pages they did not write are the server's, shared (a spawned worker shares no anonymous page with anyone). A
    variable set after the server started still reaches the workers (spawned then). In a fresh interpreter: this
    test process's fork server started with whatever environment an earlier test had."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ARROW_DEFAULT_MEMORY_POOL", "LOOM_TEST_MARK")}
    env.pop("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", None)
    script = tmp_path / "forked.py"
    script.write_text(_FORKED)
    root = Path(__file__).resolve().parents[3]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240, cwd=root
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    seen = out["first"]
    assert len({w["parent"] for w in seen}) == 1 and seen[0]["parent"] != out["me"], out
    assert all(w["preloaded"] and w["frozen"] > 10_000 for w in seen), seen
    assert all(w["shared_dirty_mib"] > 20 for w in seen), seen
    assert all(w["pool"] == WORKER_ARROW_POOL for w in seen), seen
    (later,) = out["later"]
    assert later["mark"] == "set later" and later["parent"] == out["me"] and not later["preloaded"], later
    # the user's start method wins: spawned workers are the nannies' children (here, this process) and share nothing
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", "spawn")
    with open_cluster(n_workers=1, local_directory=tmp_path / "c") as client:
        (w,) = client.run(_start).values()
    assert w["parent"] == os.getpid() and not w["preloaded"] and w["frozen"] == 0, w
    assert w["shared_dirty_mib"] < 5, w
