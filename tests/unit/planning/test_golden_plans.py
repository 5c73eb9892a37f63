"""Golden plans: the reference cases still plan to the recorded manifest rows and report columns.

The hashes in golden_plans.json were recorded from the planner before the balancer became one
implementation (see loomtest.golden_plans); a mismatch means the planner's output changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loomdata.planning import make_plan
from loomdata.planning._counts import Pieces
from loomtest.golden_plans import CASES, GOLDEN_FILE, plan_hashes

_GOLDEN = json.loads(GOLDEN_FILE.read_text())


def test_every_case_has_a_recorded_hash() -> None:
    assert sorted(_GOLDEN) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_matches_its_golden_hashes(name: str, tmp_path: Path) -> None:
    spec, index, kw = CASES[name](tmp_path)
    res = make_plan(spec, index=index, **kw)
    assert plan_hashes(res.plan_dir) == _GOLDEN[name]


@pytest.mark.parametrize("form", ["pieces", "cells"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_report_counts_either_form_of_a_block_the_same(
    name: str, form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's token counts from a block's placed pieces (the many-source path) and from its dense cells give
    the same plan: each golden case forced onto one form matches its recorded hashes."""
    from loomdata.planning import _step

    def forced(pieces: Pieces, n_sources: int) -> Pieces | np.ndarray:
        return pieces if form == "pieces" else pieces.dense(n_sources)

    monkeypatch.setattr(_step, "report_tokens", forced)
    spec, index, kw = CASES[name](tmp_path)
    res = make_plan(spec, index=index, **kw)
    assert plan_hashes(res.plan_dir) == _GOLDEN[name]
