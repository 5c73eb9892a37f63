"""The `loom` CLI: its choices made before heavy imports (Arrow's allocator for the serving process and its
workers), and `serve`'s settings refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import sys
from loomdata.cli import _arrow_pool_before_import, _parser
_arrow_pool_before_import(_parser().parse_args(["serve", "plan", *sys.argv[1:]]))
import pyarrow as pa
print(pa.default_memory_pool().backend_name)
"""


def _pool(*serve_args: str, env_pool: str | None = None) -> str:
    """The Arrow pool a fresh interpreter ends up with after `loom serve` would have chosen it."""
    env = {k: v for k, v in os.environ.items() if k not in ("ARROW_DEFAULT_MEMORY_POOL", "LOOM_CHOSEN_ARROW_POOL")}
    if env_pool is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = env_pool
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *serve_args], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def _has_jemalloc() -> bool:
    import pyarrow as pa

    try:
        pa.jemalloc_memory_pool()
    except NotImplementedError:
        return False
    return True


@pytest.mark.skipif(not _has_jemalloc(), reason="this pyarrow build has no jemalloc")
def test_in_process_worker_gets_jemalloc_before_pyarrow_loads() -> None:
    assert _pool("--workers", "0") == "jemalloc"
    assert _pool("--workers", "0", env_pool="system") == "system"  # the user's setting wins


def test_a_serving_process_without_its_worker_gets_the_system_allocator() -> None:
    """The scheduler and Executor only scan manifests: mimalloc kept their freed pages (execution._arrow_pool)."""
    assert _pool("--workers", "2") == "system"
    assert _pool("--workers", "0", "--scheduler", "tls://h:1") == "system"  # no worker here
    assert _pool("--workers", "2", env_pool="mimalloc") == "mimalloc"  # the user's setting wins


_WORKER_ENV = """
import sys
from loomdata.execution._arrow_pool import choose_before_import
from loomdata.execution._cluster import worker_env
print(choose_before_import(sys.argv[1]), worker_env().get("ARROW_DEFAULT_MEMORY_POOL"))
"""


@pytest.mark.skipif(not _has_jemalloc(), reason="this pyarrow build has no jemalloc")
def test_workers_get_jemalloc_unless_the_user_chose_a_pool() -> None:
    """A pool loomdata chose for the serving process is not the workers' (they inherit its environment)."""

    def run(env_pool: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("ARROW_DEFAULT_MEMORY_POOL", "LOOM_CHOSEN_ARROW_POOL")}
        if env_pool is not None:
            env["ARROW_DEFAULT_MEMORY_POOL"] = env_pool
        cmd = [sys.executable, "-c", _WORKER_ENV, "system"]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip()

    assert run(None) == "True jemalloc"
    assert run("mimalloc") == "False mimalloc"


def test_the_in_process_pool_is_the_workers_pool() -> None:
    from loomdata import cli
    from loomdata.execution import _cluster

    assert cli.IN_PROCESS_ARROW_POOL == _cluster.WORKER_ARROW_POOL and _cluster.IN_PROCESS == 0


def test_serve_takes_the_constructor_budget_and_refuses_a_negative_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loomdata.cli import main

    assert main(["serve", str(tmp_path), "--constructor-bytes", "-1"]) == 2
    assert "constructor_bytes must be >= 0" in capsys.readouterr().err
