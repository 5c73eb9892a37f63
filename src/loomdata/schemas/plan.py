"""plan.json: what a plan is made of, from what, with which parameters; read by every later stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeAlias

from pydantic import BaseModel, ConfigDict, ValidationError

from loomdata.schemas.errors import ContractError
from loomdata.schemas.header import PLAN_FORMAT_VERSION, load_plan_json
from loomdata.schemas.plan_view import (
    ManifestPart,
    ParamsView,
    PlanView,
    SpecView,
    check_fresh,
    lane_capacity,
    read_manifest,
    stale_sources,
)
from loomdata.schemas.records import CostModel, ImageRecord, SourceRecord, TokenizerRecord
from loomdata.schemas.spec import CostSpec, Spec

__all__ = [
    "PLAN_FORMAT_VERSION",
    "AnyPlan",
    "ManifestFile",
    "PlanMeta",
    "PlanParameters",
    "ResumeInfo",
    "StepShape",
    "check_fresh",
    "read_manifest",
    "read_plan",
    "stale_sources",
]


class ManifestFile(BaseModel):
    """One manifest Parquet file and the inclusive step range it holds."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str  # relative to the plan dir
    first_step: int
    last_step: int
    rows: int


class StepShape(BaseModel):
    """The training shape of the steps from `from_step` on (until the next shape of a schedule)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    from_step: int
    dp_size: int
    micro_batches: int


class ResumeInfo(BaseModel):
    """Of an elastic re-plan: the base plan it continues, from which step, and the base's last shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    base_plan_id: str
    at_step: int
    base_dp_size: int
    base_micro_batches: int


class PlanParameters(BaseModel):
    """How the planner made the plan: its version and the settings it used (plan.json `parameters`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    planner_version: str
    fill: float
    step_budget_tokens: int  # of the spec's training shape
    cost: CostSpec
    short_cp_size: int
    long_threshold: int | None = None
    baseline: str
    resume: ResumeInfo | None = None  # re-plans only
    shape_schedule: list[StepShape] | None = None  # re-plans only: the shape of every step range

    def shapes(self, dp_size: int, micro_batches: int) -> list[StepShape]:
        """The shape of every step range: the recorded schedule, or the plan's one shape from step 0."""
        if self.shape_schedule:
            return list(self.shape_schedule)
        return [StepShape(from_step=0, dp_size=dp_size, micro_batches=micro_batches)]


class PlanMeta(BaseModel):
    """Contents of plan.json. `sources[i]` is the name of manifest source id `i`; `spec` is the spec the plan
    was made from (validated once, when plan.json is read)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format_version: int
    plan_id: str
    spec: Spec
    spec_hash: str
    sources: list[str]
    index_fingerprints: dict[str, str]
    seed: int
    steps: int
    dp_size: int
    micro_batches: int
    seq_len: int
    long_seq_len: int | None = None
    long_cp_size: int = 1
    parameters: PlanParameters
    manifest: list[ManifestFile]
    summary: dict[str, Any] = {}

    def lane_seq_len(self, lane: int) -> int:
        """Capacity of a packed sequence in `lane` (0 short, 1 long)."""
        return lane_capacity(self.plan_id, self.seq_len, self.long_seq_len, lane)

    def view(self) -> PlanView:
        """This plan as plain records (`PlanView`): what a serving worker reads from the same plan.json."""
        spec = self.spec
        return PlanView(
            plan_id=self.plan_id,
            spec=SpecView(
                name=spec.name,
                workdir=spec.workdir,
                tokenizer=TokenizerRecord.from_spec(spec.tokenizer),
                images=ImageRecord.from_spec(spec.images),
                sources=tuple(SourceRecord.from_spec(s) for s in spec.sources),
            ),
            spec_hash=self.spec_hash,
            sources=tuple(self.sources),
            index_fingerprints=dict(self.index_fingerprints),
            seed=self.seed,
            steps=self.steps,
            dp_size=self.dp_size,
            micro_batches=self.micro_batches,
            seq_len=self.seq_len,
            long_seq_len=self.long_seq_len,
            long_cp_size=self.long_cp_size,
            parameters=ParamsView(CostModel.from_spec(self.parameters.cost), self.parameters.short_cp_size),
            manifest=tuple(ManifestPart(f.path, f.first_step, f.last_step, f.rows) for f in self.manifest),
        )

    def to_json(self) -> str:
        """Stable JSON (sorted keys) so the same plan gives byte-identical files."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1) + "\n"


AnyPlan: TypeAlias = "PlanMeta | PlanView"
"""A plan as the serving process reads it (validated, `PlanMeta`) or as a worker does (`PlanView`): code that runs in
both takes either (the two have the same field names)."""


def read_plan(plan_dir: str | Path) -> PlanMeta:
    """Read and validate plan.json, rejecting an unknown format version."""
    p, raw = load_plan_json(plan_dir)
    try:
        return PlanMeta.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ContractError(f"{p}: invalid plan.json: {problems}") from None
