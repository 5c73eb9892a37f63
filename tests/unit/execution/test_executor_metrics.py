"""Typed executor metrics: sums over the actors' answers, and `to_dict()` keeps the `--json` shape."""

from __future__ import annotations

import json

import pytest

from loomdata.execution._metrics import Gathered, current_step, measured_costs, summarize
from loomdata.execution._recovery import RecoveryStats
from loomdata.execution._serve import _report
from loomdata.schemas.metrics import (
    AutoscaleDecision,
    AutoscaleReport,
    ConstructorMetrics,
    LoaderMetrics,
    LoaderReport,
)


def gathered() -> Gathered:
    def lo(sid: int, source: str, part: int, worker: str, samples: int, rate: float | None) -> LoaderReport:
        m = LoaderMetrics(
            source=source, part=part, calls=2, samples=samples, tokens=10 * samples, busy_s=0.5,
            samples_per_s=rate, state_bytes=100, rss_bytes=1000,
        )  # fmt: skip
        return LoaderReport(source_id=sid, worker=worker, metrics=m)

    return Gathered(
        loaders=[lo(0, "web", 0, "w1", 40, 10.0), lo(0, "web", 1, "w2", 20, None), lo(1, "code", 0, "w1", 5, 2.5)],
        constructors=[
            ConstructorMetrics(ranks=[0], queue_depth=2, want={0: 7}, rank_wait_s={0: 0.25}),
            ConstructorMetrics(ranks=[1], queue_depth=1, want={1: 5}, rank_wait_s={1: 0.125}),
        ],
    )


def test_sums_and_the_policy_inputs() -> None:
    g = gathered()
    stats = RecoveryStats(recovered=3, seconds=0.4567)
    m = summarize("p", g, recovery=stats, autoscale=None)
    assert m.sources["web"].loaders == 2 and m.sources["web"].samples == 60 and m.sources["code"].tokens == 50
    assert m.loader_samples == 65 and m.loader_calls == 6 and m.loader_memory_bytes == 300
    assert m.loader_rss_bytes == 2000  # two workers, each counted once
    assert m.queue_depth == 3 and m.rank_wait_s == {0: 0.25, 1: 0.125}
    assert measured_costs(g) == {"web": (60, 1.0), "code": (5, 0.5)}
    assert current_step(g, steps=100) == 5 and current_step(g, steps=3) == 2


def test_to_dict_keeps_the_json_shape() -> None:
    decision = AutoscaleDecision(time=1.0, step=3, source="web", old=1, new=2, why="demand")
    auto = AutoscaleReport(enabled=True, rounds=4, decisions=(decision,))
    d = summarize("p", gathered(), recovery=RecoveryStats(recovered=3, seconds=0.4567), autoscale=auto).to_dict()
    assert list(d) == [
        "plan_id", "sources", "loader_samples", "loader_calls", "loader_memory_bytes", "loader_rss_bytes",
        "queue_depth", "rank_wait_s", "constructors", "loaders", "recovered_actors", "recovery_s", "autoscale",
        "retired",
    ]  # fmt: skip
    assert d["sources"]["web"] == {
        "loaders": 2, "samples": 60, "tokens": 600, "samples_per_s": 10.0, "busy_s": 1.0,
        "samples_decoded": None, "tokens_decoded": None,  # these loaders count no decodes
        "retired_loaders": 0,
    }  # fmt: skip
    assert d["rank_wait_s"] == {"0": 0.25, "1": 0.125} and d["recovered_actors"] == 3 and d["recovery_s"] == 0.457
    assert d["loaders"][0]["source_id"] == 0 and d["constructors"][0]["want"] == {"0": 7}
    assert d["autoscale"] == {
        "enabled": True,
        "rounds": 4,
        "decisions": [{"time": 1.0, "step": 3, "source": "web", "old": 1, "new": 2, "why": "demand"}],
        "last": {},
        "last_error": None,
    }
    assert summarize("p", gathered(), recovery=RecoveryStats(), autoscale=None).to_dict()["autoscale"] == {
        "enabled": False
    }
    json.dumps(d)  # JSON-ready as it is


def test_the_serve_metrics_line(capsys: pytest.CaptureFixture[str]) -> None:
    _report(summarize("p", gathered(), recovery=RecoveryStats(recovered=1), autoscale=None), json_out=True)
    line = json.loads(capsys.readouterr().out)
    assert line == {
        "event": "metrics",
        "samples_per_s": {"web": 10.0, "code": 2.5},
        "queue_depth": 3,
        "rank_wait_s": {"0": 0.25, "1": 0.125},
        "recovered_actors": 1,
        "loaders": {"web": 2, "code": 1},
    }
