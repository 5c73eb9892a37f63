"""Clients survive a restarted `loom serve` (new address, new credentials); a dead one is an error within 5 s.

Also: a second `loom serve` of a served plan is refused with the first one's pid, and leaves its
serve.json alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loomdata.client import StreamClient
from loomdata.execution.protocol import lock_path, read_serve_info, serve_path
from loomdata.schemas import Batch, ExecutionError
from loomtest.stream import check_exact

from ._serving import Serving

STEPS = 10
BULK = ("--window", "4", "--bytes-in-flight", "0")  # 2 steps per call: steps are left to take after a kill


@pytest.fixture(scope="module")
def restart_plan(dask_client: Any, tmp_path_factory: pytest.TempPathFactory, loomtest: Any) -> Path:
    spec = loomtest.make_spec(tmp_path_factory.mktemp("restart"), steps=STEPS, dp_size=2)
    return Path(loomtest.index_and_plan(spec, dask_client))


def test_clients_continue_across_a_killed_and_restarted_serve(restart_plan: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    first = Serving(restart_plan, log, *BULK)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "loomdata.cli", "serve", str(restart_plan), "--no-autoscale"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and f"pid {first.pid}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        assert read_serve_info(restart_plan).pid == first.pid  # the refused serve left ours alone
        old = read_serve_info(restart_plan)
        assert old.tls is not None and old.scheduler.startswith("tls://")

        streams = {r: StreamClient(restart_plan, r, retry_s=60) for r in (0, 1)}
        mbs = streams[0].meta.micro_batches
        got: dict[int, list[Batch]] = {r: [next(s) for _ in range(3 * mbs)] for r, s in streams.items()}
        first.kill()
        restarted = Serving(restart_plan, log, *BULK)  # takes over the dead serve's lock; new port, new certificates
        try:
            new = read_serve_info(restart_plan)
            assert new.pid == restarted.pid and new.scheduler != old.scheduler
            for r, s in streams.items():
                got[r].extend(s)
                s.close()
            check_exact(restart_plan, got)  # identical batches, nothing lost or repeated
            assert restarted.stop() == 0
        finally:
            restarted.close()
        assert not serve_path(restart_plan).exists() and not lock_path(restart_plan).exists()
    finally:
        first.close()


def test_a_dead_serve_is_an_error_within_5_s(restart_plan: Path, tmp_path: Path) -> None:
    serving = Serving(restart_plan, tmp_path / "serve.log", *BULK)
    try:
        stream = StreamClient(restart_plan, 0, retry_s=60)
        next(stream)
        sems = serving.semaphores()  # the nannies' spawn-context queues and events
        serving.kill()
        t0 = time.monotonic()
        with pytest.raises(ExecutionError) as err:
            for _ in stream:
                pass
        took = time.monotonic() - t0
        stream.close()
    finally:
        serving.close()
    assert took < 5.0, f"took {took:.1f}s to say the executor is dead"
    assert sems, "the serve mapped no named semaphore: this test no longer checks that a kill unlinks them"
    assert not [p for p in sems if p.exists()], "the killed serve's semaphores were left in /dev/shm"
    msg = str(err.value)
    assert str(restart_plan) in msg and f"pid {serving.pid}" in msg and "loom serve" in msg
    for p in (serve_path(restart_plan), lock_path(restart_plan)):  # leftovers of the killed serve
        p.unlink(missing_ok=True)


def test_serve_json_carries_pid_host_and_a_live_heartbeat(restart_plan: Path, tmp_path: Path) -> None:
    serving = Serving(restart_plan, tmp_path / "serve.log")
    try:
        beats: list[float] = []
        deadline = time.monotonic() + 30  # a loaded machine delays a beat; three distinct ones must come
        while len(set(beats)) < 3 and time.monotonic() < deadline:
            beats.append(json.loads(serve_path(restart_plan).read_text())["heartbeat_at"])
            time.sleep(0.5)
        info = read_serve_info(restart_plan)
        assert info.pid == serving.pid and info.host == os.uname().nodename
        assert len(set(beats)) >= 3 and beats == sorted(beats), beats  # the heartbeat moves, and only forward
        assert time.time() - info.heartbeat_at < 5
        lock = json.loads(lock_path(restart_plan).read_text())
        assert lock["pid"] == serving.pid
        assert serving.stop() == 0
    finally:
        serving.close()
    assert not serve_path(restart_plan).exists()
