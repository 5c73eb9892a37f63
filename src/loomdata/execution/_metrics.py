"""Gathering the fleet's metrics without blocking anyone: calls issued at once, answers collected by deadline.

`FleetView` is what the control loop publishes after every change (a frozen snapshot: handles and
the ServeInfo), so any thread can ask the actors for their metrics without a lock and without
waiting for the loop. `MetricsGather` issues every actor's `metrics()` call at once; the loop polls
`ready()` between its other duties (an autoscale round never delays recovery), a caller just
`collect()`s. An actor lost with its worker is left out rather than failing the report.

Counters survive the loaders: a loader leaving the fleet (resized away, or lost and recreated) adds its
counters to its source's `RetiredLoaders` (`Fleet.count_retired`: its final metrics asked once closed,
`final_metrics`; a lost one's last answer, which every gather keeps in `Fleet.last_seen`). A view
carries the retired counters of its moment, so a report sums each loader once: live in one view,
retired in the next; a loader of the view found lost (not yet recreated) counts its last answer as a
retired one in that report, so its source's counters do not dip while recovery replaces it; so do the
replaced loaders of the view still waiting to retire (`FleetView.retiring`: their answers, else their last).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loomdata.execution._fleet import Actor, Fleet, worker_of
from loomdata.execution._outcome import Call, issue
from loomdata.execution._recovery import RecoveryStats
from loomdata.execution._retry import Deadline
from loomdata.execution.protocol import ServeInfo
from loomdata.schemas.metrics import (
    AutoscaleReport,
    ConstructorMetrics,
    ExecutorMetrics,
    LoaderMetrics,
    LoaderReport,
    RecoveryReport,
    RetiredLoaders,
)

__all__ = [
    "METRICS_IN_FLIGHT",
    "FleetView",
    "Gathered",
    "MetricsGather",
    "current_step",
    "final_metrics",
    "measured_costs",
    "summarize",
]


@dataclass(frozen=True, slots=True)
class FleetView:
    """A snapshot of the fleet for other threads: loaders (source id, actor), constructors, counts, ServeInfo,
    the retired loaders' counters then; `last_seen` is the fleet's own map (each gather updates it); `retiring`
    the replaced loaders not retired yet (source id, actor): counted with the retired, neither live nor in `retired`."""

    loaders: tuple[tuple[int, Actor], ...] = ()
    constructors: tuple[Actor, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)
    info: ServeInfo | None = None
    retired: Mapping[str, RetiredLoaders] = field(default_factory=dict)
    last_seen: dict[str, LoaderMetrics] = field(default_factory=dict)
    retiring: tuple[tuple[int, Actor], ...] = ()

    @staticmethod
    def of(fleet: Fleet, info: ServeInfo | None) -> FleetView:
        return FleetView(
            loaders=tuple((sid, a) for sid, actors in fleet.loaders.items() for a in actors),
            constructors=tuple(fleet.constructors),
            counts=fleet.counts(),
            info=info,
            retired=dict(fleet.retired),  # immutable values: a copy of the map is a snapshot
            last_seen=fleet.last_seen,
            retiring=tuple((r.source_id, a) for r in fleet.retiring for a in r.actors),
        )


@dataclass(frozen=True, slots=True)
class Gathered:
    """The answers that came: per loader (source id, worker, metrics), per constructor; lost actors left out; the
    view's retired loaders' counters per source."""

    loaders: list[LoaderReport]
    constructors: list[ConstructorMetrics]
    retired: Mapping[str, RetiredLoaders] = field(default_factory=dict)


METRICS_IN_FLIGHT = 32
"""Loader `metrics()` calls in flight at once: each concurrent actor call opens a connection, and 300
sources' loaders asked at once are a burst of connections and event-loop turns on the workers (where
constructors answer takes); the rest are issued as answers come."""

_WAIT_S = 0.005  # while waiting in `collect` for a loader call to finish before issuing the next ones


class MetricsGather:
    """`metrics()` calls to every actor of a view, at most `in_flight` loaders' at once; answers by
    `timeout_s` or left out (a loader not asked by then is left out as a lost one is)."""

    def __init__(self, view: FleetView, timeout_s: float, in_flight: int = METRICS_IN_FLIGHT) -> None:
        if in_flight < 1:
            raise ValueError(f"MetricsGather in_flight must be >= 1, got {in_flight!r}")
        self._deadline = Deadline(timeout_s)
        self._retired = view.retired
        self._last_seen = view.last_seen
        self._seen = dict(view.last_seen)  # as it was: the loop may move a lost loader's entry to `retired` meanwhile
        self._retiring = {a.name for _, a in view.retiring}
        self._in_flight = in_flight
        self._todo: deque[tuple[int, Actor]] = deque((*view.loaders, *view.retiring))
        self._loaders: list[tuple[int, Actor, Call[Any]]] = []
        self._constructors: list[Call[Any]] = [issue(a.future, a.handle, "metrics") for a in view.constructors]
        self._top_up()

    @property
    def issued(self) -> int:
        """Loader calls issued so far."""
        return len(self._loaders)

    def _top_up(self) -> int:
        """Issue loader calls until `in_flight` are pending (or none is left to ask); how many are pending."""
        pending = sum(1 for _, _, c in self._loaders if not c.done())
        while self._todo and pending < self._in_flight and not self._deadline.expired:
            sid, a = self._todo.popleft()
            call: Call[Any] = issue(a.future, a.handle, "metrics")
            self._loaders.append((sid, a, call))
            pending += not call.done()
        return pending

    def ready(self) -> bool:
        """Every answer is in (or sorted as lost/refused), or the deadline passed; issues calls as earlier ones end."""
        self._top_up()
        calls = [c for _, _, c in self._loaders] + self._constructors
        return self._deadline.expired or (not self._todo and all(c.done() for c in calls))

    def collect(self) -> Gathered:
        """Wait (until the deadline at most) and return the answers that came."""
        while self._todo and not self._deadline.expired:
            if self._top_up() >= self._in_flight:
                time.sleep(_WAIT_S)
        loaders, retired = [], dict(self._retired)
        for sid, a, call in self._loaders:
            out = call.outcome(timeout=self._deadline.left)
            m = out.value if out.ok and isinstance(out.value, LoaderMetrics) else None
            if m is not None:
                self._last_seen[a.name] = m  # one item set (atomic): what counts if the loader is lost
                if a.name not in self._retiring:
                    loaders.append(LoaderReport(source_id=sid, worker=worker_of(a.handle), metrics=m))
                    continue
            elif a.lost or a.name in self._retiring:  # lost, not yet recreated; or waiting to retire
                m = self._last_seen.get(a.name) or self._seen.get(a.name)
            if m is not None:
                retired[m.source] = retired.get(m.source, RetiredLoaders(source=m.source)).add(m)
        cons = [c.outcome(timeout=self._deadline.left) for c in self._constructors]
        got = [o.value for o in cons if o.ok and isinstance(o.value, ConstructorMetrics)]
        return Gathered(loaders, got, retired)


def final_metrics(actors: list[Actor], timeout_s: float) -> dict[str, LoaderMetrics]:
    """Per actor name, the metrics of closed loaders (final: a closed loader reads no more); a lost one or one that
    did not answer in `timeout_s` is left out (`Fleet.count_retired` then counts its last answer)."""
    calls = [(a, issue(a.future, a.handle, "metrics")) for a in actors if not a.lost]
    deadline = Deadline(timeout_s)
    out = {}
    for a, call in calls:
        got = call.outcome(timeout=deadline.left)
        if got.ok and isinstance(got.value, LoaderMetrics):
            out[a.name] = got.value
    return out


def measured_costs(g: Gathered) -> dict[str, tuple[int, float]]:
    """Per source name: (samples read, busy seconds) summed over its loaders that answered."""
    out: dict[str, tuple[int, float]] = {}
    for lo in g.loaders:
        n, busy = out.get(lo.metrics.source, (0, 0.0))
        out[lo.metrics.source] = (n + lo.metrics.samples, busy + lo.metrics.busy_s)
    return out


def current_step(g: Gathered, steps: int) -> int:
    """The first step some rank has not taken yet (the consumers' position), from the constructors."""
    wants = [w for c in g.constructors for w in c.want.values()]
    return min(min(wants, default=0), max(steps - 1, 0))


def summarize(
    plan_id: str, g: Gathered, *, recovery: RecoveryStats, autoscale: AutoscaleReport | None
) -> ExecutorMetrics:
    """The executor's metrics (see `Executor.metrics`)."""
    return ExecutorMetrics(
        plan_id=plan_id,
        loaders=tuple(g.loaders),
        constructors=tuple(g.constructors),
        recovery=RecoveryReport(
            recovered=recovery.recovered,
            rounds=recovery.rounds,
            seconds=recovery.seconds,
            last_s=recovery.last_s,
            failures=recovery.failures,
            last_error=recovery.last_error,
        ),
        autoscale=autoscale or AutoscaleReport(enabled=False),
        retired=dict(g.retired),
    )
