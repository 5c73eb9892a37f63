"""A SIGKILLed worker mid-stream: its actors are recreated, and every rank still gets exactly its manifest.

Each test runs its own LocalCluster (worker processes under nannies, which restart a killed worker)
since it kills a worker. Batches are checked three ways: the (step, micro_batch) sequence, the
multiset of (source, sample, offset, length) against the manifest (nothing lost, nothing
duplicated), and every token against an independent pyarrow read of the source files.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor, open_cluster
from loomdata.schemas import Batch, read_manifest

STEPS = 12
KILL_AT_STEP = 4
DEADLINE_S = 90.0


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


def _kill(client: Client, worker: str) -> float:
    """SIGKILL the process of `worker`; returns the wall time of the kill."""
    pid = client.run(os.getpid, workers=[worker])[worker]
    os.kill(pid, signal.SIGKILL)
    return time.time()


def _wait_recovered(ex: Executor, n: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while ex.recovery.recovered < n:
        if time.monotonic() > deadline:
            pytest.fail(f"only {ex.recovery.recovered} of {n} lost actors recreated: {ex.recovery}")
        time.sleep(0.05)


def _check_exact(plan_dir: Path, got: dict[int, list[Batch]], loomtest: Any) -> None:
    """Every rank's batches are the manifest's, each (source, sample, offset, length) once, tokens exact."""
    oracle = loomtest.Oracle(plan_dir)
    meta = oracle.meta
    for rank, batches in got.items():
        assert [(b.step, b.micro_batch, b.dp_rank) for b in batches] == [
            (s, m, rank) for s in range(meta.steps) for m in range(meta.micro_batches)
        ]
        man = read_manifest(plan_dir, meta, dp_ranks=[rank])
        cols = ("source", "sample", "offset", "length")
        want = Counter(zip(*(man.column(c).to_numpy().astype(int).tolist() for c in cols), strict=True))
        seen = Counter(
            tuple(int(x) for x in row) for b in batches for row in zip(*(b.segments[c] for c in cols), strict=True)
        )
        assert seen == want, f"rank {rank}: lost {want - seen}, duplicated {seen - want}"
        assert sum(oracle.check(b) for b in batches) == sum(n for (_, _, _, n), k in want.items() for _ in range(k))


def _stream_through_kill(client: Client, plan_dir: Path, ex: Executor, victim: str) -> dict[int, list[Batch]]:
    """Consume KILL_AT_STEP steps of each rank, kill `victim`, consume the rest (ranks interleaved)."""
    streams = {r: StreamClient(plan_dir, r, retry_s=DEADLINE_S) for r in (0, 1)}
    try:
        mbs = streams[0].meta.micro_batches
        got = {r: [next(s) for _ in range(KILL_AT_STEP * mbs)] for r, s in streams.items()}
        killed_at = _kill(client, victim)
        gap = 0.0
        for _ in range((STEPS - KILL_AT_STEP) * mbs):
            for r, s in streams.items():
                t0 = time.monotonic()
                got[r].append(next(s))
                gap = max(gap, time.monotonic() - t0)
        for s in streams.values():
            assert next(s, None) is None
    finally:
        for s in streams.values():
            s.close()
    _wait_recovered_after(ex, killed_at)
    print(f"\nworker kill: recreated after {ex.recovery.history[0][0] - killed_at:.2f}s, longest wait {gap:.2f}s")
    return got


def _wait_recovered_after(ex: Executor, killed_at: float) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ex.recovery.history:
        if time.monotonic() > deadline:
            pytest.fail(f"no lost actor recreated within {DEADLINE_S}s: {ex.recovery}")
        time.sleep(0.05)
    assert ex.recovery.history[0][0] >= killed_at - 1.0


def test_killed_worker_with_a_constructor_and_loaders_loses_nothing(
    killable_client: Client, tmp_path: Path, loomtest: Any
) -> None:
    plan_dir = _plan(killable_client, tmp_path, loomtest)
    with Executor(plan_dir, killable_client, constructors=2, loaders_per_source=2) as ex:
        assert ex.info is not None
        before = ex.info
        victim = next(c.worker for c in before.constructors if 0 in c.ranks)
        n_cons, n_loaders = _actors_on(before, victim)
        assert n_cons == 1 and n_loaders >= 1, f"placement changed: {before}"
        got = _stream_through_kill(killable_client, plan_dir, ex, victim)
        _wait_recovered(ex, n_cons + n_loaders)
        after = ex.info
        m = ex.metrics()
    assert ex.recovery.recovered == n_cons + n_loaders  # the actors on the victim, nothing else
    assert victim not in {c.worker for c in after.constructors} | {lo.worker for lo in after.loaders}
    assert m["recovered_actors"] == n_cons + n_loaders
    recreated = next(c for c in m["constructors"] if 0 in c["ranks"])
    assert recreated["rank_takes"]["0"] > 0  # rank 0's later steps came from the recreated constructor
    _check_exact(plan_dir, got, loomtest)


def test_killed_loader_only_worker_is_recovered(killable_client: Client, tmp_path: Path, loomtest: Any) -> None:
    plan_dir = _plan(killable_client, tmp_path, loomtest)
    with Executor(plan_dir, killable_client, constructors=2, loaders_per_source=2) as ex:
        assert ex.info is not None
        before = ex.info
        victims = [lo.worker for lo in before.loaders if _actors_on(before, lo.worker)[0] == 0]
        assert victims, f"no worker holds only loaders: {before}"
        victim = victims[0]
        n_loaders = _actors_on(before, victim)[1]
        got = _stream_through_kill(killable_client, plan_dir, ex, victim)
        _wait_recovered(ex, n_loaders)
        after = ex.info
        m = ex.metrics()
    assert ex.recovery.recovered == n_loaders
    assert [c.worker for c in after.constructors] == [c.worker for c in before.constructors]  # untouched
    recreated = {(lo.source, lo.part) for lo in after.loaders if lo.name not in {b.name for b in before.loaders}}
    assert len(recreated) == n_loaders and victim not in {lo.worker for lo in after.loaders}
    assert sum(lo["samples"] for lo in m["loaders"] if (lo["source"], lo["part"]) in recreated) > 0
    _check_exact(plan_dir, got, loomtest)
