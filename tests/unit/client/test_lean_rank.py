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
)


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
    heavy = sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in _HEAVY))
    assert not heavy, f"{statement!r} imports {heavy}"
