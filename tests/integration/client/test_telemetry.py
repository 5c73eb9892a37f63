"""Telemetry from ranks: step times recorded by real StreamClients reach PLAN_DIR/telemetry.jsonl and `loom calibrate`.

Two ranks stream a plan from a real `loom serve` (its own process and TLS cluster), record a time for
every step they consumed, and close; the serve writes one line per (rank, step) with the segment
lengths the manifest gives that rank and step, the plan's predicted cost and the recorded seconds.
The recorded times are made proportional to the plan's cost model, so `loom calibrate` on the file
must give back that model. No timing asserts: the seconds are the test's own numbers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.planning import read_measurements, segment_cost
from loomdata.schemas import PlanMeta, read_manifest, read_plan
from loomdata.torch import LoomDataset

from ._serving import Serving

SECONDS_PER_UNIT = 1e-9
CLI = [sys.executable, "-m", "loomdata.cli"]


def _manifest_lengths(plan_dir: Path, meta: PlanMeta) -> dict[tuple[int, int], list[int]]:
    """Per (rank, step), the segment lengths in (micro_batch, stored) order: an independent read of the manifest."""
    t = read_manifest(plan_dir, meta)
    step, rank, mb, length = (
        t.column(c).to_numpy().astype(np.int64) for c in ("step", "dp_rank", "micro_batch", "length")
    )
    order = np.lexsort((mb, rank, step))
    out: dict[tuple[int, int], list[int]] = {}
    for i in order:
        out.setdefault((int(rank[i]), int(step[i])), []).append(int(length[i]))
    return out


def _seconds(meta: PlanMeta, lengths: list[int]) -> float:
    """A made-up step time exactly proportional to the plan's cost model (planning's own formula)."""
    return SECONDS_PER_UNIT * float(segment_cost(np.asarray(lengths), None, meta.parameters.cost).sum())


def test_serve_writes_one_line_per_rank_and_step_that_calibrate_reads(stream_plan: Path, tmp_path: Path) -> None:
    meta = read_plan(stream_plan)
    want = _manifest_lengths(stream_plan, meta)
    (stream_plan / "telemetry.jsonl").unlink(missing_ok=True)
    serving = Serving(stream_plan, tmp_path / "serve.log")
    try:
        streams = {r: StreamClient(stream_plan, r, retry_s=60) for r in range(meta.dp_size)}
        for step in range(meta.steps):  # each rank consumes a step, "trains" it, then reports its time
            for r, s in streams.items():
                got = [next(s) for _ in range(meta.micro_batches)]
                assert {b.step for b in got} == {step}
                s.record_step_time(step, _seconds(meta, want[(r, step)]))
        for s in streams.values():
            s.close()  # the last step's time goes in one call on close (no take carries it)
        assert serving.proc.stdout is not None
        serving.proc.send_signal(signal.SIGTERM)
        out, _ = serving.proc.communicate(timeout=60)
        assert serving.proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        serving.close()
    stopped = [json.loads(x) for x in out.splitlines() if x.strip()][-1]
    assert stopped["event"] == "stopped"

    lines = [json.loads(x) for x in (stream_plan / "telemetry.jsonl").read_text().splitlines()]
    assert sorted((x["rank"], x["step"]) for x in lines) == sorted(want)  # one line per (rank, step), none twice
    cost = meta.parameters.cost
    for x in lines:
        lengths = want[(x["rank"], x["step"])]
        assert x["lengths"] == lengths
        assert x["seconds"] == pytest.approx(_seconds(meta, lengths), rel=1e-12)
        assert x["predicted"] == pytest.approx(float(segment_cost(np.asarray(lengths), None, cost).sum()), rel=1e-12)
    if stopped["telemetry"] is not None:  # the ranks' records reached the serve before its final drain
        assert stopped["telemetry"]["predicted_imbalance"] == pytest.approx(stopped["telemetry"]["measured_imbalance"])

    runs = read_measurements(stream_plan / "telemetry.jsonl")  # the extra keys are kept as notes
    assert len(runs) == len(want) and {"step", "rank", "predicted"} <= set(runs[0].notes)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(meta.spec.model_dump(mode="json", exclude={"base_dir"}), sort_keys=False))
    proc = subprocess.run(
        [*CLI, "calibrate", str(spec_path), str(stream_plan / "telemetry.jsonl"), "--no-replan", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    fit = json.loads(proc.stdout)
    assert fit["runs"] == len(want)
    assert fit["cost"]["attention"] == pytest.approx(cost.attention)  # times proportional to the model: it comes back
    assert fit["cost"]["linear"] == pytest.approx(cost.linear, rel=1e-6)
    assert fit["r2"] == pytest.approx(1.0)
    (stream_plan / "telemetry.jsonl").unlink()  # the plan dir is shared by the session's tests


def test_peers_reports_merge_and_drain_once(dask_client: Any, stream_plan: Path) -> None:
    meta = read_plan(stream_plan)
    want = _manifest_lengths(stream_plan, meta)
    with Executor(stream_plan, dask_client, peers=2) as ex:
        ex.telemetry()  # nothing recorded yet, or left over from another test's executor: start empty
        # one step per call (bytes_in_flight=0): the take of step 1 carries step 0's reports; with several
        # steps per call they ride on the next call, some steps later
        one = {"bytes_in_flight": 0}
        a, b = StreamClient(stream_plan, 0, **one), StreamClient(stream_plan, 0, **one)  # two peers of dp rank 0
        torch_rank = LoomDataset(stream_plan, 1, **one)
        ranks = iter(torch_rank)
        for _ in range(meta.micro_batches):
            next(a), next(b), next(ranks)
        a.record_step_time(0, 2.0)
        b.record_step_time(0, 3.0)  # the slower peer is the step's time
        torch_rank.record_step_time(0, 1.5)
        # the next takes carry the reports; a client's prefetched take of step 1 may have left before its
        # report was recorded, so the reports are all in after step 2's takes
        assert meta.steps >= 4
        for _ in range(2 * meta.micro_batches):
            next(a), next(b), next(ranks)
        got = ex.telemetry()
        assert [(r.dp_rank, r.step, r.seconds) for r in got] == [(0, 0, 3.0), (1, 0, 1.5)]
        assert [r.lengths for r in got] == [want[(0, 0)], want[(1, 0)]]
        assert ex.telemetry() == []  # drained
        a.record_step_time(1, 0.5)
        a.close()  # sent on close: no take carries it
        assert [(r.dp_rank, r.step, r.seconds) for r in ex.telemetry()] == [(0, 1, 0.5)]
        b.close()
        torch_rank.close()
    with pytest.raises(ValueError, match="step must be a step of plan"):
        a.record_step_time(meta.steps, 1.0)
    with pytest.raises(ValueError, match="positive finite"):
        a.record_step_time(0, float("nan"))
    with pytest.raises(ValueError, match="positive finite"):
        a.record_step_time(0, 0.0)
