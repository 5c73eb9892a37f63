"""The Executor: creates a plan's Source Loader and Data Constructor actors and publishes them.

Every actor is rebuilt from (plan dir, partition or rank group, step): a restarted executor serves
the same batches, and a client reconnects to it through `serve.json` or the published ServeInfo.
While running, a watchdog thread (`_recovery`) recreates every actor a dead worker took with it on a
live worker, re-routes the constructors and re-publishes the handles (`recover()`).

Resizing (`set_loaders`, called by the autoscaler) and recovery share one lock and one protocol, so
they interleave safely with worker loss at any point:
1. the new loaders are created and awaited; one lost while being created is created again;
2. the executor's state switches to them (a constructor recreated from now on gets the new route);
3. every live constructor is re-routed (`set_route`: atomic on its event loop); a constructor lost
   meanwhile is skipped (the watchdog recreates it with the current routes);
4. the old loaders are retired (closed, then released) only once every live constructor acknowledged
   the new route. If one could not be reached but is not known lost, the source stays "unrouted" and
   its old loaders stay open until `recover()` has re-routed every survivor.
Reads that were already on their way to an old loader either finish (any loader's answer is correct
for its samples) or fail fast with `LoaderRetired` and are retried on the new route by the
constructor; no pause or timing assumption is involved.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow.parquet as pq
from distributed import Client, Future

from loomdata.execution._autoscale import Autoscaler, Autoscaling
from loomdata.execution._constructor import DataConstructor, Route
from loomdata.execution._loader import SourceLoader
from loomdata.execution._partition import LoaderPartition, partition_source, rank_groups
from loomdata.execution._recovery import RecoveryStats, Watchdog, is_lost, lost_indices
from loomdata.execution.protocol import (
    ConstructorInfo,
    LoaderInfo,
    ServeInfo,
    constructor_dataset,
    serve_dataset,
    serve_path,
    write_serve_info,
)
from loomdata.schemas.errors import ExecutionError
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.plan import PlanMeta, check_fresh, read_plan

__all__ = ["Executor"]

_CALL_TIMEOUT_S = 60.0  # creating an actor or a control call; steps themselves never wait on this


class Executor:
    """Serves one plan on a Dask cluster: loaders per source partition, constructors per rank group.

    With `recover` (the default) lost actors are recreated while serving; see `recover()`. With
    `autoscale` (off by default; True or `Autoscaling` settings) a controller resizes each source's
    loaders to demand x measured cost while serving; its decisions are in `metrics()["autoscale"]`.
    """

    def __init__(
        self,
        plan_dir: str | Path,
        client: Client,
        *,
        constructors: int = 1,
        window: int = 2,
        loaders_per_source: int | Mapping[str, int] = 1,
        peers: int | None = None,
        start_step: int = 0,
        recover: bool = True,
        autoscale: bool | Autoscaling = False,
    ) -> None:
        self.plan_dir = Path(plan_dir).resolve()
        self.client = client
        self.meta: PlanMeta = read_plan(self.plan_dir)
        self.spec = self.meta.spec
        if window < 1:
            raise ExecutionError(f"window must be >= 1 step, got {window}")
        self.window = window
        self.n_constructors = constructors
        t = self.spec.training
        self.peers = peers if peers is not None else t.tp_size * t.pp_size * t.cp_size
        self.start_step = start_step
        self._loaders_per_source = loaders_per_source
        self._tag = uuid.uuid4().hex[:8]
        self._loader_futures: dict[int, list[Future]] = {}
        self._partitions: dict[int, list[LoaderPartition]] = {}
        self._loaders: dict[int, list[Any]] = {}
        self._constructor_futures: list[Future] = []
        self._constructors: list[Any] = []
        self._groups: list[list[int]] = []
        self._published: list[str] = []
        self._workers: itertools.cycle[str] | None = None
        self._lock = threading.RLock()  # the watchdog thread and the caller both change the actors
        self._recover = recover
        self._watchdog: Watchdog | None = None
        self._autoscale = Autoscaling() if autoscale is True else (autoscale or None)
        self._autoscaler: Autoscaler | None = None
        self._unrouted: set[int] = set()  # sources whose new loaders some constructor does not know yet
        self._retiring: list[tuple[list[Any], list[Future]]] = []  # old loaders awaiting every re-route
        self.info: ServeInfo | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Executor:
        """Create the actors, start building the first window, write serve.json; returns self.

        On failure everything created so far is released again before the error propagates.
        """
        try:
            with self._lock:
                self._start()
            if self._recover:
                self._watchdog = Watchdog(self.recover, name=f"loom-recovery-{self._tag}").start()
            if self._autoscale is not None:
                self._autoscaler = Autoscaler(self, self._autoscale, name=f"loom-autoscale-{self._tag}").start()
            return self
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        current = {s: IndexFiles.of(self.spec.workdir, s).fingerprint() for s in self.meta.sources}
        check_fresh(self.meta, current)
        workers = sorted(self.client.scheduler_info()["workers"])
        if not workers:
            raise ExecutionError(f"the cluster at {self.client.scheduler.address} has no workers; start some")
        self._workers = itertools.cycle(workers)
        with self.client.as_current():
            for sid, name in enumerate(self.meta.sources):
                self._partitions[sid], self._loader_futures[sid] = self._create_loaders(
                    sid, name, self._n_loaders(name)
                )
            for sid, futs in self._loader_futures.items():
                self._loaders[sid] = [f.result() for f in futs]
            self._groups = rank_groups(self.meta.dp_size, self.n_constructors)
            routes = self._routes()
            self._constructor_futures = [self._submit_constructor(ranks, routes) for ranks in self._groups]
            self._constructors = [f.result() for f in self._constructor_futures]
            for fut in [c.start() for c in self._constructors]:
                fut.result()
            for i, c in enumerate(self._constructors):
                name = constructor_dataset(self.meta.plan_id, i)
                self.client.publish_dataset(c, name=name, override=True)
                self._published.append(name)
        self._published.append(serve_dataset(self.meta.plan_id))
        self._publish_info(started_at=time.time())

    def stop(self) -> None:
        """Stop the autoscaler and watchdog, unpublish, stop and release the actors, remove our serve.json."""
        if self._autoscaler is not None:
            self._autoscaler.stop()
        if self._watchdog is not None:
            self._watchdog.stop()
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        for name in self._published:
            with contextlib.suppress(Exception):  # already gone (scheduler restarted): nothing to undo
                self.client.unpublish_dataset(name)
        self._published.clear()
        with self.client.as_current():
            self._retire()
            for c in self._constructors:
                with contextlib.suppress(Exception):
                    c.stop().result(timeout=10)
            for handles in self._loaders.values():
                for h in handles:
                    with contextlib.suppress(Exception):
                        h.close().result(timeout=10)
        self._constructors.clear()
        self._loaders.clear()
        for f in [*self._constructor_futures, *itertools.chain.from_iterable(self._loader_futures.values())]:
            f.release()
        self._constructor_futures.clear()
        self._loader_futures.clear()
        p = serve_path(self.plan_dir)
        if self.info is not None and p.exists():
            try:
                ours = ServeInfo.model_validate_json(p.read_text()).started_at == self.info.started_at
            except Exception:
                ours = False
            if ours:
                p.unlink(missing_ok=True)
        self.info = None

    def __enter__(self) -> Executor:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- scaling --------------------------------------------------------------------------------

    def set_loaders(self, source: str, n: int) -> int:
        """Re-partition `source` over `n` loaders (add or remove), re-route every constructor; returns n used."""
        with self._lock:
            return self._set_loaders(source, n)

    def loader_counts(self) -> dict[str, int]:
        """Loaders per source as the executor holds them (a lost one not yet recreated included)."""
        with self._lock:
            return {self.meta.sources[sid]: len(parts) for sid, parts in self._partitions.items()}

    def _set_loaders(self, source: str, n: int) -> int:
        if self.info is None:
            raise ExecutionError("the executor is not running; call start() first")
        sid = self.meta.sources.index(source)
        with self.client.as_current():
            self._use_live_workers()
            parts, futs = self._create_loaders(sid, source, n)
            handles = self._await_loaders(parts, futs)
            old = (self._loaders[sid], self._loader_futures[sid])
            self._partitions[sid], self._loaders[sid], self._loader_futures[sid] = parts, handles, futs
            self._retiring.append(old)
            if self._route_survivors([sid]):
                self._unrouted.discard(sid)
            else:
                self._unrouted.add(sid)  # recover() re-routes the survivors, then retires the old loaders
            if not self._unrouted:
                self._retire()
        self._publish_info(started_at=self.info.started_at)
        return len(parts)

    def _await_loaders(self, parts: list[LoaderPartition], futs: list[Future]) -> list[Any]:
        """Handles of freshly submitted loaders; one lost while being created is submitted again.

        `futs` is updated in place. On failure every future of `futs` is released before raising.
        """
        handles: list[Any] = [None] * len(futs)
        try:
            for attempt in range(3):
                for i, f in enumerate(futs):
                    if handles[i] is not None:
                        continue
                    try:
                        handles[i] = f.result(timeout=_CALL_TIMEOUT_S)
                    except Exception:
                        if attempt == 2:
                            raise
                        f.release()
                        self._use_live_workers()
                        futs[i] = self._submit_loader(parts[i])
                if all(h is not None for h in handles):
                    return handles
            raise ExecutionError("loaders could not be created")  # pragma: no cover - the loop raised already
        except BaseException:
            for f in futs:
                f.release()
            raise

    def _route_survivors(self, sids: list[int]) -> bool:
        """Send the current routes of `sids` to every constructor not known lost; True if all acknowledged.

        A constructor found lost (before or during the call) does not count against it: the watchdog
        recreates it with the current routes.
        """
        routes = self._routes()
        calls: list[tuple[int, Any]] = []
        ok = True
        for i, c in enumerate(self._constructors):
            if is_lost(self._constructor_futures[i]):
                continue
            for sid in sids:
                try:
                    calls.append((i, c.set_route(sid, routes[sid])))
                except Exception:  # the handle of an actor lost a moment ago refuses calls at once
                    ok = ok and is_lost(self._constructor_futures[i])
        for i, call in calls:
            try:
                call.result(timeout=_CALL_TIMEOUT_S)
            except Exception:
                ok = ok and is_lost(self._constructor_futures[i])
        return ok

    def _retire(self) -> None:
        """Close and release the loaders replaced by resizes (only once every live constructor has re-routed)."""
        retiring, self._retiring = self._retiring, []
        closes = []
        for handles, futs in retiring:
            for h, f in zip(handles, futs, strict=True):
                if is_lost(f):  # gone with its worker: nothing to close
                    continue
                with contextlib.suppress(Exception):  # lost a moment ago: the handle refuses calls
                    closes.append(h.close())
        for c in closes:
            with contextlib.suppress(Exception):
                c.result(timeout=10)
        for _, futs in retiring:
            for f in futs:
                f.release()

    # ---- recovery -------------------------------------------------------------------------------

    @property
    def recovery(self) -> RecoveryStats:
        """What the watchdog has recreated so far (empty stats when recovery is off or not started)."""
        return self._watchdog.stats if self._watchdog is not None else RecoveryStats()

    def recover(self) -> int:
        """Recreate every actor lost with its worker, re-route constructors, re-publish; returns how many.

        Loaders are recreated from their partition, constructors from their rank group (they rebuild
        whatever step a client asks for from the manifest), each on a live worker under a fresh key.
        The watchdog calls this every 0.2 s; it is cheap when nothing is lost (local future states).
        """
        with self._lock:
            if self.info is None:
                return 0
            lost_loaders = [(sid, i) for sid, futs in self._loader_futures.items() for i in lost_indices(futs)]
            lost_constructors = lost_indices(self._constructor_futures)
            if not lost_loaders and not lost_constructors and not self._unrouted:
                return 0
            self._use_live_workers()
            with self.client.as_current():
                new = {(sid, i): self._submit_loader(self._partitions[sid][i]) for sid, i in lost_loaders}
                for (sid, i), fut in new.items():
                    handle = fut.result(timeout=_CALL_TIMEOUT_S)
                    self._loader_futures[sid][i].release()
                    self._loader_futures[sid][i], self._loaders[sid][i] = fut, handle
                    self._unrouted.add(sid)
                routes = self._routes()
                if self._unrouted:
                    if not self._route_survivors(sorted(self._unrouted)):
                        raise ExecutionError("a live constructor did not take the new routes; retrying")
                    self._unrouted.clear()
                    self._retire()
                for i in lost_constructors:  # not started: the first take places its window
                    fut = self._submit_constructor(self._groups[i], routes)
                    handle = fut.result(timeout=_CALL_TIMEOUT_S)
                    self.client.publish_dataset(handle, name=constructor_dataset(self.meta.plan_id, i), override=True)
                    self._constructor_futures[i].release()
                    self._constructor_futures[i], self._constructors[i] = fut, handle
            self._publish_info(started_at=self.info.started_at)
            return len(lost_loaders) + len(lost_constructors)

    # ---- metrics --------------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Per-source samples/s, per-loader counters, constructor queue depth and per-rank wait time.

        An actor lost with its worker (not yet recreated) is left out rather than failing the report.
        """
        with self._lock, self.client.as_current():
            sids = [sid for sid, hs in self._loaders.items() for _ in hs]
            loader_handles = [h for hs in self._loaders.values() for h in hs]
            loader_answers = _answers(loader_handles)
            loaders = [dict(m, source_id=sid) for sid, m in zip(sids, loader_answers, strict=True) if m is not None]
            rss_by_worker = {
                str(h._address): m["rss_bytes"] for h, m in zip(loader_handles, loader_answers, strict=True) if m
            }
            cons = [m for m in _answers(self._constructors) if m is not None]
        sources: dict[str, dict[str, Any]] = {}
        for m in loaders:
            s = sources.setdefault(m["source"], {"loaders": 0, "samples": 0, "tokens": 0, "busy_s": 0.0, "rate": 0.0})
            s["loaders"] += 1
            s["samples"] += m["samples"]
            s["tokens"] += m["tokens"]
            s["busy_s"] += m["busy_s"]
            s["rate"] += m["samples_per_s"] or 0.0
        wait: dict[str, float] = {}
        for c in cons:
            wait.update(c["rank_wait_s"])
        return {
            "plan_id": self.meta.plan_id,
            "sources": {
                k: {
                    "loaders": v["loaders"],
                    "samples": v["samples"],
                    "tokens": v["tokens"],
                    "samples_per_s": round(v["rate"], 1),
                    "busy_s": round(v["busy_s"], 4),
                }
                for k, v in sources.items()
            },
            "loader_samples": sum(m["samples"] for m in loaders),
            "loader_calls": sum(m["calls"] for m in loaders),
            "loader_memory_bytes": sum(m["state_bytes"] for m in loaders),
            "loader_rss_bytes": sum(rss_by_worker.values()),
            "queue_depth": sum(c["queue_depth"] for c in cons),
            "rank_wait_s": wait,
            "constructors": cons,
            "loaders": loaders,
            "recovered_actors": self.recovery.recovered,
            "recovery_s": round(self.recovery.seconds, 3),
            "autoscale": self._autoscaler.report() if self._autoscaler is not None else {"enabled": False},
        }

    # ---- helpers --------------------------------------------------------------------------------

    def _n_loaders(self, source: str) -> int:
        n = self._loaders_per_source
        return int(n.get(source, 1)) if isinstance(n, Mapping) else int(n)

    def _create_loaders(self, sid: int, name: str, n: int) -> tuple[list[LoaderPartition], list[Future]]:
        files = IndexFiles.of(self.spec.workdir, name)
        shards = pq.read_table(str(files.samples), columns=["shard"]).column("shard").to_numpy()
        parts = partition_source(sid, name, shards, n)
        return parts, [self._submit_loader(p) for p in parts]

    def _next_worker(self) -> str:
        if self._workers is None:
            raise ExecutionError("the executor is not started; call start() first")
        return next(self._workers)

    def _use_live_workers(self) -> None:
        """Place new actors round-robin over the workers alive now (a dead one's replacement included)."""
        workers = sorted(self.client.scheduler_info()["workers"])
        if not workers:
            raise ExecutionError(
                f"every worker of {self.client.scheduler.address} is gone; lost actors are recreated "
                "as soon as a worker joins (start one, or restart `loom serve`)"
            )
        self._workers = itertools.cycle(workers)

    def _submit_loader(self, p: LoaderPartition) -> Future:
        return self.client.submit(
            SourceLoader,
            str(self.plan_dir),
            p,
            actor=True,
            workers=[self._next_worker()],
            allow_other_workers=True,
            key=f"loom-loader-{self._tag}-{p.source}-{p.part}-{uuid.uuid4().hex[:6]}",
        )

    def _submit_constructor(self, ranks: list[int], routes: dict[int, Route]) -> Future:
        return self.client.submit(
            DataConstructor,
            str(self.plan_dir),
            ranks,
            routes,
            self.window,
            self.peers,
            self.start_step,
            actor=True,
            workers=[self._next_worker()],
            allow_other_workers=True,
            key=f"loom-constructor-{self._tag}-{ranks[0]}-{uuid.uuid4().hex[:6]}",
        )

    def _routes(self) -> dict[int, Route]:
        return {sid: Route(self._partitions[sid], self._loaders[sid]) for sid in self._loaders}

    def _publish_info(self, *, started_at: float) -> None:
        """Describe the actors as they are now: ServeInfo published on the scheduler and in serve.json."""
        self.info = ServeInfo(
            plan_id=self.meta.plan_id,
            scheduler=self.client.scheduler.address,
            window=self.window,
            peers=self.peers,
            constructors=[
                ConstructorInfo(name=constructor_dataset(self.meta.plan_id, i), ranks=g, worker=str(c._address))
                for i, (g, c) in enumerate(zip(self._groups, self._constructors, strict=True))
            ],
            loaders=self._loader_infos(),
            pid=os.getpid(),
            started_at=started_at,
        )
        self.client.publish_dataset(self.info.model_dump_json(), name=serve_dataset(self.meta.plan_id), override=True)
        write_serve_info(self.plan_dir, self.info)

    def _partition_worker(self, sid: int, part: int) -> str:
        return str(self._loaders[sid][part]._address)

    def _loader_infos(self) -> list[LoaderInfo]:
        return [
            LoaderInfo(
                name=str(self._loader_futures[sid][i].key),
                source=p.source,
                part=p.part,
                first_shard=p.first_shard,
                stop_shard=p.stop_shard,
                first_sample=p.first_sample,
                stop_sample=p.stop_sample,
                worker=self._partition_worker(sid, i),
            )
            for sid, parts in self._partitions.items()
            for i, p in enumerate(parts)
        ]


def _answers(actors: list[Any]) -> list[dict[str, Any] | None]:
    """`metrics()` of each actor, None for one that cannot answer (lost with its worker)."""
    calls: list[Any] = []
    for a in actors:
        try:
            calls.append(a.metrics())
        except Exception:  # the handle of a lost actor refuses calls at once
            calls.append(None)
    out: list[dict[str, Any] | None] = []
    for c in calls:
        try:
            out.append(c.result(timeout=30) if c is not None else None)
        except Exception:
            out.append(None)
    return out
