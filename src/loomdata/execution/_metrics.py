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

from loomdata.execution._dask import actor_worker
from loomdata.execution._fleet import Actor, Fleet
from loomdata.execution._outcome import Call, issue
from loomdata.execution._retry import Deadline
from loomdata.execution.protocol import ServeInfo

__all__ = ["FleetView", "Gathered", "MetricsGather", "current_step", "measured_costs"]


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
    """The answers: per loader (source id, worker, metrics), per constructor metrics; lost actors left out."""

    loaders: list[tuple[int, str, dict[str, Any]]]
    constructors: list[dict[str, Any]]


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
            if out.ok and out.value is not None:
                loaders.append((sid, actor_worker(a.handle), dict(out.value)))
        cons = [
            dict(o.value)
            for o in (c.outcome(timeout=self._deadline.left) for c in self._constructors)
            if o.ok and o.value
        ]
        return Gathered(loaders=loaders, constructors=cons)


def measured_costs(g: Gathered) -> dict[str, tuple[int, float]]:
    """Per source name: (samples read, busy seconds) summed over its loaders that answered."""
    out: dict[str, tuple[int, float]] = {}
    for _, _, m in g.loaders:
        n, busy = out.get(m["source"], (0, 0.0))
        out[m["source"]] = (n + int(m["samples"]), busy + float(m["busy_s"]))
    return out


def current_step(g: Gathered, steps: int) -> int:
    """The first step some rank has not taken yet (the consumers' position), from the constructors."""
    wants = [int(w) for c in g.constructors for w in c["want"].values()]
    return min(min(wants, default=0), max(steps - 1, 0))


def summarize(
    plan_id: str, g: Gathered, *, recovered: int, recovery_s: float, autoscale: dict[str, Any]
) -> dict[str, Any]:
    """The executor's metrics report (see `Executor.metrics`)."""
    loaders = [dict(m, source_id=sid) for sid, _, m in g.loaders]
    rss_by_worker = {w: m["rss_bytes"] for _, w, m in g.loaders}
    sources: dict[str, dict[str, Any]] = {}
    for m in loaders:
        s = sources.setdefault(m["source"], {"loaders": 0, "samples": 0, "tokens": 0, "busy_s": 0.0, "rate": 0.0})
        s["loaders"] += 1
        s["samples"] += m["samples"]
        s["tokens"] += m["tokens"]
        s["busy_s"] += m["busy_s"]
        s["rate"] += m["samples_per_s"] or 0.0
    wait: dict[str, float] = {}
    for c in g.constructors:
        wait.update(c["rank_wait_s"])
    return {
        "plan_id": plan_id,
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
        "queue_depth": sum(c["queue_depth"] for c in g.constructors),
        "rank_wait_s": wait,
        "constructors": g.constructors,
        "loaders": loaders,
        "recovered_actors": recovered,
        "recovery_s": round(recovery_s, 3),
        "autoscale": autoscale,
    }
