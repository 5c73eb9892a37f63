"""The small request/response protocol between a running executor and its clients (`serve.json`).

A client needs three things: where the scheduler is, which Data Constructor serves its dp rank,
and how to get a handle to that actor. The executor publishes each constructor's actor handle as a
Dask dataset under a deterministic name (`constructor_dataset`) and writes `ServeInfo` both to
`PLAN_DIR/serve.json` and as the dataset `serve_dataset(plan_id)`, so a client given only a
scheduler address finds it too, and a client can reconnect to a restarted executor of the same plan.
A constructor recreated after its worker died is re-published under the same name (and ServeInfo
rewritten with its new worker), so a client re-resolves the name and asks again.

A constructor answers `take(dp_rank, step)` with that rank's micro-batches of that step
(`list[Batch]`, in micro-batch order): one actor call per rank and step. The request names the step,
so any constructor of the plan (a recreated one too) can rebuild it from the manifest; the position
inside the step (micro_batch) stays with the client. Both sides share the serving `Timings` (how
long a client retries, how often it checks its constructor) and the retry helper (`retry_until`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from loomdata.execution._config import Timings
from loomdata.execution._retry import Deadline, retry_until
from loomdata.schemas.errors import ContractError, ExecutionError

__all__ = [
    "SERVE_FORMAT_VERSION",
    "ConstructorInfo",
    "Deadline",
    "ExecutorUnavailable",
    "LoaderInfo",
    "ServeInfo",
    "Timings",
    "constructor_dataset",
    "parse_serve_info",
    "read_serve_info",
    "retry_until",
    "serve_dataset",
    "serve_path",
    "write_serve_info",
]

SERVE_FORMAT_VERSION = 1


class ExecutorUnavailable(ExecutionError):
    """The executor is stopping or not (yet) published; a client reconnects and retries."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ConstructorInfo(_Frozen):
    """One Data Constructor: its published dataset name and the dp ranks it serves."""

    name: str
    ranks: list[int]
    worker: str


class LoaderInfo(_Frozen):
    """One Source Loader: the source, its shard range and sample range, and where it runs."""

    name: str
    source: str
    part: int
    first_shard: int
    stop_shard: int
    first_sample: int
    stop_sample: int
    worker: str


class ServeInfo(_Frozen):
    """Contents of serve.json: how clients find a running executor of a plan."""

    format_version: int = SERVE_FORMAT_VERSION
    plan_id: str
    scheduler: str
    window: int
    peers: int
    constructors: list[ConstructorInfo]
    loaders: list[LoaderInfo]
    pid: int
    started_at: float

    def constructor_for(self, dp_rank: int) -> ConstructorInfo:
        """The constructor serving `dp_rank` (ExecutionError when none does)."""
        for c in self.constructors:
            if dp_rank in c.ranks:
                return c
        served = sorted(r for c in self.constructors for r in c.ranks)
        raise ExecutionError(
            f"plan {self.plan_id}: no constructor serves dp rank {dp_rank} (served ranks: "
            f"{served[0] if served else '-'}..{served[-1] if served else '-'}); check the rank"
        )


def serve_path(plan_dir: str | Path) -> Path:
    """Where a running executor writes its ServeInfo."""
    return Path(plan_dir) / "serve.json"


def serve_dataset(plan_id: str) -> str:
    """Dask dataset name under which the executor publishes its ServeInfo (as a JSON string)."""
    return f"loomdata/{plan_id}/serve"


def constructor_dataset(plan_id: str, index: int) -> str:
    """Dask dataset name under which constructor `index` of a plan's executor is published."""
    return f"loomdata/{plan_id}/constructor/{index}"


def write_serve_info(plan_dir: str | Path, info: ServeInfo) -> Path:
    """Write serve.json atomically (a reader never sees half a file)."""
    p = serve_path(plan_dir)
    tmp = p.with_name(f".serve.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info.model_dump(mode="json"), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, p)
    return p


def parse_serve_info(text: str, where: str) -> ServeInfo:
    """Validate ServeInfo JSON, rejecting an unknown format version with the fix."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ContractError(f"{where}: not valid JSON ({e})") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != SERVE_FORMAT_VERSION:
        raise ContractError(
            f"{where}: serve format version {version} is not supported (this loomdata reads version "
            f"{SERVE_FORMAT_VERSION}); restart `loom serve` with this version of loomdata"
        )
    try:
        return ServeInfo.model_validate(raw)
    except ValidationError as e:
        raise ContractError(f"{where}: invalid serve info: {e.errors()[0]['msg']}") from None


def read_serve_info(plan_dir: str | Path) -> ServeInfo:
    """Read serve.json; ExecutionError saying what to run when no executor serves the plan."""
    p = serve_path(plan_dir)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ExecutionError(
            f"{p}: no executor is serving this plan; start one with `loom serve {Path(plan_dir)}` "
            "or pass the scheduler address"
        ) from None
    return parse_serve_info(text, str(p))
