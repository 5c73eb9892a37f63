"""Gathering the fleet's metrics without blocking anyone: calls issued at once, answers collected by deadline.

`FleetView` is what the control loop publishes after every change (a frozen snapshot: handles and
the ServeInfo), so any thread can ask the actors for their metrics without a lock and without
waiting for the loop. `MetricsGather` issues every actor's `metrics()` call at once; the loop polls
`ready()` between its other duties (an autoscale round never delays recovery), a caller just
`collect()`s. An actor lost with its worker is left out rather than failing the report.
"""

from __future__ import annotations

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
)

__all__ = ["FleetView", "Gathered", "MetricsGather", "current_step", "measured_costs", "summarize"]


@dataclass(frozen=True, slots=True)
class FleetView:
    """A snapshot of the fleet for other threads: loaders (source id, actor), constructors, counts, ServeInfo."""

    loaders: tuple[tuple[int, Actor], ...] = ()
    constructors: tuple[Actor, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)
    info: ServeInfo | None = None

    @staticmethod
    def of(fleet: Fleet, info: ServeInfo | None) -> FleetView:
        return FleetView(
            loaders=tuple((sid, a) for sid, actors in fleet.loaders.items() for a in actors),
            constructors=tuple(fleet.constructors),
            counts=fleet.counts(),
            info=info,
        )


@dataclass(frozen=True, slots=True)
class Gathered:
    """The answers that came: per loader (source id, worker, metrics), per constructor; lost actors left out."""

    loaders: list[LoaderReport]
    constructors: list[ConstructorMetrics]


class MetricsGather:
    """`metrics()` calls to every actor of a view, in flight; answers by `timeout_s` or left out."""

    def __init__(self, view: FleetView, timeout_s: float) -> None:
        self._deadline = Deadline(timeout_s)
        self._loaders: list[tuple[int, Actor, Call[Any]]] = [
            (sid, a, issue(a.future, a.handle, "metrics")) for sid, a in view.loaders
        ]
        self._constructors: list[Call[Any]] = [issue(a.future, a.handle, "metrics") for a in view.constructors]

    def ready(self) -> bool:
        """Every answer is in (or sorted as lost/refused), or the deadline passed."""
        calls = [c for _, _, c in self._loaders] + self._constructors
        return self._deadline.expired or all(c.done() for c in calls)

    def collect(self) -> Gathered:
        """Wait (until the deadline at most) and return the answers that came."""
        loaders = []
        for sid, a, call in self._loaders:
            out = call.outcome(timeout=self._deadline.left)
            if out.ok and isinstance(out.value, LoaderMetrics):
                loaders.append(LoaderReport(source_id=sid, worker=worker_of(a.handle), metrics=out.value))
        cons = [c.outcome(timeout=self._deadline.left) for c in self._constructors]
        return Gathered(loaders, [o.value for o in cons if o.ok and isinstance(o.value, ConstructorMetrics)])


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
    )
