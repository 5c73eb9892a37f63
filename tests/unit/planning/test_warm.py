"""Warming a cluster's workers (planning._warm): once per process, never an error, the plan the same bytes."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from loomdata.planning import _plan as plan_module
from loomdata.planning import _warm as warm_module
from loomdata.planning import make_plan
from loomtest.golden_plans import CASES


@pytest.fixture
def cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as if never warmed, and the driver's memory of warmed workers and pools empty."""
    monkeypatch.setattr(warm_module, "_WARM", threading.Event())
    monkeypatch.setattr(warm_module, "_SECONDS", [])
    monkeypatch.setattr(warm_module, "_SENT", set())
    monkeypatch.setattr(warm_module, "_POOLS", type(warm_module._POOLS)())


def _files(plan_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(plan_dir).as_posix(): p.read_bytes() for p in sorted(plan_dir.rglob("*")) if p.is_file()}


@pytest.mark.usefixtures("cold")
def test_a_process_is_warmed_once_by_a_tiny_real_plan() -> None:
    assert warm_module.warm_seconds() is None
    assert warm_module.warm(make_plan) > 0
    first = warm_module.warm_seconds()
    assert first is not None and first > 0
    assert warm_module.warm(make_plan) == 0.0 and warm_module.warm_seconds() == first  # warm already: nothing done


@pytest.mark.usefixtures("cold")
def test_a_process_that_has_planned_a_range_is_not_warmed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(warm_module, "_tiny_plan", lambda make_plan: calls.append(1))
    warm_module.mark_warm()
    assert warm_module.warm(make_plan) == 0.0 and calls == [] and warm_module.warm_seconds() is None


@pytest.mark.usefixtures("cold")
def test_a_failed_warming_is_logged_and_the_plan_through_a_pool_is_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(make_plan: Any) -> None:
        raise OSError("no room")

    monkeypatch.setattr(warm_module, "_tiny_plan", broken)
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    single = make_plan(spec, index=index, **kw).plan_dir
    want = _files(single.rename(single.with_name("single")))
    with caplog.at_level(logging.WARNING, logger=warm_module.__name__), ThreadPoolExecutor(2) as pool:
        spec, index, kw = CASES["web4k_dp8"](tmp_path)
        got = _files(make_plan(spec, index=index, client=pool, **kw).plan_dir)
        assert warm_module.warm_workers(pool, plan_module._warm_task) == 0  # this pool was sent its warming tasks once
    assert got == want
    assert any("warming this process for planning failed" in r.message for r in caplog.records)


@pytest.mark.usefixtures("cold")
def test_warming_is_sent_once_per_pool_and_never_to_unknown_executors_or_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(warm_module, "_tiny_plan", lambda make_plan: None)
    with ThreadPoolExecutor(3) as pool:
        assert warm_module.warm_workers(pool, plan_module._warm_task) == 3
        assert warm_module.warm_workers(pool, plan_module._warm_task) == 0

    class Duck:  # an executor of unknown workers (the tests' own pools, the warming plan's in-place one)
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("nothing is sent")

    assert warm_module.warm_workers(Duck(), plan_module._warm_task) == 0

    class Broken:  # a Dask-like client that cannot be asked for its workers
        def scheduler_info(self) -> dict[str, Any]:
            raise OSError("scheduler gone")

    assert warm_module.warm_workers(Broken(), plan_module._warm_task) == 0
