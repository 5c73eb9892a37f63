"""plan.json: what a plan is made of, from what, with which parameters; read by every later stage."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, ValidationError

from loomdata.schemas.errors import ContractError, StaleIndexError
from loomdata.schemas.header import PLAN_FORMAT_VERSION, load_plan_json
from loomdata.schemas.spec import CostSpec, Spec
from loomdata.schemas.tables import MANIFEST_SCHEMA, TableKind, iter_steps

__all__ = [
    "PLAN_FORMAT_VERSION",
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
        if lane == 0:
            return self.seq_len
        if self.long_seq_len is None:
            raise ContractError(f"plan {self.plan_id}: lane {lane} used but the plan has no long-context lane")
        return self.long_seq_len

    def to_json(self) -> str:
        """Stable JSON (sorted keys) so the same plan gives byte-identical files."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1) + "\n"


def read_plan(plan_dir: str | Path) -> PlanMeta:
    """Read and validate plan.json, rejecting an unknown format version."""
    p, raw = load_plan_json(plan_dir)
    try:
        return PlanMeta.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ContractError(f"{p}: invalid plan.json: {problems}") from None


def read_manifest(
    plan_dir: str | Path,
    meta: PlanMeta,
    first_step: int = 0,
    last_step: int | None = None,
    dp_ranks: list[int] | None = None,
    columns: list[str] | None = None,
) -> pa.Table:
    """Manifest rows for steps [first_step, last_step] (inclusive) and the given ranks, in stored order: only
    the partitions holding those steps are opened (each one's kind, version and schema checked), only their row
    groups whose step statistics overlap the range are read, and only `columns` (default all).

    Read with `pyarrow.parquet` and NumPy masks, not `pyarrow.dataset`: a Dask worker or the serving process that
    reads the manifest does not import the dataset layer (nor start its scan threads).
    """
    last = meta.steps - 1 if last_step is None else last_step
    names = list(MANIFEST_SCHEMA.names if columns is None else columns)
    read = names if dp_ranks is None else list(dict.fromkeys([*names, "dp_rank"]))
    ranks = None if dp_ranks is None else np.unique(np.asarray(dp_ranks, dtype=np.int64))
    parts: list[pa.Table] = []
    for f in meta.manifest:
        if f.last_step < first_step or f.first_step > last:
            continue
        for t in iter_steps(Path(plan_dir) / f.path, TableKind.MANIFEST, first_step, last, read, use_threads=False):
            if ranks is not None:
                keep = np.isin(t.column("dp_rank").to_numpy(), ranks)
                t = t if keep.all() else t.filter(pa.array(keep))
            parts.append(t.select(names))
    schema = pa.schema([MANIFEST_SCHEMA.field(c) for c in names], metadata=MANIFEST_SCHEMA.metadata)
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts).combine_chunks().cast(schema)


def stale_sources(meta: PlanMeta, current: Mapping[str, str], sources: Sequence[str] | None = None) -> list[str]:
    """`source (plan FP, index FP)` for each of `sources` (default all) whose index is not the plan's: the one rule."""
    return [
        f"{s} (plan {meta.index_fingerprints.get(s)}, index {current.get(s)})"
        for s in (meta.sources if sources is None else sources)
        if meta.index_fingerprints.get(s) != current.get(s)
    ]


def check_fresh(meta: PlanMeta, current: Mapping[str, str], sources: Sequence[str] | None = None) -> None:
    """Raise StaleIndexError when any of `sources` (default all) has an index fingerprint other than the plan's."""
    stale = stale_sources(meta, current, sources)
    if stale:
        raise StaleIndexError(
            f"plan {meta.plan_id} was made on an older index of: {', '.join(stale)}; re-plan with `loom plan SPEC`"
        )
