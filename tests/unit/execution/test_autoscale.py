"""The autoscaling policy: loaders follow demand x cost within [1, shards] and the budget, without flapping."""

from __future__ import annotations

import pytest

from loomdata.execution._autoscale import (
    PRIOR_S_PER_TOKEN,
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
