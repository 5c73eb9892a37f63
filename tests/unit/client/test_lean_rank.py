"""A training rank imports only what receiving batches needs (issue 8: a lean rank)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_HEAVY = (
    "pyarrow",
    "polars",
    "pandas",
    "loomdata.planning",
    "loomdata.sources",
    "loomdata.indexing",
    "loomdata.schemas.spec",
    "loomdata.schemas.tables",
    "loomdata.schemas.plan",
    "pydantic",  # 4.7 MiB of private memory per rank: serve.json is read by `execution._record`
)
_DASK = ("distributed", "dask", "tornado")  # a rank reaches its constructor through the gateway (socket + ssl)


def _imported_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize(
    "statement",
    [
        "import loomdata.client",
        "from loomdata.torch import LoomDataset",
        "from loomdata import StreamClient, Batch, LoomError",
    ],
)
def test_rank_imports_no_planner_and_no_table_libraries(statement: str) -> None:
    mods = _imported_after(statement)
    heavy = sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in (*_HEAVY, *_DASK)))
    assert not heavy, f"{statement!r} imports {heavy}"


def test_a_published_constructor_handle_unpickles_without_the_constructor() -> None:
    """A rank on Dask calls (LOOM_TRANSPORT=dask, or a scheduler address) unpickles the handle the executor
    publishes: that must not import the constructor's stack."""
    import pickle

    from distributed.actor import Actor

    from loomdata.execution.protocol import light_handle

    real = Actor(type("DataConstructor", (), {}), "tls://127.0.0.1:1", "loom-constructor-x")
    blob = pickle.dumps(light_handle(real))
    load = f"import pickle, loomdata.client\nh = pickle.loads({blob!r})\nassert h.key == 'loom-constructor-x'"
    mods = _imported_after(load)
    heavy = sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in _HEAVY))
    assert not heavy, f"unpickling a published constructor handle imports {heavy}"
    assert "loomdata.execution._constructor" not in mods
