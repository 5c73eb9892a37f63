"""Where a process was when it stalled: event-loop lags, GC pauses and the stacks seen during them.

A benchmark tool (never imported by loomdata), started in each Dask worker and the serving process with
`client.run(_stall_trace.start)` / in-process `start()`, read back with `stop()`:

- loop lags: a callback on the process's event loop (the Dask worker's; none in a plain process) beats
  every 5 ms; a watchdog thread checks every 5 ms and, while the last beat is older than `lag_s`,
  samples the stacks of every busy thread (the loop's first), so a lag comes back with what ran;
- GC pauses: `gc.callbacks` time every collection, kept when over `gc_s`, with its generation;
- serving events (`patch=True`): each constructor take (what `take_block` calls: rank, first step, steps answered),
  build group (`_build_many`: steps, manifest / loaders / pack seconds) and loader read (`read`: segments,
  tokens), as (start, seconds, what) in this process; and, timed in whichever thread runs them (kept from
  5 ms), a loader's synchronous read (`read_now`), its foreground planning (`ahead`), each chunk planned
  (`_plan_chunk`), shard opens (`_open_shards`, `open_shard`), waits for shards opening (`ShardOpens.wait`)
  and waits of a read on a unit in flight (`Prefetcher.get`), and row groups decoded (`_decode_row_group`: in
  a strand thread, a read fetching a unit itself), where the loomdata measured has them;
- everything in wall-clock seconds (`time.time()`), so the consumers' gaps line up with it.
"""

from __future__ import annotations

import collections
import gc
import sys
import threading
import time
from typing import Any

_IDLE = ("select", "poll", "epoll", "wait", "sleep", "acquire", "_worker", "get", "_recv_into", "recv_into")
_IDLE_FILES = ("selectors.py", "threading.py", "queue.py", "thread.py", "connection.py")


def _stack(frame: Any, depth: int = 14) -> str:
    out = []
    while frame is not None and len(out) < depth:
        c = frame.f_code
        out.append(f"{c.co_filename.rsplit('/', 2)[-1]}:{c.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(out)


def _idle(frame: Any) -> bool:
    c = frame.f_code
    return c.co_name in _IDLE and c.co_filename.endswith(_IDLE_FILES)


class Tracer:
    """Loop lags with the stacks sampled during them, and GC pauses, of this process."""

    def __init__(self, lag_s: float = 0.05, gc_s: float = 0.01) -> None:
        self.lag_s, self.gc_s = lag_s, gc_s
        self.events: list[tuple[float, float, str, Any]] = []  # (start, seconds, kind, detail)
        self.lags: list[dict[str, Any]] = []
        self.gcs: list[tuple[float, float, int, int]] = []  # (start, seconds, generation, collected)
        self._beat = time.time()
        self._loop: Any = None
        self._loop_tid: int | None = None
        self._stop = threading.Event()
        self._gc_t0 = 0.0
        self._thread = threading.Thread(target=self._watch, name="stall-trace", daemon=True)

    def start(self) -> Tracer:
        import asyncio

        gc.callbacks.append(self._gc)
        try:
            from distributed import get_worker

            self._loop = get_worker().loop.asyncio_loop
        except (ImportError, ValueError):
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                self._loop = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._first_beat)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=2)
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        _unpatch()
        return {
            "lags": self.lags,
            "gcs": self.gcs,
            "events": self.events,
            "gc_counts": gc.get_count(),
            "gc_threshold": gc.get_threshold(),
        }

    def _first_beat(self) -> None:
        self._loop_tid = threading.get_ident()
        self._tick()

    def _tick(self) -> None:
        self._beat = time.time()
        if not self._stop.is_set():
            self._loop.call_later(0.005, self._tick)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_t0 = now
        elif (took := now - self._gc_t0) >= self.gc_s:
            self.gcs.append((time.time() - took, took, info["generation"], info["collected"]))

    def _watch(self) -> None:
        me = threading.get_ident()
        lag: dict[str, Any] | None = None
        stacks: collections.Counter[str] = collections.Counter()
        while not self._stop.is_set():
            time.sleep(0.005)
            if self._loop is None:
                continue
            now = time.time()
            age = now - self._beat
            if age > self.lag_s:
                if lag is None:
                    lag = {"start": self._beat, "samples": 0}
                    stacks = collections.Counter()
                lag["samples"] += 1
                for tid, frame in sys._current_frames().items():
                    if tid == me or (_idle(frame) and tid != self._loop_tid):
                        continue
                    who = "loop" if tid == self._loop_tid else "thread"
                    stacks[f"{who}: {_stack(frame)}"] += 1
            elif lag is not None:
                lag["seconds"] = round(self._beat - lag["start"], 4)
                lag["stacks"] = stacks.most_common(6)
                self.lags.append(lag)
                lag = None


_ACTIVE: dict[str, Tracer] = {}
_PATCHED: list[tuple[Any, str, Any]] = []


def _timed(tracer: Tracer, kind: str, fn: Any, detail: Any) -> Any:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, p0 = time.time(), time.perf_counter()
        out = None
        try:
            out = await fn(*args, **kwargs)
            return out
        finally:
            tracer.events.append((t0, time.perf_counter() - p0, kind, detail(args, out)))

    return wrapper


def _timed_sync(tracer: Tracer, kind: str, fn: Any, detail: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, p0 = time.time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - p0
            if took >= 0.005:  # the many quick ones would only bury the waits
                tracer.events.append((t0, took, kind, [threading.current_thread().name, *detail(args)]))

    return wrapper


def _patch_sync(tracer: Tracer) -> None:
    """Time the loaders' synchronous planning, shard opens and unit waits (those this loomdata has)."""
    import importlib

    def steps(args: Any) -> Any:
        a = args[1]
        return [int(a.min()), int(a.max())] if a is not None and len(a) else []

    targets = (
        ("loomdata.execution._loader", "SourceLoader", "read_now", lambda a: [len(a[1]), int(a[1]["step"].min())]),
        ("loomdata.execution._plan_ahead", "PlanAhead", "ahead", steps),
        ("loomdata.execution._plan_ahead", "PlanAhead", "_plan_chunk", lambda a: [a[1]]),
        ("loomdata.execution._plan_ahead", "PlanAhead", "_open_shards", lambda a: [a[1].tolist()]),
        ("loomdata.execution._shard_opens", "ShardOpens", "wait", lambda a: [len(a[1])]),
        ("loomdata.execution._verify", "Verifier", "open_shard", lambda a: [a[1]]),
        ("loomdata.execution._prefetch", "Prefetcher", "get", lambda a: [str(a[1][0]).rsplit("/", 1)[-1], a[1][1]]),
        (
            "loomdata.sources.parquet",
            "ParquetReader",
            "_decode_row_group",
            lambda a: [str(a[1]).rsplit("/", 1)[-1], a[3]],
        ),
    )
    for module, cls_name, name, detail in targets:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            continue
        fn = cls.__dict__.get(name)
        if fn is None:
            continue
        _PATCHED.append((cls, name, fn))
        setattr(cls, name, _timed_sync(tracer, name, fn, detail))


def _patch(tracer: Tracer) -> None:
    from loomdata.execution._constructor import DataConstructor
    from loomdata.execution._loader import SourceLoader

    def take(args: Any, out: Any) -> Any:
        return [args[1], args[2], None if out is None else len(out)]

    def build(args: Any, out: Any) -> Any:
        return [args[1][0][0], len(args[1])]

    def read(args: Any, out: Any) -> Any:
        return [len(args[1]), int(args[1]["length"].sum()), int(args[1]["step"].min()) if len(args[1]) else None]

    takes = "_take_packs" if hasattr(DataConstructor, "_take_packs") else "take_steps"  # what take_block calls
    for cls, name, detail in (
        (DataConstructor, takes, take),
        (DataConstructor, "_build_many", build),
        (SourceLoader, "read", read),
    ):
        fn = getattr(cls, name)
        _PATCHED.append((cls, name, fn))
        setattr(cls, name, _timed(tracer, name, fn, detail))
    _patch_sync(tracer)


def _unpatch() -> None:
    while _PATCHED:
        cls, name, fn = _PATCHED.pop()
        setattr(cls, name, fn)


def start(name: str = "default", lag_s: float = 0.05, gc_s: float = 0.01, patch: bool = False) -> None:
    """Start a named tracer in this process (a `client.run` target); `patch`: time serving calls too."""
    tracer = _ACTIVE[name] = Tracer(lag_s, gc_s).start()
    if patch:
        _patch(tracer)


def stop(name: str = "default") -> dict[str, Any]:
    """Stop the named tracer; its lags and GC pauses."""
    return _ACTIVE.pop(name).stop()
