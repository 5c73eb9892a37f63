"""The Executor: creates a plan's Source Loader and Data Constructor actors and publishes them.

Every actor is rebuilt from (plan dir, partition or rank group, step): a restarted executor serves
the same batches, and a client reconnects to it through `serve.json` or the published ServeInfo.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow.parquet as pq
from distributed import Client, Future

from loomdata.execution._constructor import DataConstructor, Route
from loomdata.execution._loader import SourceLoader
from loomdata.execution._partition import LoaderPartition, partition_source, rank_groups
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
from loomdata.schemas.spec import Spec

__all__ = ["Executor"]


class Executor:
    """Serves one plan on a Dask cluster: loaders per source partition, constructors per rank group."""

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
    ) -> None:
        self.plan_dir = Path(plan_dir).resolve()
        self.client = client
        self.meta: PlanMeta = read_plan(self.plan_dir)
        self.spec = Spec.model_validate(self.meta.spec)
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
        self.info: ServeInfo | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Executor:
        """Create the actors, start building the first window, write serve.json; returns self.

        On failure everything created so far is released again before the error propagates.
        """
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Executor:
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
            routes = {sid: Route(self._partitions[sid], self._loaders[sid]) for sid in self._loaders}
            placed = [next(self._workers) for _ in self._groups]
            self._constructor_futures = [
                self.client.submit(
                    DataConstructor,
                    str(self.plan_dir),
                    ranks,
                    routes,
                    self.window,
                    self.peers,
                    self.start_step,
                    actor=True,
                    workers=[w],
                    key=f"loom-constructor-{self._tag}-{i}",
                )
                for i, (ranks, w) in enumerate(zip(self._groups, placed, strict=True))
            ]
            self._constructors = [f.result() for f in self._constructor_futures]
            for fut in [c.start() for c in self._constructors]:
                fut.result()
            for i, c in enumerate(self._constructors):
                name = constructor_dataset(self.meta.plan_id, i)
                self.client.publish_dataset(c, name=name, override=True)
                self._published.append(name)
        self.info = ServeInfo(
            plan_id=self.meta.plan_id,
            scheduler=self.client.scheduler.address,
            window=self.window,
            peers=self.peers,
            constructors=[
                ConstructorInfo(name=constructor_dataset(self.meta.plan_id, i), ranks=g, worker=w)
                for i, (g, w) in enumerate(zip(self._groups, placed, strict=True))
            ],
            loaders=self._loader_infos(),
            pid=os.getpid(),
            started_at=time.time(),
        )
        name = serve_dataset(self.meta.plan_id)
        self.client.publish_dataset(self.info.model_dump_json(), name=name, override=True)
        self._published.append(name)
        write_serve_info(self.plan_dir, self.info)
        return self

    def stop(self) -> None:
        """Unpublish, stop the actors, release them, and remove serve.json if it is still ours."""
        for name in self._published:
            with contextlib.suppress(Exception):  # already gone (scheduler restarted): nothing to undo
                self.client.unpublish_dataset(name)
        self._published.clear()
        with self.client.as_current():
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
        if self.info is None:
            raise ExecutionError("the executor is not running; call start() first")
        sid = self.meta.sources.index(source)
        with self.client.as_current():
            parts, futs = self._create_loaders(sid, source, n)
            handles = [f.result() for f in futs]
            route = Route(parts, handles)
            for fut in [c.set_route(sid, route) for c in self._constructors]:
                fut.result()
            old_handles, old_futs = self._loaders[sid], self._loader_futures[sid]
            self._partitions[sid], self._loaders[sid], self._loader_futures[sid] = parts, handles, futs
        time.sleep(0.2)  # let builds that started on the old route finish their reads
        for h in old_handles:
            with contextlib.suppress(Exception):
                h.close().result(timeout=10)
        for f in old_futs:
            f.release()
        self.info = self.info.model_copy(update={"loaders": self._loader_infos()})
        write_serve_info(self.plan_dir, self.info)
        return len(parts)

    # ---- metrics --------------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Per-source samples/s, per-loader counters, constructor queue depth and per-rank wait time."""
        with self.client.as_current():
            loader_futs = [(sid, h.metrics()) for sid, hs in self._loaders.items() for h in hs]
            cons_futs = [c.metrics() for c in self._constructors]
            loaders = [dict(f.result(timeout=30), source_id=sid) for sid, f in loader_futs]
            cons = [f.result(timeout=30) for f in cons_futs]
        sources: dict[str, dict[str, Any]] = {}
        for m in loaders:
            s = sources.setdefault(m["source"], {"loaders": 0, "samples": 0, "tokens": 0, "busy_s": 0.0, "rate": 0.0})
            s["loaders"] += 1
            s["samples"] += m["samples"]
            s["tokens"] += m["tokens"]
            s["busy_s"] += m["busy_s"]
            s["rate"] += m["samples_per_s"] or 0.0
        rss_by_worker = {}
        for m, (sid, _) in zip(loaders, loader_futs, strict=True):
            part = m["part"]
            worker = self._partition_worker(sid, part)
            rss_by_worker[worker] = m["rss_bytes"]
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
        }

    # ---- helpers --------------------------------------------------------------------------------

    def _n_loaders(self, source: str) -> int:
        n = self._loaders_per_source
        return int(n.get(source, 1)) if isinstance(n, Mapping) else int(n)

    def _create_loaders(self, sid: int, name: str, n: int) -> tuple[list[LoaderPartition], list[Future]]:
        files = IndexFiles.of(self.spec.workdir, name)
        shards = pq.read_table(str(files.samples), columns=["shard"]).column("shard").to_numpy()
        parts = partition_source(sid, name, shards, n)
        if self._workers is None:
            raise ExecutionError("the executor is not started")
        futs = [
            self.client.submit(
                SourceLoader,
                str(self.plan_dir),
                p,
                actor=True,
                workers=[next(self._workers)],
                key=f"loom-loader-{self._tag}-{name}-{p.part}-{uuid.uuid4().hex[:6]}",
            )
            for p in parts
        ]
        return parts, futs

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
