"""Autoscaling on a real LocalCluster: loaders follow a mixture schedule that switches the heavy source.

Consumers pause inside each phase until the controller has moved loaders towards that phase's heavy
source (polled with a deadline, no timing asserts), and every rank still gets exactly its manifest's
segments, counted one by one, while loaders are replaced under it.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from loomdata.execution import Executor
from loomdata.execution._autoscale import Autoscaling
from loomdata.execution.protocol import read_serve_info
from loomdata.schemas import read_manifest
from loomtest.stream import SEGMENT_COLUMNS as SEGMENT
from loomtest.stream import switching_plan as make_switching_plan

STEPS = 40
SWITCH = 20  # web is heavy before, code after


@pytest.fixture(scope="module")
def switching_plan(dask_client: Client, tmp_path_factory: pytest.TempPathFactory, loomtest: Any) -> Path:
    """Two pre-tokenized sources of 8 shards each; the mixture switches from 90% web to 90% code."""
    tmp = tmp_path_factory.mktemp("autoscale")
    return Path(
        make_switching_plan(dask_client, tmp, steps=STEPS, switch=SWITCH, n_files=8, rows=40, seed=11, plan_seed=3)
    )


def _loaders(ex: Executor) -> dict[str, int]:
    return {s: v.loaders for s, v in ex.metrics().sources.items()}


def _wait_for(ex: Executor, want: dict[str, int], deadline_s: float = 60.0) -> None:
    """Poll until the loader counts are `want`; fail with the controller's state at the deadline (a liveness
    bound, not a timing target: in a full CI run on 2 cores a resize once took over 20 s, reaching its counts
    just after a 20 s deadline)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if _loaders(ex) == want:
            return
        time.sleep(0.2)
    pytest.fail(f"loaders never reached {want}: {_loaders(ex)}; autoscale {ex.metrics().autoscale}")


def test_loaders_follow_the_schedule_and_batches_stay_exact(
    dask_client: Client, switching_plan: Path, loomtest: Any
) -> None:
    oracle = loomtest.Oracle(switching_plan)
    meta = oracle.meta
    settings = Autoscaling(every_s=0.3, horizon_steps=6, budget=4)
    got: collections.Counter[tuple[int, ...]] = collections.Counter()
    with Executor(switching_plan, dask_client, loaders_per_source=1, autoscale=settings) as ex:
        assert _loaders(ex) == {"web": 1, "code": 1}
        info = read_serve_info(switching_plan)
        with dask_client.as_current():
            actor = dask_client.get_dataset(info.constructors[0].name)

            def take(steps: range) -> None:
                for step in steps:
                    for r in range(meta.dp_size):
                        for b in actor.take(r, step).result():
                            oracle.check(b)
                            segs = zip(*(b.segments[c].tolist() for c in SEGMENT), strict=True)
                            got.update((r, step, b.micro_batch, *seg) for seg in segs)

            take(range(0, 6))
            _wait_for(ex, {"web": 3, "code": 1})  # budget 4: all but one for the heavy source
            take(range(6, SWITCH + 6))
            _wait_for(ex, {"web": 1, "code": 3})
            take(range(SWITCH + 6, STEPS))
        report = ex.metrics().autoscale
    want = read_manifest(switching_plan, meta)
    cols = [want.column(c).to_pylist() for c in ("dp_rank", "step", "micro_batch", *SEGMENT)]
    expected = collections.Counter(tuple(row) for row in zip(*cols, strict=True))
    assert got == expected  # every segment exactly once per rank, while loaders were replaced
    grew = {d.source for d in report.decisions if d.new > d.old}
    shrank = {d.source for d in report.decisions if d.new < d.old}
    assert grew == {"web", "code"} and "web" in shrank  # web grew before the switch, code after
    assert all(d.why and d.time > 0 and d.step >= 0 for d in report.decisions)
    assert report.rounds >= len(report.decisions) and report.last is not None and report.last.budget == 4
