"""The `loom` CLI's choices made before heavy imports: Arrow's allocator for the in-process worker."""

from __future__ import annotations

import os
import subprocess
import sys

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
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
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
    default = _pool("--workers", "2")
    assert _pool("--workers", "0") == "jemalloc" != default  # processes keep Arrow's default in this process
    assert _pool("--workers", "0", "--scheduler", "tls://h:1") == default  # no worker here
    assert _pool("--workers", "0", env_pool="system") == "system"  # the user's setting wins


def test_the_in_process_pool_is_the_workers_pool() -> None:
    from loomdata import cli
    from loomdata.execution import _cluster

    assert cli.IN_PROCESS_ARROW_POOL == _cluster.WORKER_ARROW_POOL and _cluster.IN_PROCESS == 0
