"""planning._threads.per_source: threads only where the sources are large; the same results either way."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from loomdata.planning import _plan, make_plan
from loomdata.planning._plan import _index_bytes
from loomdata.planning._threads import PLAN_THREADS_ENV, THREAD_ROWS, per_source
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.tables import SHARDS_SCHEMA, TableKind, write_table
from loomtest.golden_plans import plan_hashes

T = TypeVar("T")


def _where(k: int) -> tuple[int, str]:
    return k * k, threading.current_thread().name


def test_small_sources_stay_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLAN_THREADS_ENV, "2")
    got = per_source(_where, 6, [THREAD_ROWS - 1] * 6)
    assert [v for v, _ in got] == [k * k for k in range(6)]
    assert {name for _, name in got} == {threading.current_thread().name}


def test_large_sources_run_on_the_planning_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLAN_THREADS_ENV, "2")
    sizes = [0, 2 * THREAD_ROWS]  # the mean decides: one empty source beside a large one
    got = per_source(_where, 2, sizes)
    assert [v for v, _ in got] == [0, 1]
    assert all(name.startswith("loom-plan") for _, name in got)
    assert all(name.startswith("loom-plan") for _, name in per_source(_where, 2))  # no sizes: threads as before


def test_one_thread_when_capped_whatever_the_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLAN_THREADS_ENV, "1")
    got = per_source(_where, 3, [10 * THREAD_ROWS] * 3)
    assert {name for _, name in got} == {threading.current_thread().name}


def test_the_first_source_s_error_is_raised_on_either_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLAN_THREADS_ENV, "2")

    def fails(k: int) -> int:
        if k in (1, 2):
            raise ValueError(f"source {k}")
        return k

    for sizes in ([1] * 4, [THREAD_ROWS] * 4):
        with pytest.raises(ValueError, match="source 1"):
            per_source(fails, 4, sizes)


def test_index_bytes_are_the_samples_tables_sizes_and_zero_where_missing(tmp_path: Path) -> None:
    table = tmp_path / "index" / "web" / "samples.parquet"
    table.parent.mkdir(parents=True)
    table.write_bytes(b"x" * 1234)
    assert _index_bytes(tmp_path, ["web", "absent"]) == [1234, 0]


@pytest.mark.parametrize("on_threads", [False, True])
def test_a_plan_is_the_same_on_threads_or_not(
    on_threads: bool, tmp_path: Path, spec_of: Callable[..., Any], index_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size rule only moves work between threads: three sources read from their index files and streamed, every
    per-source phase on the planning threads (the rule overridden) or on the calling thread (the rule as it is, these
    sources being small), plan to the same plan id and manifest and report contents as one thread does."""
    used: list[str] = []
    original = per_source

    def forced(fn: Callable[[int], T], n: int, sizes: Any = None, large: int = THREAD_ROWS) -> list[T]:
        def where(k: int) -> T:
            used.append(threading.current_thread().name)
            return fn(k)

        return original(where, n, None if on_threads else sizes, large)

    def plan(workdir: Path) -> tuple[str, dict[str, str]]:
        rng = np.random.default_rng(3)
        for name, n in (("web", 4000), ("code", 1500), ("math", 700)):
            files = IndexFiles.of(workdir, name)
            lengths = np.clip(rng.lognormal(4.5, 1.0, n), 1, 2000).astype(np.int64)
            write_table(index_of(lengths), files.samples, TableKind.INDEX, {"fingerprint": f"fp-{name}"})
            write_table(SHARDS_SCHEMA.empty_table(), files.shards, TableKind.SHARDS)
        weights = {"web": 3, "code": 2, "math": 1}
        spec = spec_of(workdir, list(weights), weights=weights, steps=40, dp=4, micro_batches=2)
        res = make_plan(spec)
        return res.meta.plan_id, plan_hashes(res.plan_dir)

    monkeypatch.setenv(PLAN_THREADS_ENV, "1")
    alone = plan(tmp_path / "one")
    monkeypatch.setenv(PLAN_THREADS_ENV, "2")
    monkeypatch.setattr(_plan, "per_source", forced)
    assert plan(tmp_path / "two") == alone
    threads = {name.startswith("loom-plan") for name in used}
    assert threads == {on_threads} and len(used) >= 6  # index reads and streams, three sources each


def test_numba_is_set_up_on_a_thread_of_its_own_once() -> None:
    """planning._jit.warm_up starts one thread (never a second) that sets numba up; a kernel called meanwhile
    still runs (it waits for numba's compiler lock, if it must)."""
    from loomdata.planning import _jit

    _jit.warm_up()
    _jit.warm_up()
    assert len(_jit._WARMED) == 1
    assert _jit.stable_argsort(np.array([3.0, 1.0, 2.0])).tolist() == [1, 2, 0]
    _jit._WARMED[0].join(timeout=60)
    assert not _jit._WARMED[0].is_alive()


def test_parts_on_threads_run_at_most_the_plan_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """_threads.parallel from several callers at once (per_source's threads, each with a large source): the tasks
    all run, in order of their results, but never more than plan_threads() of them at the same time."""
    import time

    from loomdata.planning import _threads

    monkeypatch.setenv(PLAN_THREADS_ENV, "2")
    monkeypatch.setattr(_threads, "_SLOTS", [])
    running, most = [0], [0]
    lock = threading.Lock()

    def task(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        end = time.perf_counter() + 0.02  # (busy: unit tests do not sleep) long enough for the others to start
        while time.perf_counter() < end:
            pass
        with lock:
            running[0] -= 1
        return i

    def caller(k: int) -> list[int]:
        return _threads.parallel([lambda i=i: task(10 * k + i) for i in range(3)])

    out = per_source(caller, 4)  # 4 callers on (up to) 2 threads, each asking for 3 parts
    assert out == [[10 * k + i for i in range(3)] for k in range(4)]
    assert most[0] == 2
