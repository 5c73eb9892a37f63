"""A SIGKILLed worker mid-stream: its actors are recreated, and every rank still gets exactly its manifest.

Each test runs its own cluster (worker processes under nannies, which restart a killed worker) since
it kills a worker: an Executor in the test process, or `serve` in a process of its own. Batches are
checked three ways: the (step, micro_batch) sequence, the multiset of (source, sample, offset,
length) against the manifest (nothing lost, nothing duplicated), and every token against an
independent pyarrow read of the source files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor, open_cluster
from loomdata.execution.protocol import ServeInfo, client_security
from loomdata.schemas import Batch
from loomtest.stream import check_exact, kill_worker

STEPS = 12
KILL_AT_STEP = 4
DEADLINE_S = 90.0
BULK = {"window": 4, "bytes_in_flight": 0}  # 2 steps per call, and steps left to take from recreated actors


@pytest.fixture
def killable_client(tmp_path: Path) -> Iterator[Client]:
    """`loom serve`'s embedded cluster with three worker processes (nannies restart a killed one)."""
    with open_cluster(n_workers=3, local_directory=tmp_path / "dask") as client:
        yield client


def _plan(client: Client, tmp_path: Path, loomtest: Any) -> Path:
    spec = loomtest.make_spec(tmp_path / "plan", steps=STEPS, dp_size=2)
    return Path(loomtest.index_and_plan(spec, client))


def _actors_on(info: Any, worker: str) -> tuple[int, int]:
    """(constructors, loaders) that live on `worker` according to the executor's ServeInfo."""
    return (
        sum(c.worker == worker for c in info.constructors),
        sum(lo.worker == worker for lo in info.loaders),
    )


def _wait_recovered(ex: Executor, n: int) -> None:
    """Poll (with a deadline) until the executor has recreated `n` actors in all."""
    deadline = time.monotonic() + DEADLINE_S
    while ex.recovery.recovered < n:
        if time.monotonic() > deadline:
            pytest.fail(f"only {ex.recovery.recovered} of {n} lost actors recreated: {ex.recovery}")
        time.sleep(0.05)


def _stream_through_kills(
    client: Client, plan_dir: Path, ex: Executor, kills: dict[int, Callable[[ServeInfo], str]]
) -> tuple[dict[int, list[Batch]], int]:
    """Consume both ranks to the end, interleaved; before step k, SIGKILL the worker `kills[k]` picks.

    Returns the batches and how many actors the killed workers held. Each pick sees the ServeInfo
    of its moment (earlier kills recovered from).
    """
    streams = {r: StreamClient(plan_dir, r, retry_s=DEADLINE_S) for r in (0, 1)}
    got: dict[int, list[Batch]] = {r: [] for r in streams}
    lost = 0
    gap = killed_at = 0.0
    try:
        for step in range(STEPS):
            if step in kills:
                _wait_recovered(ex, lost)
                assert ex.info is not None
                victim = kills[step](ex.info)
                lost += sum(_actors_on(ex.info, victim))
                killed_at = kill_worker(client, victim)
            for _ in range(streams[0].meta.micro_batches):
                for r, s in streams.items():
                    t0 = time.monotonic()
                    got[r].append(next(s))
                    gap = max(gap, time.monotonic() - t0)
        for s in streams.values():
            assert next(s, None) is None
    finally:
        for s in streams.values():
            s.close()
    _wait_recovered(ex, lost)
    print(f"\nworker kill: recreated after {ex.recovery.history[-1][0] - killed_at:.2f}s, longest wait {gap:.2f}s")
    return got, lost


def _constructor_worker(rank: int) -> Callable[[ServeInfo], str]:
    """Picks the worker of the constructor serving `rank`."""
    return lambda info: info.constructor_for(rank).worker


def _loader_only_worker(info: ServeInfo) -> str:
    """Picks a worker that holds loaders and no constructor."""
    workers = [lo.worker for lo in info.loaders if _actors_on(info, lo.worker)[0] == 0]
    if not workers:
        pytest.fail(f"no worker holds only loaders: {info}")
    return workers[0]


def test_killed_worker_with_a_constructor_and_loaders_loses_nothing(
    killable_client: Client, tmp_path: Path, loomtest: Any
) -> None:
    plan_dir = _plan(killable_client, tmp_path, loomtest)
    with Executor(plan_dir, killable_client, constructors=2, loaders_per_source=2, **BULK) as ex:
        assert ex.info is not None
        victim = ex.info.constructor_for(0).worker
        assert _actors_on(ex.info, victim)[1] >= 1, f"placement changed: {ex.info}"  # loaders die with it too
        got, lost = _stream_through_kills(killable_client, plan_dir, ex, {KILL_AT_STEP: _constructor_worker(0)})
        after = ex.info
        m = ex.metrics()
    assert ex.recovery.recovered == lost >= 2  # the actors on the victim, nothing else
    assert victim not in {c.worker for c in after.constructors} | {lo.worker for lo in after.loaders}
    assert m.recovery.recovered == lost and m.to_dict()["recovered_actors"] == lost
    recreated = next(c for c in m.constructors if 0 in c.ranks)
    assert recreated.rank_takes[0] > 0  # rank 0's later steps came from the recreated constructor
    check_exact(plan_dir, got)


def test_killed_loader_only_worker_is_recovered(killable_client: Client, tmp_path: Path, loomtest: Any) -> None:
    plan_dir = _plan(killable_client, tmp_path, loomtest)
    with Executor(plan_dir, killable_client, constructors=2, loaders_per_source=2, **BULK) as ex:
        assert ex.info is not None
        before = ex.info
        victim = _loader_only_worker(before)
        seen = []  # the metrics just before the kill: what the lost loaders last answered

        def pick(info: ServeInfo) -> str:
            seen.append(ex.metrics())
            return _loader_only_worker(info)

        got, lost = _stream_through_kills(killable_client, plan_dir, ex, {KILL_AT_STEP: pick})
        after = ex.info
        m = ex.metrics()
    assert ex.recovery.recovered == lost >= 1
    # the lost loaders' counters stay in their sources' totals (their last answer: a lost loader cannot answer)
    assert sum(r.loaders for r in m.retired.values()) == lost and all(r.unanswered == 0 for r in m.retired.values())
    assert all(m.sources[s].tokens >= v.tokens and m.sources[s].busy_s >= v.busy_s for s, v in seen[0].sources.items())
    assert [c.worker for c in after.constructors] == [c.worker for c in before.constructors]  # untouched
    recreated = {(lo.source, lo.part) for lo in after.loaders if lo.name not in {b.name for b in before.loaders}}
    assert len(recreated) == lost and victim not in {lo.worker for lo in after.loaders}
    assert sum(lo.metrics.samples for lo in m.loaders if (lo.metrics.source, lo.metrics.part) in recreated) > 0
    check_exact(plan_dir, got)


def test_two_workers_killed_in_turn_lose_nothing(killable_client: Client, tmp_path: Path, loomtest: Any) -> None:
    """Rank 0's constructor's worker dies, then (after recovery) rank 1's: both recreated, twice exact."""
    plan_dir = _plan(killable_client, tmp_path, loomtest)
    kills = {3: _constructor_worker(0), 7: _constructor_worker(1)}
    with Executor(plan_dir, killable_client, constructors=2, loaders_per_source=2, **BULK) as ex:
        got, lost = _stream_through_kills(killable_client, plan_dir, ex, kills)
        rounds = ex.recovery.rounds
    assert ex.recovery.recovered == lost >= 2 and rounds >= 2
    check_exact(plan_dir, got)


def test_loom_serve_recovers_from_a_killed_worker(tmp_path: Path, loomtest: Any) -> None:
    """The real serving path: `serve` in its own process (embedded cluster, metrics every 0.3 s) survives a kill."""
    with open_cluster(n_workers=2, local_directory=tmp_path / "index-dask") as client:
        plan_dir = _plan(client, tmp_path, loomtest)
    code = (
        "from loomdata.execution import serve\n"
        "if __name__ == '__main__':\n"
        f"    serve({str(plan_dir)!r}, json_out=True, metrics_every_s=0.3, n_workers=2, constructors=2,"
        " loaders_per_source=2, window=4, bytes_in_flight=0)\n"
    )
    script = tmp_path / "serve.py"
    script.write_text(code)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        info = ServeInfo.model_validate({k: v for k, v in json.loads(proc.stdout.readline()).items() if k != "event"})
        victim = info.constructor_for(0).worker
        streams = {r: StreamClient(plan_dir, r, retry_s=DEADLINE_S) for r in (0, 1)}
        try:
            mbs = streams[0].meta.micro_batches
            got = {r: [next(s) for _ in range(KILL_AT_STEP * mbs)] for r, s in streams.items()}
            security = client_security(info.scheduler, info.tls, plan_id=info.plan_id)
            with Client(info.scheduler, timeout=30, security=security) as c:
                kill_worker(c, victim)
            for r, s in streams.items():
                got[r].extend(s)
        finally:
            for s in streams.values():
                s.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert lines[-1]["event"] == "stopped" and lines[-1]["metrics"]["recovered_actors"] >= 2
    assert lines[-1]["metrics"]["autoscale"]["enabled"] is True  # serve autoscales by default
    assert all("recovered_actors" in line for line in lines if line["event"] == "metrics")
    check_exact(plan_dir, got)
