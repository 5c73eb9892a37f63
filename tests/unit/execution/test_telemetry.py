"""Telemetry records: the constructor's buffer, the predicted cost against planning's, the file calibrate reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loomdata.execution._manifest import ManifestRows
from loomdata.execution._telemetry import (
    TELEMETRY_FILE,
    TelemetryBuffer,
    append_telemetry,
    imbalance,
    predicted_cost,
    valid_report,
)
from loomdata.planning import read_measurements, segment_cost
from loomdata.schemas import CostSpec, StepTelemetry


def _rows(step: int, rank: int, lengths: list[int], lanes: list[int] | None = None) -> ManifestRows:
    n = len(lengths)
    z = np.zeros(n, dtype=np.uint32)
    lane = np.asarray(lanes if lanes is not None else [0] * n, dtype=np.uint8)
    return ManifestRows(
        np.full(n, step, np.uint32), np.full(n, rank, np.uint32), z, z.astype(np.uint16), z.astype(np.uint64), z,
        np.asarray(lengths, dtype=np.uint32), lane,
    )  # fmt: skip


def test_predicted_cost_is_planning_segment_cost_per_lane() -> None:
    rng = np.random.default_rng(0)
    cost = CostSpec(attention=1.0, linear=3000.0, encoder=0.0)
    length = rng.integers(1, 9000, 50)
    lane = rng.integers(0, 2, 50)
    cp = (1, 4)
    want = segment_cost(length, None, cost, np.where(lane == 1, cp[1], cp[0])).sum()
    assert predicted_cost(length, lane, cost, cp) == pytest.approx(float(want), rel=1e-12)


def test_buffer_keeps_lengths_and_the_slowest_peer_and_drains_once() -> None:
    buf = TelemetryBuffer(CostSpec(attention=1.0, linear=10.0), cp=(1, 2))
    buf.add(0, 3, 2.0, _rows(3, 0, [5, 7], lanes=[0, 1]))
    buf.add(0, 3, 3.0, _rows(3, 0, [5, 7], lanes=[0, 1]))  # a peer of rank 0, slower
    buf.add(0, 3, 1.0, _rows(3, 0, [5, 7], lanes=[0, 1]))
    buf.add(1, 3, 4.0, _rows(3, 1, [9]))
    got = buf.drain()
    assert [(r.dp_rank, r.step, r.seconds, r.lengths) for r in got] == [(0, 3, 3.0, [5, 7]), (1, 3, 4.0, [9])]
    assert got[0].predicted == pytest.approx((25 + 50) + (49 + 70) / 2)
    assert buf.drain() == [] and len(buf) == 0


def test_buffer_is_bounded_and_drops_the_oldest() -> None:
    buf = TelemetryBuffer(CostSpec(), capacity=3)
    for step in range(5):
        buf.add(0, step, 1.0, _rows(step, 0, [4]))
    assert [r.step for r in buf.drain()] == [2, 3, 4]
    assert buf.dropped == 2


@pytest.mark.parametrize(
    ("step", "seconds", "ok"),
    [(0, 1.0, True), (9, 0.5, True), (10, 1.0, False), (-1, 1.0, False), (True, 1.0, False), (1.0, 1.0, False),
     (0, 0.0, False), (0, float("inf"), False), (0, float("nan"), False), (0, "1", False), (0, -2.0, False)],
)  # fmt: skip
def test_valid_report(step: object, seconds: object, ok: bool) -> None:
    assert valid_report(step, seconds, steps=10) is ok


def test_file_lines_are_calibrate_measurements(tmp_path: Path) -> None:
    recs = [
        StepTelemetry(step=1, dp_rank=1, lengths=[3, 4], predicted=10.0, seconds=0.4),
        StepTelemetry(step=1, dp_rank=0, lengths=[9], predicted=20.0, seconds=0.6),
        StepTelemetry(step=0, dp_rank=0, lengths=[2], predicted=5.0, seconds=0.2),
    ]
    assert append_telemetry(tmp_path, recs[:2]) == 2
    assert append_telemetry(tmp_path, recs[2:]) == 1
    assert append_telemetry(tmp_path, []) == 0
    lines = [json.loads(x) for x in (tmp_path / TELEMETRY_FILE).read_text().splitlines()]
    assert [(x["step"], x["rank"]) for x in lines] == [(1, 0), (1, 1), (0, 0)]  # sorted per append, appended
    assert lines[1] == {"lengths": [3, 4], "seconds": 0.4, "step": 1, "rank": 1, "predicted": 10.0}
    runs = read_measurements(tmp_path / TELEMETRY_FILE)
    assert [m.lengths.tolist() for m in runs] == [[9], [3, 4], [2]]
    assert runs[0].notes == {"step": 1, "rank": 0, "predicted": 20.0}


def test_imbalance_of_the_latest_full_step() -> None:
    def rec(step: int, rank: int, pred: float, secs: float) -> StepTelemetry:
        return StepTelemetry(step=step, dp_rank=rank, lengths=[1], predicted=pred, seconds=secs)

    assert imbalance([rec(0, 0, 1.0, 1.0)], dp_size=2) is None  # rank 1 has not reported step 0
    got = imbalance([rec(0, 0, 1.0, 1.0), rec(0, 1, 3.0, 1.0), rec(1, 0, 2.0, 1.0), rec(2, 1, 2.0, 1.0)], dp_size=2)
    assert got == {"step": 0, "predicted_imbalance": 1.5, "measured_imbalance": 1.0}
