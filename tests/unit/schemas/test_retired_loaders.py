"""Retired loaders' counters: summed into their source's totals (which then never go back), rates and gauges not."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loomdata.schemas import ExecutorMetrics, LoaderMetrics, LoaderReport, RetiredLoaders, SourceMetrics
from loomdata.schemas.metrics import LOADER_COUNTERS


def _m(part: int, k: int, **kw: object) -> LoaderMetrics:
    """A loader whose every counter is `k` times its position in LOADER_COUNTERS + 1, with gauges set."""
    counts = {name: k * (i + 1) for i, name in enumerate(LOADER_COUNTERS)}
    gauges = dict(samples_per_s=50.0, samples_per_busy_s=70.0, state_bytes=4096, rss_bytes=1 << 30,
                  get_latency_s=0.02, prefetch_reach_steps=8, checksums_held=12)  # fmt: skip
    return LoaderMetrics(source="web", part=part, **{**counts, **gauges, **kw})  # type: ignore[arg-type]


def test_counters_and_gauges_partition_the_loader_fields() -> None:
    gauges = {"samples_per_s", "samples_per_busy_s", "state_bytes", "rss_bytes", "get_latency_s",
              "prefetch_reach_steps", "checksums_held"}  # fmt: skip
    fields = {f.name for f in dataclasses.fields(LoaderMetrics)} - {"source", "part"}
    assert set(LOADER_COUNTERS) == fields - gauges  # a new field must be sorted into one or the other
    assert len(LOADER_COUNTERS) == len(set(LOADER_COUNTERS))


def test_retired_counters_sum_and_gauges_stay_out() -> None:
    r = RetiredLoaders(source="web").add(_m(0, 1)).add(_m(1, 10))
    assert (r.loaders, r.unanswered) == (2, 0)
    for i, name in enumerate(LOADER_COUNTERS):
        assert r.count(name) == 11 * (i + 1), name
    assert r.totals is not None
    assert (r.totals.samples_per_s, r.totals.state_bytes, r.totals.rss_bytes) == (None, 0, 0)
    assert (r.totals.get_latency_s, r.totals.prefetch_reach_steps, r.totals.checksums_held) == (None, None, None)
    with pytest.raises(KeyError, match="rss_bytes"):
        r.count("rss_bytes")  # a gauge summed over gone loaders would be a wrong number
    lost = r.add(None)  # lost before it ever answered: counted as a loader, its counters unknown
    assert (lost.loaders, lost.unanswered, lost.count("tokens")) == (3, 1, r.count("tokens"))
    assert RetiredLoaders(source="web").count("tokens") == 0
    assert r.add(_m(2, 1, tokens_decoded=None)).count("tokens_decoded") is None  # one not counting: not known
    json.dumps(r.to_dict())
    assert r.to_dict()["loaders"] == 2 and r.to_dict()["tokens"] == r.count("tokens")


def test_source_counters_are_live_plus_retired_rates_live_only() -> None:
    retired = RetiredLoaders(source="web").add(_m(0, 1)).add(_m(1, 1))
    live = [_m(0, 5)]
    s = SourceMetrics.of(live, retired)
    assert s.loaders == 1 and s.retired_loaders == 2
    assert s.samples == live[0].samples + 2 * _m(0, 1).samples
    assert s.tokens == live[0].tokens + 2 * _m(0, 1).tokens
    assert s.busy_s == live[0].busy_s + 2 * _m(0, 1).busy_s
    assert s.tokens_decoded == live[0].tokens_decoded + retired.count("tokens_decoded")  # type: ignore[operator]
    assert s.samples_per_s == 50.0  # the live loader's rate, not the gone ones'
    assert SourceMetrics.of([], retired).tokens == retired.count("tokens")  # every live loader lost: still counted
    assert s.to_dict()["retired_loaders"] == 2


def test_executor_totals_include_retired_loaders_and_memory_does_not() -> None:
    retired = RetiredLoaders(source="web").add(_m(0, 1))
    code = LoaderMetrics(source="code", part=0, calls=3, samples=30, tokens=300, state_bytes=8)
    web = _m(0, 2)
    m = ExecutorMetrics(
        plan_id="p",
        loaders=(
            LoaderReport(source_id=1, worker="w", metrics=code),
            LoaderReport(source_id=0, worker="w", metrics=web),
        ),
        retired={"web": retired, "gone": RetiredLoaders(source="gone").add(_m(0, 1))},
    )
    assert list(m.sources) == ["code", "web", "gone"]  # a source with only retired loaders still reports
    assert m.sources["web"].tokens == web.tokens + retired.count("tokens")
    assert m.loader_samples == 30 + web.samples + 2 * retired.count("samples")
    assert m.loader_calls == 3 + web.calls + 2 * retired.count("calls")
    assert m.loader_memory_bytes == 8 + web.state_bytes  # live only
    d = m.to_dict()
    assert d["retired"]["web"]["loaders"] == 1 and d["sources"]["gone"]["retired_loaders"] == 1
    json.dumps(d)
