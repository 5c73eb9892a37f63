"""Autoscaling: loader actors per source follow the plan's demand times the measured per-sample cost.

`plan_loaders` is the pure policy: given per source the samples per step the coming steps need, the
seconds one sample costs a loader, its shard count and its current loaders, it splits a loader budget
in proportion to demand x cost (at least 1 per demanded source, at most one per shard), rounds
deterministically and keeps the current count unless the ideal moved by >= 1 and >= 25% (no flapping).
`Autoscaler` turns one round's plain inputs (measured samples and busy seconds per source, the
consumers' step, the current counts, the cluster's threads) and the manifest's coming steps into
resizes, and records each decision. It knows nothing of the executor: the control loop (`_loop`)
gathers the inputs, applies the resizes through the fleet's one re-routing protocol (`_actors`),
and a round that fails (a worker died mid-call) is recorded in `last_error`; the next decides again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loomdata.execution._config import Autoscaling
from loomdata.schemas.metrics import AutoscaleDecision, AutoscaleReport, AutoscaleRound
from loomdata.schemas.plan import PlanMeta, read_manifest

__all__ = ["Autoscaler", "Autoscaling", "Resize", "SourceLoad", "estimate_costs", "ideal_loaders", "plan_loaders"]

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
            raise ValueError(f"invalid source load {self}: demand and cost must be >= 0, shards >= 1, current >= 0")


def ideal_loaders(loads: Mapping[str, SourceLoad], *, budget: int, step_rate: float | None = None) -> dict[str, float]:
    """Real-valued loaders per demanded source: budget split by demand x cost, each within [1, shards].

    With `step_rate` (steps/s to sustain) the total is only what that rate needs (one loader does one
    busy second per second), capped by `budget`; without it the whole budget is used.
    """
    if budget < 1:
        raise ValueError(f"the loader budget must be >= 1, got {budget}")
    active = {s: ld for s, ld in loads.items() if ld.demand > 0}
    if not active:
        return {}
    weight = {s: ld.demand * ld.cost_s for s, ld in active.items()}
    total = float(budget)
    if step_rate is not None:
        if step_rate < 0:
            raise ValueError(f"the target step rate must be >= 0 steps/s, got {step_rate}")
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
class Resize:
    """One decision of a round: set `source` from `old` to `new` loaders, and why."""

    source: str
    old: int
    new: int
    step: int
    why: str


class Autoscaler:
    """Decides loader counts per source from plain inputs each round, and records its decisions.

    No thread and no executor: the control loop gathers the measurements (`_metrics`), asks `decide`,
    applies the resizes and reports each with `record`; `report()` is what `Executor.metrics()` shows.
    """

    def __init__(self, settings: Autoscaling, *, plan_dir: Path, meta: PlanMeta, shards: Mapping[str, int]) -> None:
        self.settings = settings
        self._plan_dir = plan_dir
        self._meta = meta
        self._shards = dict(shards)
        self._costs: dict[str, tuple[int, float]] = {}  # last measurement per source (loaders reset on resize)
        self.decisions: list[AutoscaleDecision] = []
        self.rounds = 0
        self.last: AutoscaleRound | None = None
        self.last_error: str | None = None

    def decide(
        self, *, measured: Mapping[str, tuple[int, float]], step: int, current: Mapping[str, int], threads: int
    ) -> list[Resize]:
        """This round's resizes, shrinks first (to stay within budget); `measured`: source -> (samples, busy_s)."""
        cfg = self.settings
        demand, tokens = _demand(self._plan_dir, self._meta, step, cfg.horizon_steps)
        for s, (n, busy) in measured.items():
            if n > 0 and busy > 0:
                self._costs[s] = (int(n), float(busy))
        costs = estimate_costs(self._costs, tokens)
        loads = {
            s: SourceLoad(demand=demand[s], cost_s=costs[s], shards=self._shards[s], current=current[s])
            for s in self._meta.sources
        }
        budget = cfg.budget or cfg.loaders_per_thread * max(1, threads)
        want = plan_loaders(loads, budget=budget, step_rate=cfg.step_rate, min_change=cfg.min_change)
        ideal = ideal_loaders(loads, budget=budget, step_rate=cfg.step_rate)
        self.last = AutoscaleRound(
            time=time.time(),
            step=step,
            budget=budget,
            demand=dict(demand),
            cost_ms={s: v * 1e3 for s, v in costs.items()},
            ideal=dict(ideal),
        )
        self.rounds += 1
        return [
            Resize(
                source=s,
                old=current[s],
                new=want[s],
                step=step,
                why=(
                    f"steps {step}..{step + cfg.horizon_steps - 1}: {demand[s]:.2f} samples/step x "
                    f"{costs[s] * 1e3:.3f} ms/sample, ideal {ideal.get(s, 0.0):.2f} of budget {budget}"
                ),
            )
            for s in sorted(want, key=lambda s: (want[s] - current[s], s))
            if want[s] != current[s]
        ]

    def record(self, r: Resize, new: int) -> None:
        """A resize was applied: `new` loaders now serve `r.source`."""
        self.decisions.append(
            AutoscaleDecision(time=time.time(), step=r.step, source=r.source, old=r.old, new=new, why=r.why)
        )
        logger.info("autoscale %s: %d -> %d loaders (%s)", r.source, r.old, new, r.why)

    def failed(self, error: BaseException) -> None:
        """A round failed (a worker died mid-resize, the executor is stopping...): the next round decides again."""
        self.last_error = f"{type(error).__name__}: {error}"
        logger.warning("loomdata autoscaling round failed (will retry): %s", self.last_error)

    def report(self) -> AutoscaleReport:
        """Decisions so far and the inputs of the last round, for `Executor.metrics().autoscale`."""
        return AutoscaleReport(
            enabled=True,
            rounds=self.rounds,
            decisions=tuple(self.decisions),
            last=self.last,
            last_error=self.last_error,
        )


def _demand(plan_dir: Path, meta: PlanMeta, step: int, horizon: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per source: segments per step over steps [step, step + horizon), and mean tokens per segment."""
    t = read_manifest(plan_dir, meta, step, min(step + horizon, meta.steps) - 1)
    src = t.column("source").to_numpy()
    length = t.column("length").to_numpy()
    n_steps = max(1, min(horizon, meta.steps - step))
    demand: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for sid, name in enumerate(meta.sources):
        sel = src == sid
        demand[name] = float(np.count_nonzero(sel)) / n_steps
        tokens[name] = float(length[sel].mean()) if sel.any() else 1.0
    return demand, tokens
