"""Telemetry from ranks: measured step times against the plan's predicted cost, buffered and written.

A rank's `StreamClient.record_step_time` rides on its next take (no extra round trip); the constructor
turns each (step, seconds) into a `StepTelemetry` with the segment lengths the rank held (from the
manifest rows it reads anyway) and the predicted cost, and keeps them in a bounded buffer until the
executor drains it. `loom serve` appends the drained records to PLAN_DIR/telemetry.jsonl, lines that
`loom calibrate` reads as measurements.

The predicted cost is the plan's own formula, `CostSpec.of` (in schemas, so execution needs no planning):
attention * L^2 + linear * L per segment, divided by the lane's cp size. The manifest has no image-token
counts, so the encoder term is left out of `predicted`.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loomdata.execution._manifest import ManifestRows
from loomdata.execution._metrics import FleetView
from loomdata.execution._outcome import issue
from loomdata.execution._retry import Deadline
from loomdata.schemas.metrics import StepTelemetry

if TYPE_CHECKING:  # annotations only: no pydantic in a serving worker
    from loomdata.schemas.plan import AnyPlan
    from loomdata.schemas.records import CostModel
    from loomdata.schemas.spec import CostSpec

__all__ = [
    "TELEMETRY_FILE",
    "TelemetryBuffer",
    "append_telemetry",
    "drain_telemetry",
    "imbalance",
    "predicted_cost",
]

TELEMETRY_FILE = "telemetry.jsonl"
"""Name of the telemetry file in the plan dir."""


def predicted_cost(length: np.ndarray, lane: np.ndarray, cost: CostSpec | CostModel, cp: Sequence[int]) -> float:
    """Sum of the text terms of the plan's cost over segments of `length` in `lane` (cp[lane] ranks share one)."""
    per_lane = np.asarray(cp, dtype=np.int64)[np.asarray(lane, dtype=np.int64)]
    return float(cost.of(length, None, per_lane).sum())


def valid_report(step: Any, seconds: Any, steps: int) -> bool:
    """Whether (step, seconds) is a step of the plan and a positive finite time (others are dropped)."""
    ok_step = isinstance(step, (int, np.integer)) and not isinstance(step, bool) and 0 <= step < steps
    ok_secs = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
    return bool(ok_step and ok_secs and seconds > 0)


class TelemetryBuffer:
    """A constructor's recorded step times not yet drained; bounded (the oldest go first), one per (rank, step).

    Peers (tp/pp/cp ranks of one dp rank) report the same (rank, step): the slowest time is kept, as a
    synchronous step waits for it.
    """

    def __init__(self, cost: CostSpec | CostModel, cp: tuple[int, int] = (1, 1), capacity: int = 4096) -> None:
        """`cost`: the plan's cost model; `cp`: the cp size of the short and the long lane."""
        self._cost = cost
        self._cp = cp
        self._capacity = max(1, capacity)
        self._pending: OrderedDict[tuple[int, int], StepTelemetry] = OrderedDict()
        self.dropped = 0
        """Records dropped: invalid, or pushed out of a full buffer."""

    @classmethod
    def of(cls, meta: AnyPlan) -> TelemetryBuffer:
        """A buffer costing steps as the plan's planner did (`parameters.cost`, the lanes' cp sizes)."""
        return cls(meta.parameters.cost, (meta.parameters.short_cp_size, meta.long_cp_size))

    def add(self, rank: int, step: int, seconds: float, rows: ManifestRows) -> None:
        """Record `rank`'s measured `seconds` for `step`; `rows` are the manifest rows of (step, rank)."""
        key = (rank, step)
        old = self._pending.get(key)
        if old is not None:
            self._pending[key] = StepTelemetry(
                step=step, dp_rank=rank, lengths=old.lengths, predicted=old.predicted, seconds=max(old.seconds, seconds)
            )
            return
        self._pending[key] = StepTelemetry(
            step=step,
            dp_rank=rank,
            lengths=rows.length.astype(np.int64).tolist(),
            predicted=predicted_cost(rows.length, rows.lane, self._cost, self._cp),
            seconds=float(seconds),
        )
        while len(self._pending) > self._capacity:
            self._pending.popitem(last=False)
            self.dropped += 1

    def drain(self) -> list[StepTelemetry]:
        """Every pending record, in arrival order; the buffer is empty afterwards."""
        out = list(self._pending.values())
        self._pending.clear()
        return out

    def __len__(self) -> int:
        return len(self._pending)


def drain_telemetry(view: FleetView, timeout_s: float) -> list[StepTelemetry]:
    """Drain every constructor of `view` at once; a lost or slow one is left out (its records wait for the next)."""
    deadline = Deadline(timeout_s)
    calls = [issue(a.future, a.handle, "drain_telemetry") for a in view.constructors]
    out: list[StepTelemetry] = []
    for call in calls:
        got = call.outcome(timeout=deadline.left)
        if got.ok and isinstance(got.value, list):
            out.extend(r for r in got.value if isinstance(r, StepTelemetry))
    return sorted(out, key=lambda r: (r.step, r.dp_rank))


def append_telemetry(plan_dir: str | Path, records: Iterable[StepTelemetry]) -> int:
    """Append records to PLAN_DIR/telemetry.jsonl, sorted by (step, rank); returns how many lines were written."""
    rows = sorted(records, key=lambda r: (r.step, r.dp_rank))
    if not rows:
        return 0
    with (Path(plan_dir) / TELEMETRY_FILE).open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r.to_dict(), separators=(",", ":")) + "\n" for r in rows)
    return len(rows)


def imbalance(records: Iterable[StepTelemetry], dp_size: int) -> dict[str, Any] | None:
    """Predicted and measured max/mean over ranks of the latest step every rank reported; None if none did."""
    by_step: dict[int, list[StepTelemetry]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    full = [s for s, rs in by_step.items() if len({r.dp_rank for r in rs}) == dp_size]
    if not full:
        return None
    step = max(full)
    pred = np.array([r.predicted for r in by_step[step]])
    secs = np.array([r.seconds for r in by_step[step]])
    return {
        "step": step,
        "predicted_imbalance": round(float(pred.max() / pred.mean()), 4) if pred.mean() > 0 else None,
        "measured_imbalance": round(float(secs.max() / secs.mean()), 4),
    }
