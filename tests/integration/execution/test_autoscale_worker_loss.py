"""Autoscaling and worker-loss recovery together: resizes during a loss, a loss during resizes, exact streams.

Each test runs its own cluster of worker processes under nannies (a SIGKILLed worker is restarted),
with Dask's local directory in the test's tmp dir. The mixture switches the heavy source mid-plan, so
the controller (every 0.2 s) keeps resizing while workers are killed and the watchdog recreates
actors; every rank's batches are then counted (source, sample, offset, length) against the manifest
and every token checked by the independent oracle. No timing asserts: everything waits by polling
with a deadline.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor, open_cluster
from loomdata.execution._autoscale import Autoscaling
from loomdata.schemas import AutoscaleDecision, Batch
from loomtest.stream import check_exact, kill_worker, switching_plan

STEPS = 24
SWITCH = 12  # web is heavy before, code after
DEADLINE_S = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Client]:
    """Three worker processes under nannies, Dask scratch in tmp."""
    with open_cluster(n_workers=3, local_directory=tmp_path / "dask") as client:
        yield client


def _poll(ok: Callable[[], bool], what: str, ex: Executor) -> None:
    end = time.monotonic() + DEADLINE_S
    while not ok():
        if time.monotonic() > end:
            pytest.fail(f"{what} never happened: recovery {ex.recovery}, autoscale {ex.metrics().autoscale}")
        time.sleep(0.05)


def _decisions(ex: Executor) -> list[AutoscaleDecision]:
    return list(ex.metrics().autoscale.decisions)


def test_autoscaling_through_worker_kills_loses_nothing(cluster: Client, tmp_path: Path, loomtest: Any) -> None:
    """Kill a constructor's worker and resize at once (resize during the loss), then kill the busiest
    loader worker right after the switch while the controller moves loaders to code (loss during resizes)."""
    plan_dir = switching_plan(cluster, tmp_path, steps=STEPS, switch=SWITCH, n_files=6, rows=32, seed=21, plan_seed=5)
    # This test is about resizes during worker loss, not about the autoscaler's stability rules: let every
    # round act on what it measured (no minimum sample count, no minimum time between resizes).
    settings = Autoscaling(
        every_s=0.2,
        horizon_steps=4,
        budget=4,
        min_samples=1,
        min_busy_s=0.0,
        source_interval_s=0.0,
        resize_interval_s=0.0,
    )
    bulk = {"window": 4, "bytes_in_flight": 0}  # 2 steps per call; later steps still read after each resize
    with Executor(plan_dir, cluster, constructors=2, loaders_per_source=1, autoscale=settings, **bulk) as ex:
        streams = {r: StreamClient(plan_dir, r, retry_s=DEADLINE_S) for r in (0, 1)}
        got: dict[int, list[Batch]] = {r: [] for r in streams}
        kills = 0
        try:
            for step in range(STEPS):
                if step == 3:  # web is heavy: wait for the controller to have grown it, then kill and resize
                    _poll(lambda: ex.loader_counts()["web"] > 1, "web growing", ex)
                    assert ex.info is not None
                    kill_worker(cluster, ex.info.constructor_for(0).worker)
                    kills += 1
                    ex.set_loaders("code", 3)  # queued behind the loop's recovery step: either order must hold
                if step == SWITCH + 1:  # code is heavy: kill the worker with the most loaders mid-resizing
                    _poll(lambda: ex.loader_counts()["code"] > 1, "code growing", ex)
                    assert ex.info is not None
                    by_worker = Counter(lo.worker for lo in ex.info.loaders)
                    kill_worker(cluster, by_worker.most_common(1)[0][0])
                    kills += 1
                for _ in range(streams[0].meta.micro_batches):
                    for r, s in streams.items():
                        got[r].append(next(s))
            for s in streams.values():
                assert next(s, None) is None
        finally:
            for s in streams.values():
                s.close()
        _poll(lambda: ex.recovery.rounds >= 1, "recovery", ex)
        decisions = _decisions(ex)
        retries = sum(c.read_retries for c in ex.metrics().constructors)
        print(f"\n{len(decisions)} resizes, {ex.recovery.recovered} actors recreated, {retries} read retries")
        counts = ex.loader_counts()
        info = ex.info
    assert kills == 2 and ex.recovery.recovered >= 2
    # the controller grew web (polled above); code grew by the queued set_loaders and, when its measured
    # cost calls for it, by the controller too (with read-ahead its reads may be cheap enough not to)
    assert "web" in {d.source for d in decisions if d.new > d.old}
    assert info is not None and sum(counts.values()) == len(info.loaders)
    check_exact(plan_dir, got)


def test_resize_with_a_dead_constructor_then_recover(cluster: Client, tmp_path: Path, loomtest: Any) -> None:
    """Recovery off, so each interleaving is forced: `set_loaders` after a constructor's worker died, and
    a worker dying inside `set_loaders` (after its loaders exist, before re-routing); both succeed,
    `recover()` recreates what was lost with the new routes, and both ranks still stream exactly."""
    plan_dir = switching_plan(cluster, tmp_path, steps=STEPS, switch=SWITCH, n_files=6, rows=32, seed=21, plan_seed=5)
    with Executor(plan_dir, cluster, constructors=2, loaders_per_source=1, recover=False) as ex:
        streams = {r: StreamClient(plan_dir, r, retry_s=DEADLINE_S) for r in (0, 1)}
        got: dict[int, list[Batch]] = {r: [] for r in streams}
        try:
            for step in range(STEPS):
                if step == 2:
                    assert ex.info is not None
                    dead = ex.info.constructor_for(1).worker
                    kill_worker(cluster, dead)
                    _poll(lambda: ex._ops.fleet.constructors[1].lost, "loss noticed", ex)
                    assert ex.set_loaders("web", 3) == 3
                    assert ex.set_loaders("code", 2) == 2
                    assert ex.recover() >= 1
                    assert ex.info is not None and dead not in {c.worker for c in ex.info.constructors}
                if step == 5:  # a loss during a resize: the worker dies after the new loaders exist
                    created = ex._ops.await_loaders

                    def create_then_kill(parts: Any, futs: Any, created: Any = created) -> Any:
                        handles = created(parts, futs)
                        assert ex.info is not None
                        kill_worker(cluster, ex.info.constructor_for(0).worker)
                        _poll(lambda: ex._ops.fleet.constructors[0].lost, "loss noticed", ex)
                        return handles

                    ex._ops.await_loaders = create_then_kill  # type: ignore[method-assign]
                    assert ex.set_loaders("code", 2) == 2  # routes the survivor, skips the dead constructor
                    ex._ops.await_loaders = created  # type: ignore[method-assign]
                    assert ex.recover() >= 1
                for _ in range(streams[0].meta.micro_batches):
                    for r, s in streams.items():
                        got[r].append(next(s))
        finally:
            for s in streams.values():
                s.close()
        assert ex.loader_counts() == {"web": 3, "code": 2}
    check_exact(plan_dir, got)
