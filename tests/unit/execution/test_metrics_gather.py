"""Gathering loader metrics: at most `in_flight` calls at once, every loader asked, answers kept in order."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from loomdata.execution._fleet import Actor
from loomdata.execution._metrics import FleetView, MetricsGather
from loomdata.schemas.metrics import LoaderMetrics, RetiredLoaders


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
