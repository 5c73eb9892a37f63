"""The control loop's published view follows every change of the fleet, a recovery round's retirements included."""

from __future__ import annotations

from dataclasses import dataclass, field

from loomdata.execution._config import ServeConfig
from loomdata.execution._fleet import Actor, Fleet
from loomdata.execution._loop import ControlLoop
from loomdata.execution._partition import LoaderPartition
from loomdata.schemas.metrics import LoaderMetrics


@dataclass
class _Future:
    """Stands in for a distributed.Future of an actor task: `key` and `status` are read."""

    key: str
    status: str = "finished"


def _parts(n: int) -> list[LoaderPartition]:
    return [
        LoaderPartition(source_id=0, source="s", part=k, first_shard=k, stop_shard=k + 1, first_sample=0, stop_sample=1)
        for k in range(n)
    ]


@dataclass
class _Ops:
    """The part of `FleetOps` the loop reads, over a real `Fleet`; its recovery round does what `replace_lost` does
    when nothing is lost but replaced loaders wait: retire the ones no constructor routes to (a lost constructor's
    acknowledgement is not awaited), with their final metrics."""

    fleet: Fleet
    final: dict[str, LoaderMetrics]
    config: ServeConfig = field(default_factory=ServeConfig)
    info: None = None

    def replace_lost(self) -> int:
        self.fleet.retired_all(self.fleet.take_retirable(), self.final)
        return 0  # no actor recreated


def test_a_recovery_round_that_only_retires_publishes_the_retired_counters() -> None:
    """A resize whose old loaders wait (a constructor had not acknowledged the new route) leaves their retirement to
    a recovery round that recreates nothing: the view must carry their counters from then on, else every report
    misses them until some other change publishes."""
    f = Fleet("p", ["s"], [[0]])
    f.set_loaders(0, _parts(2), [Actor(_Future("old-0"), None), Actor(_Future("old-1"), None)])
    f.add_constructor(Actor(_Future("c0"), None))
    f.set_loaders(0, _parts(1), [Actor(_Future("new-0"), None)])
    final = {n: LoaderMetrics(source="s", part=0, samples=10) for n in ("old-0", "old-1")}
    loop = ControlLoop(_Ops(f, final), None, name="test-loop")  # not started: its round is called here
    assert [a.name for _, a in loop.view.retiring] == ["old-0", "old-1"] and "s" not in loop.view.retired
    f.constructors[0].future.status = "error"  # the constructor that held them back is lost: they may retire
    loop.recover_round()
    assert f.retiring == [] and f.retired["s"].count("samples") == 20
    assert loop.view.retiring == () and loop.view.retired["s"].count("samples") == 20
