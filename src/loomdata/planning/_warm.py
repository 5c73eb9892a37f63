"""Warming a cluster's workers while the driver runs a plan's serial part (issue 11).

A worker's first range cost 10-20% more than the same steps in one process (session 32, docs/planning.md):
numba's once-per-process set-up and its kernels' loads (~0.4 CPU-s, session 30), and the other first uses of a
process (pyarrow's Parquet writer, the allocator's setting). The workers sit idle meanwhile: the driver reads the
index, builds the streams and works out membership first (3-4 CPU-s at 50M samples). `warm_workers`, called as a
cluster plan starts (before the index reads), sends each worker not warmed yet a task (planning._plan's, which calls
`warm` with `make_plan`: this module imports no planner) that tunes its allocator and plans a tiny synthetic index
through the cluster's own entry points (`make_plan` with an executor that runs its tasks in place: the ranges'
`window` and `plan_range`, the manifest writer, the report), so every kernel the ranges call is loaded before the
first range arrives.

It never delays or breaks the plan: fire-and-forget (its futures are held here until they end, never waited on),
every error caught and logged (a worker that cannot run it plans cold), at a lower priority than the ranges (a
Dask worker still queueing it when its first range arrives runs the range first), and once per worker process
(remembered by the driver per worker address, and by the worker itself; a process that has planned a range is
warm already). The plan is the same bytes either way: warming writes only into a temporary folder of its own.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np

from loomdata.planning._allocator import tune_allocator

__all__ = ["WARM_PRIORITY", "mark_warm", "warm", "warm_seconds", "warm_workers"]

log = logging.getLogger(__name__)

WARM_PRIORITY = -1
"""The warming task's Dask priority: below the ranges' (0), so a worker runs a range first if both wait."""

_LOCK = threading.Lock()
_WARM = threading.Event()  # set once this process is warm (warmed, or it has planned a range)
_SENT: set[str] = set()  # Dask worker addresses sent a warming task (driver side)
_POOLS: weakref.WeakSet[Any] = weakref.WeakSet()  # other executors sent their warming tasks (driver side)
_PENDING: dict[int, Any] = {}  # warming futures not ended yet, held so a Dask client does not forget their tasks
_SECONDS: list[float] = []  # the CPU seconds this process's warming took (empty: not warmed by `warm`)


def warm_workers(client: Any, task: Callable[[], float]) -> int:
    """Send every worker of `client` not warmed yet the warming `task` (one that calls `warm`); return how many were
    sent. A Dask
    client's workers get one each, pinned to it; a concurrent.futures pool one per worker it has, once per pool
    (each of its processes that runs one warms itself; a thread pool's threads are this process). Any other
    executor (whose workers are not known, the warming plan's own among them) gets none. Never raises."""
    try:
        info = getattr(client, "scheduler_info", None)
        if callable(info):
            todo = [a for a in sorted(info()["workers"]) if a not in _SENT]
            for a in todo:
                _hold(client.submit(task, pure=False, workers=[a], allow_other_workers=False, priority=WARM_PRIORITY))
                _SENT.add(a)
            return len(todo)
        if not isinstance(client, Executor) or client in _POOLS:
            return 0
        _POOLS.add(client)
        n = max(1, int(getattr(client, "_max_workers", 1)))
        for _ in range(n):
            _hold(client.submit(task))
        return n
    except Exception:  # warming is an optimisation: the plan goes on cold
        log.warning("could not send the planning workers their warming tasks", exc_info=True)
        return 0


def _hold(fut: Any) -> None:
    """Keep `fut` referenced until it ends (a Dask future dropped before its task runs lets the task go)."""
    key = id(fut)
    with _LOCK:
        _PENDING[key] = fut

    def done(_: Any) -> None:
        with _LOCK:
            _PENDING.pop(key, None)

    add = getattr(fut, "add_done_callback", None)
    if callable(add):
        add(done)


def mark_warm() -> None:
    """Note that this process is warm (it has planned a range): a warming task queued behind it does nothing."""
    _WARM.set()


def warm(make_plan: Callable[..., Any]) -> float:
    """Warm this process for planning ranges, once: its allocator tuned (tune_allocator) and a tiny synthetic plan
    made by `make_plan` (planning.make_plan) through the cluster path (every kernel a range calls loaded). Returns
    the CPU seconds it took (0 where the process was warm already); an error is logged, never raised."""
    with _LOCK:
        if _WARM.is_set():
            return 0.0
        _WARM.set()
    cpu = time.thread_time()
    try:
        tune_allocator()
        _tiny_plan(make_plan)
    except Exception:
        log.warning("warming this process for planning failed: its first range plans cold", exc_info=True)
    _SECONDS.append(time.thread_time() - cpu)
    return _SECONDS[-1]


def warm_seconds() -> float | None:
    """The CPU seconds `warm` took in this process, or None where it has not warmed it (benchmarks, tests)."""
    return _SECONDS[0] if _SECONDS else None


class _InPlace:
    """An executor that runs each task in place (what `make_plan` needs of one), with no workers of its own."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # (as a pool's future holds it)
            fut.set_exception(e)
        return fut


_TINY = (("web", 150_000, 3.0, 0.5), ("code", 4_000, 6.6, 1.2))
"""The warming plan's sources: (name, documents, lognormal mu and sigma of their tokens). Enough short documents
that one source draws more than 65,535 segments (the pointers' wide offsets, as in any plan a cluster pays for),
long ones among the other's (pieces split at the sequence length)."""
_TINY_TRAINING = {"seq_len": 4096, "steps": 4, "dp_size": 64, "micro_batches": 4}


def _tiny_plan(make_plan: Callable[..., Any]) -> None:
    """A plan (by `make_plan`) of a tiny synthetic text index written in a temporary folder (removed after) and
    read back as a plan reads one (dense sample ids, no image column), on an in-place executor: the ranges' window,
    balancing, manifest and report code all run once, with the array types of a large plan's."""
    from loomdata.schemas.layout import IndexFiles
    from loomdata.schemas.spec import parse_spec
    from loomdata.schemas.tables import TableKind, synthetic_index, synthetic_shards, write_table

    with tempfile.TemporaryDirectory(prefix="loom-warm-") as d:
        wd = Path(d)
        weights = {}
        for k, (name, n, mu, sigma) in enumerate(_TINY):
            lengths = np.clip(np.random.default_rng(k).lognormal(mu, sigma, n), 16, 100_000).astype(np.uint32)
            files = IndexFiles.of(wd, name)
            files.root.mkdir(parents=True)
            write_table(synthetic_index(lengths), files.samples, TableKind.INDEX, {"fingerprint": f"warm-{name}"})
            write_table(synthetic_shards(n), files.shards, TableKind.SHARDS)
            weights[name] = float(lengths.sum())
        spec = parse_spec(
            {
                "name": "warm",
                "workdir": str(wd),
                "sources": [{"name": s, "format": "parquet", "paths": ["none"], "tokens_field": "t"} for s in weights],
                "mixture": {"weights": weights},
                "training": _TINY_TRAINING,
            },
            wd,
            check_paths=False,
        )
        make_plan(spec, client=_InPlace())
