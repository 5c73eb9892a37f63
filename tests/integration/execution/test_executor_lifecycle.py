"""Executor lifecycle: refuses a stale plan, re-partitions a source's loaders while serving, `serve` in a process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.execution._window import step_bytes
from loomdata.schemas import SourceDataError, StaleIndexError, read_plan


def test_stale_index_is_refused(dask_client: Client, stream_plan: Path, tmp_path: Path) -> None:
    copy = tmp_path / "plan"
    shutil.copytree(stream_plan, copy)
    raw = json.loads((copy / "plan.json").read_text())
    raw["index_fingerprints"]["web"] = "0000"
    (copy / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(StaleIndexError, match=r"older index of: web \(plan 0000, index "):
        Executor(copy, dask_client).start()
    assert not (copy / "serve.json").exists()


def test_loaders_can_be_added_while_serving(dask_client: Client, stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)
    meta = oracle.meta
    # window 2 (no bytes bound widening it): the later steps are read after the resize
    with Executor(stream_plan, dask_client, loaders_per_source={"web": 1, "code": 1}, bytes_in_flight=0) as ex:
        with StreamClient(stream_plan, 0) as stream:
            got = [next(stream) for _ in range(2 * meta.micro_batches)]
            assert ex.set_loaders("web", 3) == 3
            got += list(stream)
        m = ex.metrics()
        info_loaders = [lo for lo in ex.info.loaders if lo.source == "web"] if ex.info else []
    assert len(got) == meta.steps * meta.micro_batches
    for b in got:
        oracle.check(b)
    web = [lo.metrics for lo in m.loaders if lo.metrics.source == "web"]
    assert len(web) == 3 and len(info_loaders) == 3
    assert sum(lo.samples for lo in web) > 0  # the new loaders served the later steps


def test_serve_runs_until_sigterm_and_cleans_up(stream_plan: Path, loomtest: Any, tmp_path: Path) -> None:
    oracle = loomtest.Oracle(stream_plan)
    code = f"from loomdata.execution import serve; serve({str(stream_plan)!r}, json_out=True, metrics_every_s=1)"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["event"] == "serving" and first["plan_id"] == oracle.meta.plan_id
        assert first["scheduler"].startswith("tls://127.0.0.1:")
        assert (stream_plan / "serve.json").exists()
        with StreamClient(stream_plan, 1) as stream:  # finds the executor through serve.json
            n = sum(oracle.check(b) for b in stream)
        assert n > 0
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.strip().splitlines()]  # --json: stdout is JSON lines only
    assert {line["event"] for line in lines} <= {"metrics", "stopped"}
    last = lines[-1]
    assert last["event"] == "stopped"
    assert last["metrics"]["rank_wait_s"].keys() == {"0", "1"}
    assert last["metrics"]["loader_samples"] > 0
    assert not (stream_plan / "serve.json").exists() and not (stream_plan / "serve.lock").exists()
    assert read_plan(stream_plan).plan_id == oracle.meta.plan_id
    time.sleep(0)  # nothing left running: the process exited


def test_plan_larger_than_window_holds_at_most_window_steps(dask_client: Client, stream_plan: Path) -> None:
    meta = read_plan(stream_plan)
    with (
        Executor(stream_plan, dask_client, window=1, bytes_in_flight=0) as ex,
        StreamClient(stream_plan, 0, prefetch=0) as stream,
    ):
        next(stream)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            c = ex.metrics().constructors[0]
            if c.building_steps == 0:
                break
            time.sleep(0.05)
        # one step ahead for each of the 2 ranks, never more, whatever the plan length
        assert c.held_steps <= 2 and c.queue_depth <= 2 * meta.micro_batches


def test_ranks_sharing_a_constructor_share_its_bytes(dask_client: Client, stream_plan: Path) -> None:
    """The window the Executor serves with: `constructor_bytes` split among the ranks of one constructor (dp 2)."""
    meta = read_plan(stream_plan)
    step = step_bytes(meta.seq_len, meta.micro_batches)
    bounds = {"bytes_in_flight": 200 * step, "constructor_bytes": 300 * step}  # above the 64-step floor
    assert Executor(stream_plan, dask_client, constructors=1, **bounds).window == 150  # 2 ranks: 150 steps each
    assert Executor(stream_plan, dask_client, constructors=2, **bounds).window == 200  # a rank alone: its own bound
    assert Executor(stream_plan, dask_client, constructors=2, window=250, **bounds).window == 250  # the least


def test_a_corrupt_source_file_fails_the_rank_with_its_path(
    dask_client: Client, tmp_path_factory: pytest.TempPathFactory, loomtest: Any
) -> None:
    spec = loomtest.make_spec(tmp_path_factory.mktemp("corrupt"), steps=2)
    plan_dir = Path(loomtest.index_and_plan(spec, dask_client))
    victims = sorted((spec.workdir.parent / "data" / "web").glob("*.parquet"))
    for v in victims:
        v.write_bytes(b"PAR1 not parquet any more")
    with (
        Executor(plan_dir, dask_client),
        StreamClient(plan_dir, 0, retry_s=5) as stream,
        pytest.raises(SourceDataError, match=r"web/part-\d\.parquet: shard \d of source 'web': size 25 bytes") as e,
    ):
        list(stream)
    assert e.value.path in {str(v) for v in victims}  # the loader's error crossed the actors intact
