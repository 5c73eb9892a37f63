"""plan.json's header: what a rank reads without the planner's contracts."""

from __future__ import annotations

import json

import pytest


def test_plan_header_agrees_with_read_plan(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from loomdata.schemas.header import read_plan_header

    raw = {
        "format_version": 2,
        "plan_id": "abc",
        "steps": 10,
        "dp_size": 4,
        "micro_batches": 2,
        "parameters": {
            "shape_schedule": [
                {"from_step": 6, "dp_size": 2, "micro_batches": 4},
                {"from_step": 0, "dp_size": 4, "micro_batches": 2},
            ]
        },
    }
    (tmp_path / "plan.json").write_text(json.dumps(raw))
    h = read_plan_header(tmp_path)
    assert (h.plan_id, h.steps, h.dp_size, h.micro_batches) == ("abc", 10, 4, 2)
    assert [s.from_step for s in h.shapes] == [0, 6]
    assert h.shape_at(7).dp_size == 2 and h.shape_at(5).dp_size == 4


def test_plan_header_refuses_other_versions_and_missing_fields(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from loomdata.schemas.errors import ContractError
    from loomdata.schemas.header import read_plan_header

    (tmp_path / "plan.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(ContractError, match="format version 1"):
        read_plan_header(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({"format_version": 2, "plan_id": "x"}))
    with pytest.raises(ContractError, match=r"invalid plan\.json header"):
        read_plan_header(tmp_path)
