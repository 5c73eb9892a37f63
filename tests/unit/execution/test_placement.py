"""Constructor placement: beside the fewest constructors, then the fewest samples its worker's loaders serve."""

from __future__ import annotations

from loomdata.execution._actors import constructor_workers
from loomdata.execution._fleet import Fleet
from loomdata.execution._partition import LoaderPartition

from .test_fleet import actor


def _part(source_id: int, samples: int) -> LoaderPartition:
    return LoaderPartition(
        source_id=source_id,
        source=f"s{source_id}",
        part=0,
        first_shard=0,
        stop_shard=1,
        first_sample=0,
        stop_sample=samples,
    )


def _fleet(loaders: dict[int, tuple[int, str]], constructors: list[str]) -> Fleet:
    fleet = Fleet("p", [f"s{i}" for i in loaders], [[0], [1]])
    for sid, (samples, worker) in loaders.items():
        fleet.set_loaders(sid, [_part(sid, samples)], [actor(f"l{sid}", worker)])
    for k, w in enumerate(constructors):
        fleet.add_constructor(actor(f"c{k}", w))
    return fleet


def test_a_constructor_goes_beside_the_loaders_with_fewer_samples() -> None:
    fleet = _fleet({0: (48_000, "tcp://a"), 1: (12_000, "tcp://b")}, [])
    assert constructor_workers(["tcp://a", "tcp://b"], fleet, 1) == ["tcp://b"]


def test_constructors_spread_first_then_follow_samples() -> None:
    fleet = _fleet({0: (48_000, "tcp://a"), 1: (12_000, "tcp://b")}, [])
    assert constructor_workers(["tcp://b", "tcp://a"], fleet, 3) == ["tcp://b", "tcp://a", "tcp://b"]


def test_a_recreated_constructor_skips_a_worker_holding_one_and_ignores_dead_workers() -> None:
    fleet = _fleet({0: (10, "tcp://a"), 1: (10, "tcp://gone")}, ["tcp://a", "tcp://gone"])
    assert constructor_workers(["tcp://a", "tcp://c"], fleet, 1) == ["tcp://c"]
    assert constructor_workers([], fleet, 2) == [None, None]


def test_lost_actors_on_a_reused_address_are_not_counted() -> None:
    fleet = _fleet({0: (48_000, "tcp://a"), 1: (12_000, "tcp://b")}, ["tcp://b"])
    fleet.constructors[0].future.status = "lost"  # its worker restarted on the same address
    fleet.loaders[1][0].future.status = "lost"
    assert constructor_workers(["tcp://a", "tcp://b"], fleet, 1) == ["tcp://b"]
