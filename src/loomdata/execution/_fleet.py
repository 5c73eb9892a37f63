"""The actor fleet of one served plan as plain state: no threads, no locks, no remote calls.

It holds the loader partitions per source, the actors (future + handle) of loaders and
constructors, and route generations: every change of a source's route (a resize, a recreated
loader) bumps the fleet's `generation` and stamps the source with it; each constructor records the
generation of every source's route it has acknowledged. From that alone it answers the questions
of the control loop, all pure: which actors are lost (future states), which live constructors still
route a source by an older generation (`stale`), and which replaced loaders may retire (every live
constructor acknowledged the route that replaced them). `_actors.FleetOps` does the remote calls
and records their outcomes here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loomdata.execution._dask_actors import actor_address
from loomdata.execution._partition import LoaderPartition
from loomdata.execution._reads import Route
from loomdata.execution._recovery import is_lost
from loomdata.execution.protocol import ConstructorInfo, LoaderInfo, ServeInfo, constructor_dataset
from loomdata.schemas.metrics import LoaderMetrics, RetiredLoaders

if TYPE_CHECKING:
    from loomdata.execution._gateway import GatewayAddress

__all__ = ["Actor", "Fleet", "Lost", "Retiring", "worker_of"]


def worker_of(handle: Any) -> str:
    """The address of the worker holding an actor handle ("unknown" if Dask no longer says)."""
    return actor_address(handle) or "unknown"


@dataclass(frozen=True, slots=True)
class Actor:
    """One actor: its Dask future (its liveness) and its handle (its methods)."""

    future: Any  # distributed.Future of the actor task
    handle: Any  # distributed.Actor

    @property
    def lost(self) -> bool:
        return is_lost(self.future)

    @property
    def name(self) -> str:
        return str(self.future.key)


@dataclass(frozen=True, slots=True)
class Retiring:
    """Loaders of a source replaced by the route of `generation`: closed once every live constructor has it."""

    source_id: int
    generation: int
    actors: list[Actor]


@dataclass(frozen=True, slots=True)
class Lost:
    """Lost actors: loaders as (source id, part), constructors by index."""

    loaders: list[tuple[int, int]]
    constructors: list[int]

    def __bool__(self) -> bool:
        return bool(self.loaders or self.constructors)

    @property
    def count(self) -> int:
        return len(self.loaders) + len(self.constructors)


@dataclass
class Fleet:
    """Loaders per source partition and constructors per rank group, with route generations."""

    plan_id: str
    sources: list[str]  # names by source id
    groups: list[list[int]]  # ranks of each constructor
    partitions: dict[int, list[LoaderPartition]] = field(default_factory=dict)
    loaders: dict[int, list[Actor]] = field(default_factory=dict)
    constructors: list[Actor] = field(default_factory=list)
    generation: int = 0
    route_generation: dict[int, int] = field(default_factory=dict)  # source id -> generation of its route
    acknowledged: list[dict[int, int]] = field(default_factory=list)  # per constructor: source id -> generation
    retiring: list[Retiring] = field(default_factory=list)
    gateways: dict[int, GatewayAddress | None] = field(default_factory=dict)  # constructor -> its gateway
    retired: dict[str, RetiredLoaders] = field(default_factory=dict)  # source name -> counters of loaders gone
    last_seen: dict[str, LoaderMetrics] = field(default_factory=dict)  # loader actor name -> its last metrics

    # ---- routes ---------------------------------------------------------------------------------

    def route(self, source_id: int) -> Route:
        """Where the samples of a source are read now."""
        return Route(self.partitions[source_id], [a.handle for a in self.loaders[source_id]])

    def routes(self) -> dict[int, Route]:
        return {sid: self.route(sid) for sid in self.loaders}

    def set_loaders(self, source_id: int, parts: list[LoaderPartition], actors: list[Actor]) -> None:
        """A source's new partitions and loaders (a resize); the old loaders wait to retire."""
        old = self.loaders.get(source_id)
        self.partitions[source_id] = parts
        self.loaders[source_id] = actors
        self._bump(source_id)
        if old:
            self.retiring.append(Retiring(source_id, self.route_generation[source_id], old))

    def replace_loader(self, source_id: int, part: int, actor: Actor) -> Actor:
        """A recreated loader of the same partition takes the place of a lost one (whose counters are kept as
        retired); returns the lost one."""
        old = self.loaders[source_id][part]
        self.loaders[source_id][part] = actor
        self._bump(source_id)
        self.count_retired(source_id, [old], {})  # it cannot answer: its last metrics count
        return old

    def retired_all(self, ready: list[Retiring], final: dict[str, LoaderMetrics]) -> None:
        """Count the loaders of `ready` as retired (`count_retired`), with their final metrics where they answered."""
        for r in ready:
            self.count_retired(r.source_id, r.actors, final)

    def count_retired(self, source_id: int, actors: list[Actor], final: dict[str, LoaderMetrics]) -> None:
        """Add loaders leaving the fleet to the source's retired counters: each its `final` metrics (asked once
        closed), else the last it answered (`last_seen`: a lost loader cannot answer), else nothing known."""
        name = self.sources[source_id]
        r = self.retired.get(name, RetiredLoaders(source=name))
        for a in actors:
            seen = self.last_seen.pop(a.name, None)
            r = r.add(final.get(a.name, seen))
        self.retired[name] = r
        held = {a.name for a in self.actors()}  # a gather made before may have written a gone loader's answer since
        for gone in [k for k in list(self.last_seen) if k not in held]:  # list(): one atomic copy of the keys
            self.last_seen.pop(gone, None)

    def add_constructor(self, actor: Actor) -> None:
        """A constructor made with the current routes (start)."""
        self.constructors.append(actor)
        self.acknowledged.append(dict(self.route_generation))

    def replace_constructor(self, index: int, actor: Actor) -> Actor:
        """A constructor recreated with the current routes; returns the one it replaces."""
        old = self.constructors[index]
        self.constructors[index] = actor
        self.acknowledged[index] = dict(self.route_generation)
        return old

    def acknowledge(self, index: int, source_id: int, generation: int) -> None:
        """Constructor `index` confirmed the route of `source_id` of `generation`."""
        ack = self.acknowledged[index]
        ack[source_id] = max(ack.get(source_id, -1), generation)

    def _bump(self, source_id: int) -> None:
        self.generation += 1
        self.route_generation[source_id] = self.generation

    # ---- pure questions -------------------------------------------------------------------------

    def lost(self) -> Lost:
        """What died with its worker (local future states)."""
        return Lost(
            loaders=[(sid, i) for sid, actors in self.loaders.items() for i, a in enumerate(actors) if a.lost],
            constructors=[i for i, a in enumerate(self.constructors) if a.lost],
        )

    def stale(self) -> dict[int, list[int]]:
        """Live constructor index -> the sources whose current route it has not acknowledged."""
        out: dict[int, list[int]] = {}
        for i, a in enumerate(self.constructors):
            if a.lost:
                continue  # recreated with the current routes
            behind = [s for s, g in sorted(self.route_generation.items()) if self.acknowledged[i].get(s, -1) < g]
            if behind:
                out[i] = behind
        return out

    def take_retirable(self) -> list[Retiring]:
        """Remove and return the replaced loaders every live constructor has stopped routing to."""

        def done(r: Retiring) -> bool:
            return all(
                c.lost or ack.get(r.source_id, -1) >= r.generation
                for c, ack in zip(self.constructors, self.acknowledged, strict=True)
            )

        ready = [r for r in self.retiring if done(r)]
        self.retiring = [r for r in self.retiring if not done(r)]
        return ready

    def needs_attention(self) -> bool:
        """Anything lost, a route not acknowledged, or loaders waiting to retire."""
        return bool(self.lost() or self.stale() or self.retiring)

    def counts(self) -> dict[str, int]:
        """Loaders per source name (a lost one not yet recreated included)."""
        return {self.sources[sid]: len(parts) for sid, parts in self.partitions.items()}

    def actors(self) -> list[Actor]:
        """Every actor the fleet holds, retiring ones included."""
        return [
            *self.constructors,
            *(a for actors in self.loaders.values() for a in actors),
            *(a for r in self.retiring for a in r.actors),
        ]

    def _constructor_info(self, i: int) -> ConstructorInfo:
        gateway = self.gateways.get(i)
        return ConstructorInfo(
            name=constructor_dataset(self.plan_id, i),
            ranks=self.groups[i],
            worker=worker_of(self.constructors[i].handle),
            gateway=gateway.address if gateway else None,
            gateway_id=gateway.id if gateway else None,
            local=gateway.local if gateway else None,
        )

    def serve_info(self, *, scheduler: str, window: int, peers: int, pid: int, started_at: float) -> ServeInfo:
        """The published description of the fleet (serve.json)."""
        return ServeInfo(
            plan_id=self.plan_id,
            scheduler=scheduler,
            window=window,
            peers=peers,
            constructors=[self._constructor_info(i) for i in range(len(self.constructors))],
            loaders=[
                LoaderInfo(
                    name=a.name,
                    source=p.source,
                    part=p.part,
                    first_shard=p.first_shard,
                    stop_shard=p.stop_shard,
                    first_sample=p.first_sample,
                    stop_sample=p.stop_sample,
                    worker=worker_of(a.handle),
                )
                for sid, parts in self.partitions.items()
                for p, a in zip(parts, self.loaders[sid], strict=True)
            ],
            pid=pid,
            started_at=started_at,
        )
