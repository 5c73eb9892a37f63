"""The fleet's pure questions: what is lost, which routes a constructor lacks, which old loaders may retire."""

from __future__ import annotations

from dataclasses import dataclass

from loomdata.execution._fleet import Actor, Fleet
from loomdata.execution._partition import LoaderPartition


@dataclass
class _Future:
    """Stands in for a distributed.Future: `status` and `key` are read."""

    key: str
    status: str = "finished"


@dataclass
class _Handle:
    """Stands in for a distributed.Actor: only the worker address is read."""

    _address: str


def actor(name: str, worker: str = "tcp://w1") -> Actor:
    return Actor(_Future(name), _Handle(worker))


def parts(source_id: int, source: str, n: int) -> list[LoaderPartition]:
    return [
        LoaderPartition(
            source_id=source_id,
            source=source,
            part=k,
            first_shard=k,
            stop_shard=k + 1,
            first_sample=10 * k,
            stop_sample=10 * k + 10,
        )
        for k in range(n)
    ]


def fleet() -> Fleet:
    """Two sources (one loader each), two constructors made with those routes."""
    f = Fleet("p1", ["web", "code"], [[0], [1]])
    f.set_loaders(0, parts(0, "web", 1), [actor("web-0")])
    f.set_loaders(1, parts(1, "code", 1), [actor("code-0")])
    f.add_constructor(actor("c0"))
    f.add_constructor(actor("c1", "tcp://w2"))
    return f


def test_a_fresh_fleet_is_consistent() -> None:
    f = fleet()
    assert not f.lost() and f.stale() == {} and f.retiring == [] and not f.needs_attention()
    assert f.counts() == {"web": 1, "code": 1}
    assert f.generation == 2 and f.route_generation == {0: 1, 1: 2}
    assert f.route(0).loaders == [f.loaders[0][0].handle]


def test_lost_actors_come_from_future_states() -> None:
    f = fleet()
    f.loaders[1][0].future.status = "error"
    f.constructors[0].future.status = "cancelled"
    lost = f.lost()
    assert lost.loaders == [(1, 0)] and lost.constructors == [0] and lost.count == 2


def test_a_resize_makes_every_live_constructor_stale_until_it_acknowledges() -> None:
    f = fleet()
    old = f.loaders[0]
    f.set_loaders(0, parts(0, "web", 3), [actor(f"web-new-{k}") for k in range(3)])
    gen = f.route_generation[0]
    assert gen == 3 and f.stale() == {0: [0], 1: [0]}
    assert f.take_retirable() == []  # nobody switched yet: the old loader stays open
    f.acknowledge(0, 0, gen)
    assert f.stale() == {1: [0]} and f.take_retirable() == []
    f.acknowledge(1, 0, gen)
    ready = f.take_retirable()
    assert [r.actors for r in ready] == [old] and f.retiring == [] and f.counts()["web"] == 3


def test_a_lost_constructor_neither_needs_a_route_nor_blocks_retirement() -> None:
    f = fleet()
    f.set_loaders(1, parts(1, "code", 2), [actor("code-a"), actor("code-b")])
    f.constructors[1].future.status = "error"
    assert f.stale() == {0: [1]}
    f.acknowledge(0, 1, f.route_generation[1])
    assert len(f.take_retirable()) == 1
    old = f.replace_constructor(1, actor("c1-new"))
    assert old.name == "c1" and f.stale() == {}  # made with the current routes


def test_an_older_acknowledgement_does_not_count_for_a_newer_route() -> None:
    f = fleet()
    f.set_loaders(0, parts(0, "web", 2), [actor("a"), actor("b")])
    first = f.route_generation[0]
    f.set_loaders(0, parts(0, "web", 3), [actor("c"), actor("d"), actor("e")])
    for i in (0, 1):
        f.acknowledge(i, 0, first)
    assert [r.generation for r in f.take_retirable()] == [first]  # the original loader may go...
    assert f.stale() == {0: [0], 1: [0]} and len(f.retiring) == 1  # ...the first replacement may not


def test_a_recreated_loader_bumps_its_source_route() -> None:
    f = fleet()
    f.loaders[0][0].future.status = "error"
    old = f.replace_loader(0, 0, actor("web-0-again", "tcp://w3"))
    assert old.name == "web-0" and f.stale() == {0: [0], 1: [0]} and f.retiring == []
    info = f.serve_info(scheduler="tcp://s", window=2, peers=1, pid=1, started_at=0.0)
    assert [(lo.name, lo.worker) for lo in info.loaders if lo.source == "web"] == [("web-0-again", "tcp://w3")]
    assert [c.worker for c in info.constructors] == ["tcp://w1", "tcp://w2"]
    assert len(f.actors()) == 4


def test_loaders_leaving_the_fleet_keep_their_counters() -> None:
    """A retired loader counts its final metrics (else its last seen); a lost one replaced counts its last seen."""
    from loomdata.schemas.metrics import LoaderMetrics

    f = fleet()
    old = f.loaders[0][0]
    f.last_seen[old.name] = LoaderMetrics(source="web", part=0, tokens=10)
    f.set_loaders(0, parts(0, "web", 2), [actor("web-a"), actor("web-b")])
    (r,) = f.retiring  # what retires once the constructors acknowledge the new route
    f.retired_all([r], {old.name: LoaderMetrics(source="web", part=0, tokens=25)})  # final beats last seen
    assert f.retired["web"].count("tokens") == 25 and f.retired["web"].loaders == 1
    assert old.name not in f.last_seen

    lost = f.loaders[0][1]
    f.last_seen[lost.name] = LoaderMetrics(source="web", part=1, tokens=7)
    assert f.replace_loader(0, 1, actor("web-b2")) is lost
    assert f.retired["web"].count("tokens") == 32 and f.retired["web"].loaders == 2
    f.replace_loader(0, 1, actor("web-b3"))  # lost before any metrics came: a loader, nothing known
    assert (f.retired["web"].loaders, f.retired["web"].unanswered) == (3, 1)
    assert "code" not in f.retired
