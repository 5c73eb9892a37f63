"""The embedded cluster's workers: Arrow's allocator (jemalloc unless the user chose one)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from loomdata.execution import open_cluster
from loomdata.execution._cluster import WORKER_ARROW_POOL


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
