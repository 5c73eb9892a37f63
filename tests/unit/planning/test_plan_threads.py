"""planning._threads.per_source: threads only where the sources are large; the same results either way."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from loomdata.planning._plan import _index_bytes
from loomdata.planning._threads import PLAN_THREADS_ENV, THREAD_ROWS, per_source


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
