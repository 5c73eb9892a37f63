"""Autoscaling: loader actors per source follow the plan's demand times the measured per-sample cost.

`plan_loaders` is the pure policy: given per source the samples per step the coming steps need, the
seconds one sample costs a loader, its shard count and its current loaders, it splits a loader budget
in proportion to demand x cost (at least 1 per demanded source, at most one per shard), rounds
deterministically and keeps the current count unless the ideal moved by >= 1 and >= 25% (no flapping).
`CostTracker` keeps each source's measurements across rounds and loader replacement (counters that
went back mean new loaders: their totals are new samples), weights older rounds by `cost_decay`, and
uses a source's measured cost only once it rests on `min_samples` samples and `min_busy_s` busy
seconds, the per-token prior before (one slow cold read is not a cost).
`Autoscaler` turns one round's plain inputs (measured samples and busy seconds per source, the
consumers' step, the current counts, the cluster's threads, the clock) and the manifest's coming
steps into resizes, holds a source resized less than `source_gap_s` ago and any resize less than
`fleet_gap_s` after the last, and records each decision with its inputs. It knows nothing of the
executor: the control loop (`_loop`) gathers the inputs, applies the resizes through the fleet's one
re-routing protocol (`_actors`), and a round that fails (a worker died mid-call) is recorded in
`last_error`; the next decides again.
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
from loomdata.schemas.plan_view import PlanView, read_manifest

__all__ = [
    "Autoscaler",
    "Autoscaling",
    "CostTracker",
    "Resize",
    "SourceLoad",
    "estimate_costs",
    "ideal_loaders",
    "plan_loaders",
]

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
    measured: Mapping[str, tuple[float, float]], tokens_per_sample: Mapping[str, float]
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


class CostTracker:
    """Per-source (samples, busy_s) over rounds: deltas of the loaders' counters, older rounds decayed.

    The loaders' counters are per actor and restart when a source's loaders are replaced, so a round
    whose sum went back counts its whole sum as new. `costs` gives the measured cost of a source that
    has enough behind it and the per-token prior (on the measured sources' scale) of the others.
    """

    def __init__(self, *, min_samples: int, min_busy_s: float, decay: float) -> None:
        self._min_samples = min_samples
        self._min_busy_s = min_busy_s
        self._decay = decay
        self._seen: dict[str, tuple[int, float]] = {}  # the loaders' counters last round
        self.totals: dict[str, tuple[float, float]] = {}  # weighted (samples, busy_s)

    def add(self, measured: Mapping[str, tuple[int, float]]) -> None:
        """One round's per-source counter sums (samples, busy_s) over the loaders that answered."""
        for s, (n, busy) in self.totals.items():
            self.totals[s] = (n * self._decay, busy * self._decay)
        for s, (n, busy) in measured.items():
            n0, b0 = self._seen.get(s, (0, 0.0))
            dn, db = (n - n0, busy - b0) if n >= n0 and busy >= b0 else (n, busy)  # went back: new loaders
            self._seen[s] = (int(n), float(busy))
            tn, tb = self.totals.get(s, (0.0, 0.0))
            self.totals[s] = (tn + dn, tb + db)

    def trusted(self) -> dict[str, tuple[float, float]]:
        """The sources whose measurements are enough to replace the prior."""
        return {
            s: (n, b) for s, (n, b) in self.totals.items() if n >= self._min_samples and b >= self._min_busy_s and b > 0
        }

    def costs(self, tokens_per_sample: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds per sample per source, and the weighted samples behind each (0 where it is the prior)."""
        trusted = self.trusted()
        costs = estimate_costs(trusted, tokens_per_sample)
        return costs, {s: float(trusted[s][0]) if s in trusted else 0.0 for s in tokens_per_sample}


@dataclass(frozen=True, slots=True, kw_only=True)
class Resize:
    """One decision of a round: set `source` from `old` to `new` loaders, and why."""

    source: str
    old: int
    new: int
    step: int
    why: str
    demand: float = 0.0
    cost_s: float = 0.0
    cost_samples: float = 0.0
    ideal: float = 0.0
    budget: int = 0


class Autoscaler:
    """Decides loader counts per source from plain inputs each round, and records its decisions.

    No thread and no executor: the control loop gathers the measurements (`_metrics`), asks `decide`,
    applies the resizes and reports each with `record`; `report()` is what `Executor.metrics()` shows.
    """

    def __init__(self, settings: Autoscaling, *, plan_dir: Path, meta: PlanView, shards: Mapping[str, int]) -> None:
        self.settings = settings
        self._plan_dir = plan_dir
        self._meta = meta
        self._shards = dict(shards)
        self.costs = CostTracker(
            min_samples=settings.min_samples, min_busy_s=settings.min_busy_s, decay=settings.cost_decay
        )
        self._resized_at: dict[str, float] = {}  # monotonic clock of each source's last resize
        self._last_resize: float | None = None
        self.decisions: list[AutoscaleDecision] = []
        self.rounds = 0
        self.last: AutoscaleRound | None = None
        self.last_error: str | None = None

    def decide(
        self,
        *,
        measured: Mapping[str, tuple[int, float]],
        step: int,
        current: Mapping[str, int],
        threads: int,
        now: float | None = None,
    ) -> list[Resize]:
        """This round's resizes, shrinks first (to stay within budget); `measured`: source -> (samples, busy_s)."""
        demand, tokens = _demand(self._plan_dir, self._meta, step, self.settings.horizon_steps)
        return self.decide_for(
            demand=demand, tokens=tokens, measured=measured, step=step, current=current, threads=threads, now=now
        )

    def decide_for(
        self,
        *,
        demand: Mapping[str, float],
        tokens: Mapping[str, float],
        measured: Mapping[str, tuple[int, float]],
        step: int,
        current: Mapping[str, int],
        threads: int,
        now: float | None = None,
    ) -> list[Resize]:
        """`decide` with the demand (samples/step) and mean tokens per sample given; `now`: a monotonic clock."""
        cfg = self.settings
        now = time.monotonic() if now is None else now
        self.costs.add(measured)
        costs, samples = self.costs.costs(tokens)
        loads = {
            s: SourceLoad(demand=demand[s], cost_s=costs[s], shards=self._shards[s], current=current[s])
            for s in self._meta.sources
        }
        budget = cfg.budget or cfg.loaders_per_thread * max(1, threads)
        ideal = ideal_loaders(loads, budget=budget, step_rate=cfg.step_rate)
        want, held = self._hold(
            plan_loaders(loads, budget=budget, step_rate=cfg.step_rate, min_change=cfg.min_change),
            current,
            now=now,
        )
        self.last = AutoscaleRound(
            time=time.time(),
            step=step,
            budget=budget,
            demand=dict(demand),
            cost_ms={s: v * 1e3 for s, v in costs.items()},
            ideal=dict(ideal),
            cost_samples=samples,
            held=held,
        )
        self.rounds += 1
        out = [
            Resize(
                source=s,
                old=current[s],
                new=want[s],
                step=step,
                why=(
                    f"steps {step}..{step + cfg.horizon_steps - 1}: {demand[s]:.2f} samples/step x "
                    f"{costs[s] * 1e3:.3f} ms/sample ({'measured' if samples[s] else 'prior'}, "
                    f"{samples[s]:.0f} samples), ideal {ideal.get(s, 0.0):.2f} of budget {budget}"
                ),
                demand=demand[s],
                cost_s=costs[s],
                cost_samples=samples[s],
                ideal=ideal.get(s, 0.0),
                budget=budget,
            )
            for s in sorted(want, key=lambda s: (want[s] - current[s], s))
            if want[s] != current[s]
        ]
        if out:
            self._last_resize = now
            for r in out:
                self._resized_at[r.source] = now
        return out

    def _hold(
        self, want: Mapping[str, int], current: Mapping[str, int], *, now: float
    ) -> tuple[dict[str, int], dict[str, str]]:
        """Keep the current count of sources resized too recently (or all, too soon after any resize).

        Held shrinks free no loaders, so grows are then trimmed (largest first, by name) to keep the
        total within the policy's (or the current one, if that is larger).
        """
        cfg = self.settings
        out = dict(want)
        held: dict[str, str] = {}
        since_any = None if self._last_resize is None else now - self._last_resize
        for s, n in want.items():
            if n == current[s]:
                continue
            since = None if s not in self._resized_at else now - self._resized_at[s]
            if since_any is not None and since_any < cfg.fleet_gap_s:
                held[s] = f"{current[s]}->{n} waits: last resize {since_any:.2f} s ago < {cfg.fleet_gap_s:.2f} s"
            elif since is not None and since < cfg.source_gap_s:
                held[s] = f"{current[s]}->{n} waits: {s} resized {since:.2f} s ago < {cfg.source_gap_s:.2f} s"
            else:
                continue
            out[s] = current[s]
        over = sum(out.values()) - max(sum(want.values()), sum(current.values()))
        for s in sorted((s for s in out if out[s] > current[s]), key=lambda s: (current[s] - out[s], s)):
            if over <= 0:
                break
            cut = min(over, out[s] - current[s])
            out[s] -= cut
            over -= cut
            held[s] = f"{current[s]}->{want[s]} trimmed to {out[s]}: held shrinks keep the budget full"
        return out, held

    def record(self, r: Resize, new: int) -> None:
        """A resize was applied: `new` loaders now serve `r.source`."""
        self.decisions.append(
            AutoscaleDecision(
                time=time.time(),
                step=r.step,
                source=r.source,
                old=r.old,
                new=new,
                why=r.why,
                demand=r.demand,
                cost_ms=r.cost_s * 1e3,
                cost_samples=r.cost_samples,
                ideal=r.ideal,
                budget=r.budget,
            )
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


def _demand(plan_dir: Path, meta: PlanView, step: int, horizon: int) -> tuple[dict[str, float], dict[str, float]]:
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
