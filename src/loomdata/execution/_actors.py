"""The remote operations on a plan's fleet: create, route, retire, replace what is lost, publish, stop.

`FleetOps` is called from one thread only (the control loop's; the caller's before the loop starts
and after it stopped), so it holds no lock; each operation makes its remote calls, sorts their
outcomes (`_outcome`) and records them in the plain `Fleet`. Resizing and recovery are one protocol,
so they interleave safely with worker loss at any point:
1. new loaders are created and awaited; one lost while being created is created again;
2. the fleet switches to them under a new route generation (a constructor recreated from now on gets
   the new route);
3. every live constructor is sent the routes it has not acknowledged, all in one call (`set_routes`:
   atomic on its event loop); a lost one is skipped (it is recreated with the current routes), one that did not
   answer is asked again by the next recovery round;
4. replaced loaders retire (closed, then released) only once every live constructor acknowledged
   the route that replaced them.
Reads already on their way to an old loader either finish (any loader's answer is correct for its
samples) or fail fast with `LoaderRetired` and are retried on the new route by the constructor.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client, Future

from loomdata.execution._config import ServeConfig
from loomdata.execution._constructor import DataConstructor
from loomdata.execution._dask_actors import release
from loomdata.execution._dask_client import live_workers
from loomdata.execution._fleet import Actor, Fleet, worker_of
from loomdata.execution._loader_cache import CachePolicy
from loomdata.execution._loader_link import LinkedLoader
from loomdata.execution._metrics import final_metrics
from loomdata.execution._outcome import Kind, issue
from loomdata.execution._partition import LoaderPartition, partition_source, rank_groups
from loomdata.execution._publish import Publisher
from loomdata.execution._retry import retry_until
from loomdata.execution._storage_options import SourceOptions
from loomdata.execution.protocol import ServeInfo, constructor_dataset
from loomdata.schemas.errors import ContractError, ExecutionError, LoomError
from loomdata.schemas.freshness import require_fresh
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.plan_view import PlanView

__all__ = ["FleetOps", "constructor_workers"]


class FleetOps:
    """Creates and maintains the actors of one plan on a Dask cluster (single-threaded use)."""

    def __init__(
        self, plan_dir: Path, client: Client, meta: PlanView, *, peers: int, config: ServeConfig, options: SourceOptions
    ) -> None:
        self.plan_dir = plan_dir
        self.client = client
        self.meta = meta
        self.config = config
        self.t = config.timings
        self.peers = peers
        self._workdir = meta.spec.workdir
        self._options = options  # each loader is given its source's at creation (start, resize, recovery)
        self._tag = uuid.uuid4().hex[:8]
        self._shards: dict[int, np.ndarray] = {}  # samples per shard id, per source id (read once from the index)
        self._workers: itertools.cycle[str] = itertools.cycle([])
        self.fleet = Fleet(meta.plan_id, list(meta.sources), rank_groups(meta.dp_size, config.constructors))
        self.published = Publisher(client, plan_dir, meta.plan_id, heartbeat_s=config.timings.heartbeat_s)

    # ---- start / stop ---------------------------------------------------------------------------

    def start(self) -> None:
        """Create every loader, then every constructor with their routes; start them; publish."""
        require_fresh(self.meta, self._workdir)  # the build settings and globs: checked with the plan (`check_plan`)
        if not live_workers(self.client):
            raise ExecutionError(f"the cluster at {self.client.scheduler.address} has no workers; start some")
        self._use_live_workers()
        with self.client.as_current():
            created = {i: self._create_loaders(i, self.config.loaders_for(n)) for i, n in enumerate(self.meta.sources)}
            for sid, (parts, futs) in created.items():
                self.fleet.set_loaders(sid, parts, self.await_loaders(parts, futs))
            for a in self._create_constructors(list(range(len(self.fleet.groups)))).values():
                self.fleet.add_constructor(a)
            for c in [issue(a.future, a.handle, "start") for a in self.fleet.constructors]:
                out = c.outcome(timeout=self.t.call_timeout_s)
                if not out.ok:
                    raise ExecutionError(f"a constructor did not start ({out.kind}: {out.error})")
            for i, a in enumerate(self.fleet.constructors):
                self.published.constructor(i, a.handle)
        self.publish(started_at=time.time())

    def stop(self) -> None:
        """Unpublish, stop constructors, close loaders, release every future, remove our serve.json."""
        self.published.withdraw()
        with self.client.as_current():
            self.retire_ready(everything=True)
            calls = [issue(a.future, a.handle, "stop") for a in self.fleet.constructors]
            calls += [issue(a.future, a.handle, "close") for actors in self.fleet.loaders.values() for a in actors]
            for call in calls:
                call.outcome(timeout=self.t.close_timeout_s)  # whatever happened, it is stopping now
        for a in self.fleet.actors():
            a.future.release()
        release(a.handle for a in self.fleet.actors())
        self.fleet.constructors.clear()
        self.fleet.loaders.clear()

    # ---- the protocol ---------------------------------------------------------------------------

    def resize(self, source: str, n: int) -> int:
        """Re-partition `source` over `n` loaders, route every live constructor, retire the old; returns n used."""
        sid = self.meta.sources.index(source)
        with self.client.as_current():
            self._use_live_workers()
            parts, futs = self._create_loaders(sid, n)
            self.fleet.set_loaders(sid, parts, self.await_loaders(parts, futs))
            self.route_stale()
            self.retire_ready()
        self.publish()
        return len(parts)

    def replace_lost(self) -> int:
        """Recreate every lost actor on a live worker, bring every route up to date, publish; returns how many.

        Raises ExecutionError (after doing all it could) when a live constructor did not take its routes.
        """
        lost = self.fleet.lost()
        if not lost and not self.fleet.stale() and not self.fleet.retiring:
            return 0
        self._use_live_workers()
        with self.client.as_current():
            if lost.loaders:
                parts = [self.fleet.partitions[sid][i] for sid, i in lost.loaders]
                fresh = self.await_loaders(parts, [self._submit_loader(p) for p in parts])
                for (sid, i), actor in zip(lost.loaders, fresh, strict=True):
                    gone = self.fleet.replace_loader(sid, i, actor)
                    gone.future.release()
                    release([gone.handle])
            routed = self.route_stale()
            self.retire_ready()
            for i, actor in self._create_constructors(lost.constructors).items():  # not started: a take places it
                self.published.constructor(i, actor.handle)
                gone = self.fleet.replace_constructor(i, actor)
                gone.future.release()
                release([gone.handle])
        self.publish()
        if not routed:
            raise ExecutionError("a live constructor did not take the new routes; retrying")
        return lost.count

    def route_stale(self) -> bool:
        """Send each live constructor the routes it has not acknowledged; True if every one acknowledged.

        A constructor found lost meanwhile does not count against it: it is recreated with the current routes.
        """
        gens = dict(self.fleet.route_generation)
        cons = self.fleet.constructors
        routes = {i: {sid: self.fleet.route(sid) for sid in sids} for i, sids in self.fleet.stale().items()}
        calls = [(i, sids, issue(cons[i].future, cons[i].handle, "set_routes", sids)) for i, sids in routes.items()]
        ok = True
        for i, sids, call in calls:
            out = call.outcome(timeout=self.t.call_timeout_s)
            if out.ok:
                for sid in sids:
                    self.fleet.acknowledge(i, sid, gens[sid])
            elif out.kind is not Kind.LOST:
                ok = False
        return ok

    def retire_ready(self, *, everything: bool = False) -> None:
        """Close and release the replaced loaders no live constructor routes to any more (all of them: `everything`)."""
        ready = self.fleet.retiring if everything else self.fleet.take_retirable()
        if everything:
            self.fleet.retiring = []
        actors = [a for r in ready for a in r.actors]
        for call in [issue(a.future, a.handle, "close") for a in actors if not a.lost]:
            call.outcome(timeout=self.t.close_timeout_s)  # lost meanwhile: nothing left to close
        self.fleet.retired_all(ready, final_metrics(actors, self.t.close_timeout_s))  # counters outlive the loaders
        for a in actors:
            a.future.release()
        release(a.handle for a in actors)  # the handles' own futures: else the worker keeps the retired actor

    def await_loaders(self, parts: list[LoaderPartition], futs: list[Future]) -> list[Actor]:
        """Actors of freshly submitted loaders; one lost while being created is submitted again."""
        return self._await(futs, lambda i: self._submit_loader(parts[i]), what=lambda i: f"loader {parts[i]}")

    def _create_constructors(self, indices: list[int]) -> dict[int, Actor]:
        """Constructors of the rank groups `indices`, created, awaited, then given the current routes.

        Routes go by `set_routes`, not as creation arguments (see `_dask_actors`: arguments would pin
        every loader they name for the constructor's life). Raises ExecutionError if one refused them.
        """
        groups = [self.fleet.groups[i] for i in indices]
        places = constructor_workers(live_workers(self.client), self.fleet, len(groups))
        futs = [self._submit_constructor(g, w) for g, w in zip(groups, places, strict=True)]
        actors = self._await(futs, lambda k: self._submit_constructor(groups[k]), what=lambda k: f"ranks {groups[k]}")
        routes = self.fleet.routes()
        calls = [issue(a.future, a.handle, "set_routes", routes) for a in actors]  # one call each: one connection
        for call in calls:
            out = call.outcome(timeout=self.t.call_timeout_s)
            if not out.ok and out.kind is not Kind.LOST:  # a lost one is recreated by the next recovery
                raise ExecutionError(f"a new constructor did not take its routes ({out.kind}: {out.error})")
        _open_gateways(self.fleet, indices, actors, self.t.call_timeout_s)
        return dict(zip(indices, actors, strict=True))

    def _await(
        self, futs: list[Future], resubmit: Callable[[int], Future], *, what: Callable[[int], str]
    ) -> list[Actor]:
        """Actors of submitted futures; one whose worker died while creating it is submitted again.

        A data error (LoomError, e.g. a stale index) raises at once. On failure every future is released.
        """
        futs = list(futs)

        def created(i: int) -> Actor:
            def attempt() -> Actor:
                return Actor(futs[i], futs[i].result(timeout=self.t.call_timeout_s))

            def again(_: Exception) -> None:
                futs[i].release()
                self._use_live_workers()
                futs[i] = resubmit(i)

            return retry_until(
                attempt,
                retryable=lambda e: not isinstance(e, LoomError),
                give_up=lambda e, n: ExecutionError(f"{what(i)} could not be created in {n} attempts: {e}"),
                attempts=self.t.create_attempts,
                on_retry=again,
            )

        try:
            return [created(i) for i in range(len(futs))]
        except BaseException:
            for f in futs:
                f.release()
            raise

    # ---- publishing -----------------------------------------------------------------------------

    @property
    def info(self) -> ServeInfo | None:
        """The ServeInfo published last (None before start and after stop)."""
        return self.published.info

    def publish(self, *, started_at: float | None = None) -> ServeInfo:
        """Describe the actors as they are now: ServeInfo published on the scheduler and in serve.json."""
        last = self.published.info
        info = self.fleet.serve_info(
            scheduler=self.client.scheduler.address,
            window=self.config.window,
            peers=self.peers,
            pid=os.getpid(),
            started_at=started_at if started_at is not None else (last.started_at if last else time.time()),
        )
        self.published.serve_info(info)
        return info

    # ---- helpers --------------------------------------------------------------------------------

    def shard_counts(self) -> dict[str, int]:
        """Non-empty shards per source (the most loaders a source can have)."""
        return {name: max(1, int(np.count_nonzero(self._shard_sizes(i)))) for i, name in enumerate(self.meta.sources)}

    def _shard_sizes(self, sid: int) -> np.ndarray:
        if sid not in self._shards:
            self._shards[sid] = _shard_sizes(self._workdir, self.meta.sources[sid])
        return self._shards[sid]

    def _create_loaders(self, sid: int, n: int) -> tuple[list[LoaderPartition], list[Future]]:
        sizes = self._shard_sizes(sid)
        column = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        parts = partition_source(sid, self.meta.sources[sid], column, n)
        return parts, [self._submit_loader(p) for p in parts]

    def _use_live_workers(self) -> None:
        """Place new actors round-robin over the workers alive now (a dead one's replacement included)."""
        workers = sorted(live_workers(self.client))
        if not workers:
            raise ExecutionError(
                f"every worker of {self.client.scheduler.address} is gone; lost actors are recreated "
                "as soon as a worker joins (start one, or restart `loom serve`)"
            )
        self._workers = itertools.cycle(workers)

    def _submit(self, cls: type, *args: Any, key: str, worker: str | None = None) -> Future:
        where = [worker or next(self._workers)]
        return self.client.submit(cls, *args, actor=True, workers=where, allow_other_workers=True, key=key)

    def _submit_loader(self, p: LoaderPartition) -> Future:
        key = f"loom-loader-{self._tag}-{p.source}-{p.part}-{uuid.uuid4().hex[:6]}"
        policy = CachePolicy.serving(self.config)
        return self._submit(LinkedLoader, str(self.plan_dir), p, policy, self._options.only(p.source), key=key)

    def _submit_constructor(self, ranks: list[int], worker: str | None = None) -> Future:
        key, c = f"loom-constructor-{self._tag}-{ranks[0]}-{uuid.uuid4().hex[:6]}", self.config
        args: tuple[Any, ...] = (str(self.plan_dir), ranks, {}, c.window, self.peers, c.start_step)
        return self._submit(DataConstructor, *args, key=key, worker=worker)


def constructor_workers(workers: Iterable[str], fleet: Fleet, n: int) -> list[str | None]:
    """Where `n` new constructors go: each on the live worker with the fewest constructors, then the fewest samples
    in its loaders' partitions (a loader's requests cost about in proportion to the samples it serves).

    Round-robin put the constructor of 2 sources beside the loader of the source with 4x the samples: that worker
    ran at one core (constructor, gateway and the busier loader) while the other idled half the time. Lost actors
    are not counted (a restarted worker may reuse an address). None each where no worker is live (round-robin then
    meets the error); a constructor submitted again after a failed start goes round-robin.
    """
    live = sorted(workers)
    count, samples = dict.fromkeys(live, 0), dict.fromkeys(live, 0)
    for a in fleet.constructors:
        if not a.lost and (w := worker_of(a.handle)) in count:
            count[w] += 1
    for sid, actors in fleet.loaders.items():
        for part, a in zip(fleet.partitions[sid], actors, strict=True):
            if not a.lost and (w := worker_of(a.handle)) in samples:
                samples[w] += part.stop_sample - part.first_sample
    out: list[str | None] = [None] * n
    for i in range(n if live else 0):
        w = min(live, key=lambda w: (count[w], samples[w]))
        count[w] += 1
        out[i] = w
    return out


def _shard_sizes(workdir: Path, source: str) -> np.ndarray:
    """Samples per shard id of a source: what partitioning needs of the index's shard column, kept small.

    The column itself (4 B a sample; all sources: 9.6 MB of the serving process at 300 sources of 8,000
    samples) is read and dropped; `partition_source` gets it back from these counts when it runs.
    """
    column = IndexFiles.of(workdir, source).sample_shards().column("shard").to_numpy()
    if np.any(np.diff(column.astype(np.int64)) < 0):  # counts would hide it: `partition_source` checks the column
        raise ContractError(f"source {source!r}: index samples are not in shard order; rebuild it with `loom index`")
    return np.bincount(column)


def _open_gateways(fleet: Fleet, indices: list[int], actors: list[Actor], timeout_s: float) -> None:
    """Open the rank gateway of each new constructor; one without (or lost meanwhile) is called through Dask."""
    names = [constructor_dataset(fleet.plan_id, i) for i in indices]
    calls = [issue(a.future, a.handle, "open_gateway", n) for a, n in zip(actors, names, strict=True)]
    for i, call in zip(indices, calls, strict=True):
        out = call.outcome(timeout=timeout_s)
        fleet.gateways[i] = out.value if out.ok else None
