"""Typed actor metrics: pickle intact (they cross Dask) and `to_dict()` keeps the `--json` shape."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from loomdata.schemas import BuildPhases, ConstructorMetrics, LoaderMetrics, SourceMetrics


def test_loader_metrics_dict_shape_and_rounding() -> None:
    m = LoaderMetrics(
        source="web", part=1, calls=3, samples=10, tokens=99, busy_s=0.123456, samples_per_s=12.345,
        get_latency_s=0.1012345, prefetch_reach_steps=90,
    )  # fmt: skip
    d = m.to_dict()
    assert list(d) == [
        "source", "part", "calls", "samples", "segments", "tokens", "busy_s",
        "samples_per_s", "samples_per_busy_s", "state_bytes", "rss_bytes",
        "prefetched", "prefetch_hits", "prefetch_errors", "prefetch_waits", "unit_misses",
        "get_latency_s", "prefetch_reach_steps", "checksums_held", "checksum_loads", "checksum_rereads",
        "plan_errors", "units_decoded", "samples_decoded", "tokens_decoded", "tokens_unserved",
    ]  # fmt: skip
    assert d["busy_s"] == 0.1235 and d["samples_per_s"] == 12.3 and d["samples_per_busy_s"] is None
    assert d["get_latency_s"] == 0.1012 and d["prefetch_reach_steps"] == 90
    assert LoaderMetrics(source="web", part=1).to_dict()["get_latency_s"] is None  # no read-ahead: not measured
    assert pickle.loads(pickle.dumps(m)) == m
    json.dumps(d)


def test_constructor_metrics_dict_keys_ranks_as_strings() -> None:
    m = ConstructorMetrics(
        ranks=[2, 3],
        want={2: 5, 3: 4},
        build_phases_s=BuildPhases(manifest=0.00001, loaders=1.23456, pack=0.5),
        rank_wait_s={2: 0.123456, 3: 0.0},
        rank_takes={2: 5, 3: 4},
    )
    d = m.to_dict()
    assert d["want"] == {"2": 5, "3": 4} and d["rank_takes"] == {"2": 5, "3": 4}
    assert d["rank_wait_s"] == {"2": 0.1235, "3": 0.0}
    assert d["build_phases_s"] == {"manifest": 0.0, "loaders": 1.2346, "pack": 0.5}
    assert pickle.loads(pickle.dumps(m)) == m
    assert json.loads(json.dumps(d)) == d


def test_metrics_are_frozen_and_keyword_only() -> None:
    m = LoaderMetrics(source="a", part=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.calls = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        LoaderMetrics("a", 0)  # type: ignore[misc]


def test_decoded_counts_sum_per_source_and_unserved_is_their_difference() -> None:
    a = LoaderMetrics(source="web", part=0, tokens=70, units_decoded=2, samples_decoded=30, tokens_decoded=100)
    b = LoaderMetrics(source="web", part=1, tokens=50, units_decoded=1, samples_decoded=10, tokens_decoded=50)
    assert (a.tokens_unserved, b.tokens_unserved) == (30, 0)
    assert a.to_dict()["tokens_decoded"] == 100 and a.to_dict()["tokens_unserved"] == 30
    s = SourceMetrics.of([a, b])
    assert (s.tokens, s.samples_decoded, s.tokens_decoded) == (120, 40, 150)
    assert s.to_dict()["tokens_decoded"] == 150
    unknown = LoaderMetrics(source="web", part=2, tokens=5)  # a format without read units: not counted
    assert unknown.tokens_unserved is None and unknown.to_dict()["units_decoded"] is None
    assert SourceMetrics.of([a, unknown]).tokens_decoded is None  # a partial sum would pass for the whole source's
    assert SourceMetrics.of([]).tokens_decoded is None


def test_unserved_is_never_negative_where_a_held_unit_serves_its_samples_again() -> None:
    """A unit held across epochs serves its samples twice from one decode: served tokens then exceed decoded ones, and
    what was decoded and not served is at least 0 (the difference is a lower bound), never a negative count."""
    again = LoaderMetrics(source="web", part=0, tokens=150, units_decoded=1, samples_decoded=10, tokens_decoded=100)
    assert again.tokens_unserved == 0 and again.to_dict()["tokens_unserved"] == 0
