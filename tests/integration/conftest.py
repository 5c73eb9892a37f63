"""Integration fixtures shared by the streaming and client tests: a real indexed corpus and its plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loomtest import stream


@pytest.fixture(scope="session")
def loomtest() -> Any:
    """The helper module (corpus, plan, oracle)."""
    return stream


@pytest.fixture(scope="session")
def stream_plan(dask_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan over two real Parquet sources indexed by the real index job (dp 2, 2 micro-batches, 6 steps)."""
    spec = stream.make_spec(tmp_path_factory.mktemp("stream"))
    return Path(stream.index_and_plan(spec, dask_client))
