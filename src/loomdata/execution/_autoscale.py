"""Autoscaling: loader actors per source follow the plan's demand times the measured per-sample cost.

`plan_loaders` is the pure policy: given per source the samples per step the coming steps need, the
seconds one sample costs a loader, its shard count and its current loaders, it splits a loader budget
in proportion to demand x cost (at least 1 per demanded source, at most one per shard), rounds
deterministically and keeps the current count unless the ideal moved by >= 1 and >= 25% (no flapping).
`Autoscaler` is the controller: a daemon thread in the serving process (like the recovery Watchdog)
that every few seconds reads `Executor.metrics()` and the manifest's coming steps and calls
`Executor.set_loaders` where the policy says so, recording each decision.

Worker loss: a resize may run while actors are lost or being recreated, and a worker may die during
a resize; both go through the executor's one lock and re-routing protocol (see `_executor`), so a
resize never needs to wait for recovery: it replaces the source's loaders (lost ones included) with
new ones on live workers. A round that fails (a worker died mid-call) is recorded in `last_error`
and the next round decides again from the executor's state.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq

from loomdata.schemas.errors import ExecutionError
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.plan import read_manifest

if TYPE_CHECKING:
    from loomdata.execution._executor import Executor

__all__ = ["Autoscaler", "Autoscaling", "SourceLoad", "estimate_costs", "ideal_loaders", "plan_loaders"]

logger = logging.getLogger(__name__)

PRIOR_S_PER_TOKEN = 1e-6
"""Cost prior before any source is measured: only the ratio between sources matters to the policy."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceLoad:
    """What the policy knows of one source: demand (samples/step), cost (s/sample), shards, loaders now."""

    demand: float
    cost_s: float
    shards: int
    current: int

    def __post_init__(self) -> None:
        if self.demand < 0 or self.cost_s < 0 or self.shards < 1 or self.current < 0:
            raise ExecutionError(f"invalid source load {self}: demand and cost must be >= 0, shards >= 1, current >= 0")


def ideal_loaders(loads: Mapping[str, SourceLoad], *, budget: int, step_rate: float | None = None) -> dict[str, float]:
    """Real-valued loaders per demanded source: budget split by demand x cost, each within [1, shards].

    With `step_rate` (steps/s to sustain) the total is only what that rate needs (one loader does one
    busy second per second), capped by `budget`; without it the whole budget is used.
    """
    if budget < 1:
        raise ExecutionError(f"the loader budget must be >= 1, got {budget}")
    active = {s: ld for s, ld in loads.items() if ld.demand > 0}
    if not active:
        return {}
    weight = {s: ld.demand * ld.cost_s for s, ld in active.items()}
    total = float(budget)
    if step_rate is not None:
        if step_rate < 0:
            raise ExecutionError(f"the target step rate must be >= 0 steps/s, got {step_rate}")
        total = min(total, sum(weight.values()) * step_rate)
    total = min(max(total, float(len(active))), float(sum(ld.shards for ld in active.values())))
    ideal: dict[str, float] = {}
    free = dict(weight)
    left = total
    while free:  # water-filling: fix the sources that hit a bound, share the rest among the others
        wsum = sum(free.values())
        share = {s: (left * w / wsum if wsum > 0 else left / len(free)) for s, w in free.items()}
        over = [s for s, v in share.items() if v > active[s].shards]
        under = [s for s, v in share.items() if v < 1.0]
        fixed = {s: float(active[s].shards) for s in over} if over else {s: 1.0 for s in under}
        if not fixed:
            ideal.update(share)
            break
        for s, v in fixed.items():
            ideal[s] = v
            left -= v
            del free[s]
    return ideal


def plan_loaders(
    loads: Mapping[str, SourceLoad],
    *,
    budget: int,
    step_rate: float | None = None,
    min_change: float = 0.25,
) -> dict[str, int]:
    """Loaders per source: the ideal rounded (largest remainder, ties by name), kept unless it moved enough.

    A source keeps its current count unless |ideal - current| >= 1 and >= `min_change` x current.
    Sources without demand keep theirs (a loader is cheap; the schedule may come back to them). If kept
    counts would exceed the budget, sources that should shrink shrink anyway.
    """
    ideal = ideal_loaders(loads, budget=budget, step_rate=step_rate)
    target = {s: math.floor(v) for s, v in ideal.items()}
    units = round(sum(ideal.values())) - sum(target.values())
    by_remainder = sorted(ideal, key=lambda s: (-(ideal[s] - target[s]), s))
    for s in by_remainder:
        if units <= 0:
            break
        if target[s] < loads[s].shards:
            target[s] += 1
            units -= 1
    out = {s: ld.current for s, ld in loads.items()}
    for s, v in ideal.items():
        cur = loads[s].current
        if cur == 0 or (abs(v - cur) >= 1.0 and abs(v - cur) >= min_change * cur):
            out[s] = target[s]
    if sum(out[s] for s in ideal) > max(budget, len(ideal)):
        for s in ideal:
            out[s] = min(out[s], target[s])
    return out


def estimate_costs(
    measured: Mapping[str, tuple[int, float]], tokens_per_sample: Mapping[str, float]
) -> dict[str, float]:
    """Seconds per sample per source: busy_s / samples where measured, else a per-token prior.

    `measured` maps source -> (samples, busy_s). The prior for an unmeasured source is its tokens per
    sample times the measured sources' mean seconds per token (or PRIOR_S_PER_TOKEN before any), so
    measured and unmeasured sources stay on one scale.
    """
    per_token = [
        busy / (n * tokens_per_sample[s])
        for s, (n, busy) in measured.items()
        if n > 0 and busy > 0 and tokens_per_sample.get(s, 0) > 0
    ]
    s_per_token = float(np.mean(per_token)) if per_token else PRIOR_S_PER_TOKEN
    out: dict[str, float] = {}
    for s, tps in tokens_per_sample.items():
        n, busy = measured.get(s, (0, 0.0))
        out[s] = busy / n if n > 0 and busy > 0 else s_per_token * max(tps, 1.0)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Autoscaling:
    """Controller settings: period, how many coming steps set the demand, budget, target rate, hysteresis."""

    every_s: float = 5.0
    horizon_steps: int = 32
    budget: int | None = None  # default: loaders_per_thread x the cluster's worker threads
    loaders_per_thread: int = 2
    step_rate: float | None = None  # steps/s to sustain; None: use the whole budget
    min_change: float = 0.25

    def __post_init__(self) -> None:
        if self.every_s <= 0 or self.horizon_steps < 1 or self.loaders_per_thread < 1 or self.min_change < 0:
            raise ExecutionError(
                f"invalid autoscaling settings {self}: every_s > 0, horizon_steps >= 1, "
                "loaders_per_thread >= 1 and min_change >= 0 are required"
            )
        if self.budget is not None and self.budget < 1:
            raise ExecutionError(f"autoscaling budget must be >= 1 loader, got {self.budget}")


class Autoscaler:
    """Every `every_s`, sets each source's loader count to what `plan_loaders` says (daemon thread)."""

    def __init__(self, executor: Executor, settings: Autoscaling | None = None, *, name: str = "loom-autoscale"):
        self._ex = executor
        self.settings = settings or Autoscaling()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._costs: dict[str, tuple[int, float]] = {}  # last measurement per source (loaders reset on resize)
        self._shards = {s: _shard_count(executor, s) for s in executor.meta.sources}
        self.decisions: list[dict[str, Any]] = []
        self.rounds = 0
        self.last: dict[str, Any] = {}
        self.last_error: str | None = None

    def start(self) -> Autoscaler:
        """Start the control loop; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the loop and wait for a resize in progress to finish."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def report(self) -> dict[str, Any]:
        """Decisions so far and the inputs of the last round, for `Executor.metrics()["autoscale"]`."""
        with self._lock:
            return {
                "enabled": True,
                "rounds": self.rounds,
                "decisions": list(self.decisions),
                "last": dict(self.last),
                "last_error": self.last_error,
            }

    def step_once(self) -> list[dict[str, Any]]:
        """One control round: measure, decide, resize (shrinks first, to stay within budget); returns decisions."""
        ex = self._ex
        m = ex.metrics()
        step = _current_step(m, ex.meta.steps)
        demand, tokens = _demand(ex, step, self.settings.horizon_steps)
        for s, v in m["sources"].items():
            if v["samples"] > 0 and v["busy_s"] > 0:
                self._costs[s] = (int(v["samples"]), float(v["busy_s"]))
        costs = estimate_costs(self._costs, tokens)
        current = ex.loader_counts()  # the executor's own count: a lost loader being recreated counts too
        loads = {
            s: SourceLoad(demand=demand[s], cost_s=costs[s], shards=self._shards[s], current=current[s])
            for s in ex.meta.sources
        }
        budget = self.settings.budget or self.settings.loaders_per_thread * _threads(ex)
        rate, hold = self.settings.step_rate, self.settings.min_change
        want = plan_loaders(loads, budget=budget, step_rate=rate, min_change=hold)
        ideal = ideal_loaders(loads, budget=budget, step_rate=rate)
        done: list[dict[str, Any]] = []
        for s in sorted(want, key=lambda s: (want[s] - current[s], s)):  # shrink first
            if want[s] == current[s]:
                continue
            new = ex.set_loaders(s, want[s])
            why = (
                f"steps {step}..{step + self.settings.horizon_steps - 1}: {demand[s]:.2f} samples/step x "
                f"{costs[s] * 1e3:.3f} ms/sample, ideal {ideal.get(s, 0.0):.2f} of budget {budget}"
            )
            done.append({"time": time.time(), "step": step, "source": s, "old": current[s], "new": new, "why": why})
            logger.info("autoscale %s: %d -> %d loaders (%s)", s, current[s], new, why)
        with self._lock:
            self.rounds += 1
            self.decisions.extend(done)
            self.last = {
                "time": time.time(),
                "step": step,
                "budget": budget,
                "demand": {s: round(v, 3) for s, v in demand.items()},
                "cost_ms": {s: round(v * 1e3, 4) for s, v in costs.items()},
                "ideal": {s: round(v, 2) for s, v in ideal.items()},
            }
        return done

    def _run(self) -> None:
        while not self._stop.wait(self.settings.every_s):
            try:
                self.step_once()
            except Exception as e:  # a worker died mid-resize, the executor is stopping...: try next round
                self.last_error = f"{type(e).__name__}: {e}"
                logger.warning("loomdata autoscaling round failed (will retry): %s", self.last_error)


def _current_step(metrics: Mapping[str, Any], steps: int) -> int:
    """The first step some rank has not taken yet (the consumers' position), from the constructors."""
    wants = [int(w) for c in metrics["constructors"] for w in c["want"].values()]
    return min(min(wants, default=0), max(steps - 1, 0))


def _demand(ex: Executor, step: int, horizon: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per source: segments per step over steps [step, step + horizon), and mean tokens per segment."""
    t = read_manifest(ex.plan_dir, ex.meta, step, min(step + horizon, ex.meta.steps) - 1)
    src = t.column("source").to_numpy()
    length = t.column("length").to_numpy()
    n_steps = max(1, min(horizon, ex.meta.steps - step))
    demand: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for sid, name in enumerate(ex.meta.sources):
        sel = src == sid
        demand[name] = float(np.count_nonzero(sel)) / n_steps
        tokens[name] = float(length[sel].mean()) if sel.any() else 1.0
    return demand, tokens


def _shard_count(ex: Executor, source: str) -> int:
    """Non-empty shards of a source (a loader partition needs at least one)."""
    files = IndexFiles.of(ex.spec.workdir, source)
    shards = pq.read_table(str(files.samples), columns=["shard"]).column("shard").to_numpy()
    return max(1, len(np.unique(shards)))


def _threads(ex: Executor) -> int:
    """Worker threads of the cluster now."""
    workers = ex.client.scheduler_info()["workers"]
    return max(1, sum(int(w.get("nthreads", 1)) for w in workers.values()))
