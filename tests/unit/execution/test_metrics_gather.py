"""Gathering loader metrics: at most `in_flight` calls at once, every loader asked, answers kept in order."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from loomdata.execution._fleet import Actor, Fleet
from loomdata.execution._metrics import FleetView, MetricsGather
from loomdata.execution._partition import LoaderPartition
from loomdata.schemas.metrics import ExecutorMetrics, LoaderMetrics, RetiredLoaders


class _Loader:
    """A loader handle whose `metrics()` answers when the test says (or at once with `now`)."""

    def __init__(self, part: int, now: bool) -> None:
        self.part, self.now, self.calls = part, now, []

    def metrics(self) -> Future[LoaderMetrics]:
        fut: Future[LoaderMetrics] = Future()
        self.calls.append(fut)
        if self.now:
            self.answer()
        return fut

    def answer(self) -> None:
        self.calls[-1].set_result(LoaderMetrics(source="s", part=self.part, samples=self.part))


@dataclass
class _Future:
    """Stands in for a distributed.Future of an actor task: `key` and `status` are read."""

    key: str
    status: str = "finished"


def _view(loaders: list[_Loader]) -> FleetView:
    return FleetView(loaders=tuple((0, Actor(future=_Future(f"l{h.part}"), handle=h)) for h in loaders))


def test_no_more_than_in_flight_calls_and_the_rest_as_answers_come() -> None:
    loaders = [_Loader(i, now=False) for i in range(20)]
    g = MetricsGather(_view(loaders), timeout_s=30, in_flight=4)
    assert g.issued == 4 and not g.ready()
    loaders[0].answer()
    loaders[2].answer()
    assert not g.ready() and g.issued == 6  # two finished: two more asked, still 4 pending
    for lo in loaders:
        while not lo.calls:  # answer each as it is asked, in order
            g.ready()
        if not lo.calls[-1].done():
            lo.answer()
    assert g.ready() and g.issued == 20
    got = g.collect()
    assert [r.metrics.part for r in got.loaders] == list(range(20))


def test_collect_asks_every_loader() -> None:
    loaders = [_Loader(i, now=True) for i in range(50)]
    got = MetricsGather(_view(loaders), timeout_s=30, in_flight=8).collect()
    assert [r.metrics.samples for r in got.loaders] == list(range(50)) and all(len(lo.calls) == 1 for lo in loaders)


def test_in_flight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="in_flight must be >= 1"):
        MetricsGather(_view([]), timeout_s=1, in_flight=0)


def test_a_lost_loader_counts_its_last_answer_until_it_is_recreated() -> None:
    """Each answer is kept as the loader's last seen; a loader of the view found lost adds it to the report's retired
    counters (beside the view's own), so its source's totals do not dip before recovery replaces it."""
    loaders = [_Loader(i, now=True) for i in (3, 5)]
    view = _view(loaders)
    view = FleetView(
        loaders=view.loaders,
        retired={"s": RetiredLoaders(source="s").add(LoaderMetrics(source="s", part=0, samples=7))},
        last_seen={},
    )
    first = MetricsGather(view, timeout_s=30).collect()
    assert set(view.last_seen) == {"l3", "l5"} and first.retired["s"].count("samples") == 7
    view.loaders[1][1].future.status = "error"  # its worker died: the handle refuses calls
    loaders[1].metrics = None  # type: ignore[assignment,method-assign]
    got = MetricsGather(view, timeout_s=30).collect()
    assert [r.metrics.part for r in got.loaders] == [3]
    assert got.retired["s"].count("samples") == 7 + 5 and got.retired["s"].loaders == 2
    assert view.retired["s"].loaders == 1  # the view's own snapshot is unchanged


def _fleet(loaders: list[_Loader]) -> Fleet:
    """One source "s" served by `loaders` (actor names l<part>), no constructors."""
    f = Fleet("p", ["s"], [[0]])
    _resize(f, loaders)
    return f


def _resize(f: Fleet, loaders: list[_Loader]) -> None:
    """The source switched to `loaders` (a resize): the loaders it had wait in `retiring`."""
    parts = [
        LoaderPartition(source_id=0, source="s", part=k, first_shard=k, stop_shard=k + 1, first_sample=0, stop_sample=1)
        for k in range(len(loaders))
    ]
    f.set_loaders(0, parts, [Actor(_Future(f"l{h.part}"), h) for h in loaders])


def _samples(f: Fleet, g: MetricsGather) -> int:
    got = g.collect()
    return ExecutorMetrics(plan_id="p", loaders=tuple(got.loaders), retired=dict(got.retired)).sources["s"].samples


def test_loaders_waiting_to_retire_still_count() -> None:
    """A resize switches the route at once but the old loaders retire only once every constructor acknowledged it
    (a constructor that did not answer keeps them waiting until a recovery round): a report meanwhile counts them,
    as retired ones, rather than in neither the live loaders nor the retired counters."""
    f = _fleet([_Loader(3, now=True), _Loader(5, now=True)])
    assert _samples(f, MetricsGather(FleetView.of(f, None), timeout_s=30)) == 8
    _resize(f, [_Loader(7, now=True)])
    got = MetricsGather(FleetView.of(f, None), timeout_s=30).collect()
    assert [r.metrics.part for r in got.loaders] == [7]  # live rows: the new loader only
    assert _samples(f, MetricsGather(FleetView.of(f, None), timeout_s=30)) == 3 + 5 + 7
    f.retiring[0].actors[1].future.status = "error"  # lost while waiting: its last answer counts
    f.retiring[0].actors[1].handle.metrics = None
    assert _samples(f, MetricsGather(FleetView.of(f, None), timeout_s=30)) == 3 + 5 + 7
    f.retired_all(f.take_retirable(), {})  # no constructor left to wait for: they retire
    assert f.retiring == [] and _samples(f, MetricsGather(FleetView.of(f, None), timeout_s=30)) == 3 + 5 + 7


def test_a_lost_loader_replaced_while_a_gather_runs_counts_once() -> None:
    """The loop may replace a lost loader (moving its last answer from `last_seen` to the retired counters) while a
    gather made from the view before is collecting: that gather still counts the lost loader's last answer."""
    lost = _Loader(5, now=True)
    f = _fleet([_Loader(3, now=True), lost])
    assert _samples(f, MetricsGather(FleetView.of(f, None), timeout_s=30)) == 8
    view = FleetView.of(f, None)
    view.loaders[1][1].future.status = "error"  # its worker died: the handle refuses calls
    lost.metrics = None  # type: ignore[assignment,method-assign]
    g = MetricsGather(view, timeout_s=30)
    f.replace_loader(0, 1, Actor(_Future("l5-again"), _Loader(0, now=True)))  # the loop's recovery, meanwhile
    assert _samples(f, g) == 3 + 5
    assert _samples(f, MetricsGather(FleetView.of(f, None), timeout_s=30)) == 3 + 5  # then once, as retired
    assert f.retired["s"].loaders == 1


def test_an_answer_after_its_loader_retired_is_not_kept() -> None:
    """A gather made before a resize may receive a retired loader's answer after the fleet counted it (and dropped
    its `last_seen`): that entry is dropped at the fleet's next change, so `last_seen` holds no more than the fleet's
    loaders (else one entry per retired loader, for the life of the serve)."""
    slow = _Loader(3, now=False)
    f = _fleet([slow])
    g = MetricsGather(FleetView.of(f, None), timeout_s=30)
    _resize(f, [_Loader(5, now=True)])
    f.retired_all(f.take_retirable(), {})
    slow.answer()
    g.collect()
    assert "l3" in f.last_seen  # written by the gather after the retirement
    _resize(f, [_Loader(7, now=True)])
    f.retired_all(f.take_retirable(), {})
    assert set(f.last_seen) <= {a.name for actors in f.loaders.values() for a in actors}
    assert f.retired["s"].loaders == 2
