"""Integration fixtures shared by the streaming and client tests: a real indexed corpus and its plan."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest


def _helpers() -> Any:
    name = "loomtest_stream_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "execution" / "_loomtest.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="session")
def loomtest() -> Any:
    """The helper module (corpus, plan, oracle)."""
    return _helpers()


@pytest.fixture(scope="session")
def stream_plan(dask_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan over two real Parquet sources indexed by the real index job (dp 2, 2 micro-batches, 6 steps)."""
    h = _helpers()
    spec = h.make_spec(tmp_path_factory.mktemp("stream"))
    return Path(h.index_and_plan(spec, dask_client))
