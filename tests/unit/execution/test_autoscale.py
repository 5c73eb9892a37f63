"""The autoscaling policy: loaders follow demand x cost within [1, shards] and the budget, without flapping."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from loomdata.execution._autoscale import (
    PRIOR_S_PER_TOKEN,
    Autoscaler,
    Autoscaling,
    SourceLoad,
    estimate_costs,
    ideal_loaders,
    plan_loaders,
)


def load(demand: float, cost: float = 1e-3, shards: int = 64, current: int = 1) -> SourceLoad:
    """A source's load with defaults that bind nothing."""
    return SourceLoad(demand=demand, cost_s=cost, shards=shards, current=current)


def test_proportional_to_demand_times_cost() -> None:
    loads = {"a": load(30, 1e-3, current=0), "b": load(10, 1e-3, current=0), "c": load(10, 2e-3, current=0)}
    assert ideal_loaders(loads, budget=12) == pytest.approx({"a": 6.0, "b": 2.0, "c": 4.0})
    assert plan_loaders(loads, budget=12) == {"a": 6, "b": 2, "c": 4}
    # cost and demand trade off: a costlier, less demanded source gets as many as a cheap, demanded one
    assert plan_loaders({"x": load(40, 1e-4, current=0), "y": load(4, 1e-3, current=0)}, budget=8) == {"x": 4, "y": 4}


def test_at_least_one_per_demanded_source_and_at_most_its_shards() -> None:
    loads = {"big": load(1000, shards=3, current=0), "tiny": load(0.01, current=0), "idle": load(0, current=2)}
    out = plan_loaders(loads, budget=16)
    assert out["big"] == 3  # one loader per shard at most
    assert out["tiny"] == 13  # the budget left over goes to the other demanded source...
    assert out["idle"] == 2  # ...never to one without demand, which keeps what it has
    starved = {"a": load(1000, current=0), "b": load(0.001, current=0), "c": load(0.001, current=0)}
    assert plan_loaders(starved, budget=2) == {"a": 1, "b": 1, "c": 1}  # floor of 1 beats the budget


def test_budget_and_target_rate_bound_the_total() -> None:
    loads = {"a": load(100, 1e-3, current=0), "b": load(50, 1e-3, current=0)}
    assert sum(plan_loaders(loads, budget=7).values()) == 7
    # 0.15 busy s per step at 20 steps/s = 3 loaders busy all the time: the budget of 8 is not all used
    assert plan_loaders(loads, budget=8, step_rate=20.0) == {"a": 2, "b": 1}
    assert sum(plan_loaders(loads, budget=8, step_rate=1000.0).values()) == 8


def test_rounding_is_deterministic_and_fills_the_budget() -> None:
    loads = {n: load(1, current=0) for n in ("c", "a", "b")}
    assert plan_loaders(loads, budget=5) == {"a": 2, "b": 2, "c": 1}  # equal remainders: by name
    assert plan_loaders(dict(reversed(list(loads.items()))), budget=5) == {"a": 2, "b": 2, "c": 1}


def test_hysteresis_keeps_small_changes() -> None:
    # ideal 4.6 vs 4 loaders: moved by < 1 -> keep; ideal 10.5 vs 9: moved by >= 1 but < 25% -> keep
    assert plan_loaders({"a": load(46, current=4), "b": load(54, current=5)}, budget=10)["a"] == 4
    assert plan_loaders({"a": load(105, current=9), "b": load(95, current=11)}, budget=20) == {"a": 9, "b": 11}
    # the same sources far from their ideal do change
    assert plan_loaders({"a": load(80, current=4), "b": load(20, current=6)}, budget=10) == {"a": 8, "b": 2}


def test_no_flapping_around_a_stable_ideal() -> None:
    counts = {"a": 1, "b": 1}
    seen = []
    for noise in [1.0, 1.15, 0.9, 1.1, 0.95, 1.2, 0.85]:  # measured cost wobbles by +-20%
        loads = {"a": load(30, 1e-3 * noise, current=counts["a"]), "b": load(10, 1e-3, current=counts["b"])}
        counts = plan_loaders(loads, budget=8)
        seen.append(dict(counts))
    assert seen[0] == {"a": 6, "b": 2}
    assert all(s == seen[0] for s in seen)


def test_schedule_change_shifts_loaders_between_sources() -> None:
    counts = {"web": 1, "code": 1}
    for demand in ({"web": 90, "code": 10}, {"web": 10, "code": 90}):
        loads = {s: load(demand[s], current=counts[s]) for s in counts}
        counts = plan_loaders(loads, budget=6)
        heavy = max(demand, key=lambda s: demand[s])
        assert counts[heavy] == 5 and sum(counts.values()) == 6


def test_kept_counts_never_exceed_the_budget() -> None:
    # a would keep 6 by hysteresis (ideal 5.0 vs 6 is < 25% away) while b grows to 3: shrink a anyway
    out = plan_loaders({"a": load(50, current=6), "b": load(30, current=1)}, budget=8)
    assert sum(out.values()) <= 8 and out["b"] == 3


def test_costs_from_measurements_with_a_prior_on_one_scale() -> None:
    tokens = {"a": 100.0, "b": 400.0, "c": 50.0}
    costs = estimate_costs({"a": (1000, 2.0), "b": (0, 0.0)}, tokens)
    assert costs["a"] == pytest.approx(2e-3)
    assert costs["b"] == pytest.approx(8e-3)  # a's 2e-5 s/token x b's 400 tokens
    assert costs["c"] == pytest.approx(1e-3)
    assert estimate_costs({}, {"a": 10.0}) == {"a": pytest.approx(10 * PRIOR_S_PER_TOKEN)}


def test_invalid_inputs_raise_actionable_errors() -> None:
    with pytest.raises(ValueError, match="budget must be >= 1"):
        plan_loaders({"a": load(1)}, budget=0)
    with pytest.raises(ValueError, match="shards >= 1"):
        SourceLoad(demand=1, cost_s=1, shards=0, current=1)
    with pytest.raises(ValueError, match="step rate"):
        plan_loaders({"a": load(1)}, budget=2, step_rate=-1)
    with pytest.raises(ValueError, match=r"Autoscaling.every_s must be > 0"):
        Autoscaling(every_s=0)
    with pytest.raises(ValueError, match=r"Autoscaling.budget must be >= 1"):
        Autoscaling(budget=0)
    assert plan_loaders({"a": load(0, current=3)}, budget=4) == {"a": 3}


# ---- the stable controller: decisions from plain inputs and a clock passed in (no cluster, no sleeps) ----

SOURCES = ("a", "b")


def scaler(**settings: object) -> Autoscaler:
    """An Autoscaler over two 16-shard sources; `decide_for` never reads the plan directory."""
    meta = SimpleNamespace(sources=SOURCES, steps=1000)
    cfg = Autoscaling(every_s=1.0, budget=8, **settings)  # type: ignore[arg-type]
    return Autoscaler(cfg, plan_dir=Path("unused"), meta=meta, shards={s: 16 for s in SOURCES})  # type: ignore[arg-type]


def decide(
    sc: Autoscaler,
    counts: dict[str, int],
    measured: dict[str, tuple[int, float]],
    now: float,
    demand: dict[str, float] | None = None,
) -> dict[str, int]:
    """One round at clock `now`; applies and records the resizes, returns the new counts."""
    resizes = sc.decide_for(
        demand=demand or {"a": 10.0, "b": 10.0},
        tokens={"a": 100.0, "b": 100.0},
        measured=measured,
        step=0,
        current=counts,
        threads=2,
        now=now,
    )
    for r in resizes:
        sc.record(r, r.new)
        counts = {**counts, r.source: r.new}
    return counts


def test_one_slow_cold_read_does_not_take_the_budget() -> None:
    sc = scaler()
    # a's first read opened its files: 1 sample in 40.7 ms; b read 1,000 samples at 0.5 ms each
    counts = decide(sc, {"a": 1, "b": 1}, {"a": (1, 0.0407), "b": (1000, 0.5)}, now=0.0)
    assert counts == {"a": 4, "b": 4}  # a stays on the per-token prior (b's scale): equal demand, equal share
    assert sc.last is not None and sc.last.cost_samples["a"] == 0 and sc.last.cost_samples["b"] == 1000
    assert sc.last.cost_ms["a"] == pytest.approx(0.5)
    # the same inputs to the old rule (one read's cost used as is) hand a all but one loader
    naive = estimate_costs({"a": (1, 0.0407), "b": (1000, 0.5)}, {"a": 100.0, "b": 100.0})
    loads = {s: load(10, naive[s], shards=16, current=1) for s in SOURCES}
    assert plan_loaders(loads, budget=8) == {"a": 7, "b": 1}


def test_measured_cost_survives_loader_replacement() -> None:
    sc = scaler(cost_decay=1.0, min_busy_s=0.0)
    decide(sc, {"a": 1, "b": 1}, {"a": (500, 0.5), "b": (500, 0.5)}, now=0.0)
    # a's loaders were replaced: their counters restarted, and the new ones' first 10 reads were cold
    decide(sc, {"a": 1, "b": 1}, {"a": (10, 0.5), "b": (1000, 1.0)}, now=100.0)
    assert sc.costs.totals["a"] == pytest.approx((510, 1.0))  # the old 500 kept, the 10 new ones added
    assert sc.last is not None and sc.last.cost_ms["a"] == pytest.approx(1.0 / 510 * 1e3)


def test_no_resize_within_the_minimum_interval() -> None:
    sc = scaler(source_interval_s=30.0, resize_interval_s=10.0, min_samples=1, min_busy_s=0.0)
    flat = {"a": (1000, 1.0), "b": (1000, 1.0)}
    counts = decide(sc, {"a": 1, "b": 1}, flat, now=0.0, demand={"a": 30.0, "b": 10.0})
    assert counts == {"a": 6, "b": 2}
    # the schedule flips at once: nothing moves within the fleet's 10 s, nor a source within its 30 s
    for now in (5.0, 9.9, 20.0, 29.9):
        assert decide(sc, counts, flat, now=now, demand={"a": 10.0, "b": 30.0}) == {"a": 6, "b": 2}
        assert sc.last is not None and set(sc.last.held) == {"a", "b"} and "waits" in sc.last.held["a"]
    assert decide(sc, counts, flat, now=30.0, demand={"a": 10.0, "b": 30.0}) == {"a": 2, "b": 6}
    assert len(sc.decisions) == 4 and all(d.demand is not None and d.budget == 8 for d in sc.decisions)
    assert sc.decisions[-1].to_dict()["cost_samples"] > 1  # decayed, no new reads since


def test_held_shrink_trims_grows_to_the_budget() -> None:
    sc = scaler(source_interval_s=30.0, resize_interval_s=0.0, min_samples=1, min_busy_s=0.0)
    flat = {"a": (1000, 1.0), "b": (1000, 1.0)}
    counts = decide(sc, {"a": 1, "b": 4}, flat, now=0.0, demand={"a": 30.0, "b": 10.0})
    assert counts == {"a": 6, "b": 2}
    # b was just resized and would grow back; a, resized too, must wait: nothing exceeds the 8 loaders
    counts = decide(sc, counts, flat, now=1.0, demand={"a": 10.0, "b": 30.0})
    assert counts == {"a": 6, "b": 2} and sum(counts.values()) <= 8


def test_hysteresis_over_rounds_with_noisy_costs() -> None:
    sc = scaler(source_interval_s=0.0, resize_interval_s=0.0, min_samples=1, min_busy_s=0.0)
    counts = {"a": 1, "b": 1}
    seen = []
    total = {"a": 0.0, "b": 0.0}
    for i, noise in enumerate([1.0, 1.3, 0.7, 1.25, 0.8, 1.3, 0.75]):  # a's cost per round wobbles by +-30%
        total["a"] += 1.0 * noise
        total["b"] += 1.0
        measured = {"a": (1000 * (i + 1), total["a"]), "b": (1000 * (i + 1), total["b"])}
        counts = decide(sc, counts, measured, now=float(i), demand={"a": 30.0, "b": 10.0})
        seen.append(counts)
    assert seen[0] == {"a": 6, "b": 2} and all(s == seen[0] for s in seen)
    assert len(sc.decisions) == 2  # one resize per source, then the decayed estimate holds them
