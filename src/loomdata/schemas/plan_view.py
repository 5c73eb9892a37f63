"""plan.json as a serving worker reads it: plain frozen records, no pydantic (`PlanView`), and the manifest reads
and the freshness rule that take either form of a plan.

The serving process validates plan.json (`plan.read_plan`, the pydantic `PlanMeta`) before it creates any actor;
a worker's loaders and constructors then read the same file into a `PlanView` (the fields they use, the spec's
as `records`), so no worker imports pydantic (~8 MiB of private memory a worker, session 18).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from loomdata.schemas.errors import ContractError, StaleIndexError
from loomdata.schemas.header import load_plan_json
from loomdata.schemas.records import CostModel, ImageRecord, SourceRecord, TokenizerRecord
from loomdata.schemas.tables import MANIFEST_SCHEMA, TableKind, iter_steps

__all__ = [
    "FreshPlan",
    "ManifestPart",
    "ManifestPlan",
    "ParamsView",
    "PlanView",
    "SpecView",
    "check_fresh",
    "read_manifest",
    "read_plan_view",
    "stale_sources",
]


class _Part(Protocol):
    @property
    def path(self) -> str: ...
    @property
    def first_step(self) -> int: ...
    @property
    def last_step(self) -> int: ...


class ManifestPlan(Protocol):
    """What the manifest reads take of a plan (`PlanMeta` or `PlanView`)."""

    @property
    def steps(self) -> int: ...
    @property
    def manifest(self) -> Sequence[_Part]: ...


class FreshPlan(Protocol):
    """What the freshness rule takes of a plan (`PlanMeta` or `PlanView`)."""

    @property
    def plan_id(self) -> str: ...
    @property
    def sources(self) -> Sequence[str]: ...
    @property
    def index_fingerprints(self) -> Mapping[str, str]: ...


@dataclass(frozen=True, slots=True)
class ManifestPart:
    """One manifest Parquet file and the inclusive step range it holds (`ManifestFile`, plain)."""

    path: str  # relative to the plan dir
    first_step: int
    last_step: int
    rows: int


@dataclass(frozen=True, slots=True)
class SpecView:
    """What serving reads of the plan's spec: where its index is, the tokenizer, the image rule, the sources."""

    name: str
    workdir: Path
    tokenizer: TokenizerRecord
    images: ImageRecord
    sources: tuple[SourceRecord, ...]

    def source(self, name: str) -> SourceRecord:
        """The source called `name` (KeyError names the known ones), as `Spec.source`."""
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(f"unknown source {name!r} (known: {', '.join(s.name for s in self.sources)})")


@dataclass(frozen=True, slots=True)
class ParamsView:
    """Of the planner's parameters, what serving uses: the cost model and the short lane's cp size."""

    cost: CostModel
    short_cp_size: int


@dataclass(frozen=True, slots=True)
class PlanView:
    """The fields of `PlanMeta` a serving worker uses, plain (same names, so code reads either)."""

    plan_id: str
    spec: SpecView
    spec_hash: str
    sources: tuple[str, ...]
    index_fingerprints: dict[str, str] = field(hash=False)
    seed: int
    steps: int
    dp_size: int
    micro_batches: int
    seq_len: int
    long_seq_len: int | None
    long_cp_size: int
    parameters: ParamsView
    manifest: tuple[ManifestPart, ...]

    def lane_seq_len(self, lane: int) -> int:
        """Capacity of a packed sequence in `lane` (0 short, 1 long), as `PlanMeta.lane_seq_len`."""
        return lane_capacity(self.plan_id, self.seq_len, self.long_seq_len, lane)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> PlanView:
        """The view of plan.json's contents (written from a validated `PlanMeta`: every field is there; `PlanMeta.view`
        makes the same view of the validated model)."""
        spec, params = raw["spec"], raw["parameters"]
        tok, img = spec.get("tokenizer") or {}, spec.get("images") or {}
        long_seq_len = raw.get("long_seq_len")
        return cls(
            plan_id=str(raw["plan_id"]),
            spec=SpecView(
                name=str(spec["name"]),
                workdir=Path(spec["workdir"]),
                tokenizer=TokenizerRecord.from_json(tok),
                images=ImageRecord.from_json(img),
                sources=tuple(SourceRecord.from_json(s) for s in spec["sources"]),
            ),
            spec_hash=str(raw["spec_hash"]),
            sources=tuple(str(s) for s in raw["sources"]),
            index_fingerprints={str(k): str(v) for k, v in raw["index_fingerprints"].items()},
            seed=int(raw["seed"]),
            steps=int(raw["steps"]),
            dp_size=int(raw["dp_size"]),
            micro_batches=int(raw["micro_batches"]),
            seq_len=int(raw["seq_len"]),
            long_seq_len=None if long_seq_len is None else int(long_seq_len),
            long_cp_size=int(raw.get("long_cp_size", 1)),
            parameters=ParamsView(CostModel.from_json(params["cost"]), int(params["short_cp_size"])),
            manifest=tuple(
                ManifestPart(str(f["path"]), int(f["first_step"]), int(f["last_step"]), int(f["rows"]))
                for f in raw["manifest"]
            ),
        )


def lane_capacity(plan_id: str, seq_len: int, long_seq_len: int | None, lane: int) -> int:
    """Capacity of a packed sequence in `lane` (0 short, 1 long) of a plan (`PlanMeta` and `PlanView` both)."""
    if lane == 0:
        return seq_len
    if long_seq_len is None:
        raise ContractError(f"plan {plan_id}: lane {lane} used but the plan has no long-context lane")
    return long_seq_len


def read_plan_view(plan_dir: str | Path) -> PlanView:
    """plan.json as a `PlanView` (no pydantic; the serving process validated it with `read_plan`). A missing file,
    another format version or a missing or malformed field raises ContractError naming the file."""
    p, raw = load_plan_json(plan_dir)
    try:
        return PlanView.from_json(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ContractError(
            f"{p}: invalid plan.json ({type(e).__name__}: {e}); re-plan with `loom plan SPEC`"
        ) from None


def read_manifest(
    plan_dir: str | Path,
    meta: ManifestPlan,
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


def stale_sources(meta: FreshPlan, current: Mapping[str, str], sources: Sequence[str] | None = None) -> list[str]:
    """`source (plan FP, index FP)` for each of `sources` (default all) whose index is not the plan's: the one rule."""
    return [
        f"{s} (plan {meta.index_fingerprints.get(s)}, index {current.get(s)})"
        for s in (meta.sources if sources is None else sources)
        if meta.index_fingerprints.get(s) != current.get(s)
    ]


def check_fresh(meta: FreshPlan, current: Mapping[str, str], sources: Sequence[str] | None = None) -> None:
    """Raise StaleIndexError when any of `sources` (default all) has an index fingerprint other than the plan's."""
    stale = stale_sources(meta, current, sources)
    if stale:
        raise StaleIndexError(
            f"plan {meta.plan_id} was made on an older index of: {', '.join(stale)}; re-plan with `loom plan SPEC`"
        )
