"""plan.json's header: the few fields a training rank needs, read with `json` alone.

A rank that only receives batches should not pay for the planner's contracts (the pydantic `Spec`, pyarrow
tables): `read_plan_header` checks the format version exactly as `read_plan` does (both call
`load_plan_json`) and keeps the plan id, the shape and the shape schedule of an elastic re-plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomdata.schemas.errors import ContractError

__all__ = ["PLAN_FORMAT_VERSION", "PlanHeader", "ShapeRange", "load_plan_json", "read_plan_header"]

PLAN_FORMAT_VERSION = 2
"""2: `spec` is a typed Spec, `parameters` typed PlanParameters, the report tables stamped (kind, version)."""


@dataclass(frozen=True, slots=True)
class ShapeRange:
    """The training shape (dp ranks, micro-batches per rank) of the steps from `from_step` on."""

    from_step: int
    dp_size: int
    micro_batches: int


@dataclass(frozen=True, slots=True)
class PlanHeader:
    """What a rank checks before it asks for batches: which plan, how many steps, which shape when."""

    plan_id: str
    steps: int
    dp_size: int
    micro_batches: int
    shapes: tuple[ShapeRange, ...]  # sorted by from_step; one range unless an elastic re-plan
    lane_cp: tuple[int, int] = (1, 1)  # context-parallel size of the short and long lane (1 without a long lane)

    def shape_at(self, step: int) -> ShapeRange:
        """The shape in force at `step`."""
        return [sh for sh in self.shapes if sh.from_step <= step][-1]


def load_plan_json(plan_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """plan.json's path and raw contents, refusing a missing file, bad JSON or another format version."""
    p = Path(plan_dir) / "plan.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ContractError(f"{p}: no plan here; make one with `loom plan SPEC`") from None
    except json.JSONDecodeError as e:
        raise ContractError(f"{p}: not valid JSON ({e})") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != PLAN_FORMAT_VERSION:
        raise ContractError(
            f"{p}: plan format version {version} is not supported (this loomdata reads version "
            f"{PLAN_FORMAT_VERSION}); re-plan with `loom plan SPEC`"
        )
    return p, raw


def read_plan_header(plan_dir: str | Path) -> PlanHeader:
    """The header of plan.json (no spec validation: `read_plan` does that where the spec is used)."""
    p, raw = load_plan_json(plan_dir)
    try:
        dp, mb = int(raw["dp_size"]), int(raw["micro_batches"])
        schedule = (raw.get("parameters") or {}).get("shape_schedule") or [
            {"from_step": 0, "dp_size": dp, "micro_batches": mb}
        ]
        shapes = tuple(
            sorted(
                (ShapeRange(int(s["from_step"]), int(s["dp_size"]), int(s["micro_batches"])) for s in schedule),
                key=lambda sh: sh.from_step,
            )
        )
        params = raw.get("parameters") or {}
        long_cp = int(raw.get("long_cp_size", 1)) if raw.get("long_seq_len") is not None else 1
        lane_cp = (int(params.get("short_cp_size", 1)), long_cp)
        return PlanHeader(str(raw["plan_id"]), int(raw["steps"]), dp, mb, shapes, lane_cp)
    except (KeyError, TypeError, ValueError) as e:
        raise ContractError(
            f"{p}: invalid plan.json header ({type(e).__name__}: {e}); re-plan with `loom plan SPEC`"
        ) from None
