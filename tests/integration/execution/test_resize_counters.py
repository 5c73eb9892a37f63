"""Source counters survive a resize: the retired loaders' counters stay in their source's totals.

Monitoring reads `Executor.metrics()` as a time series of counters: a resize (old loaders retire)
must not send a source's samples, tokens, busy seconds or decodes back, and once every step is
consumed the source's served tokens equal the tokens of its segments in the batches, whichever
loaders served them.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.schemas import ExecutorMetrics
from loomdata.schemas.metrics import LOADER_COUNTERS


def _counters(m: ExecutorMetrics) -> dict[tuple[str, str], float]:
    """Every counter per source, live loaders' plus retired ones' (not-counted optional counters left out)."""
    out: collections.Counter[tuple[str, str]] = collections.Counter()
    for s, src in m.sources.items():
        for k in ("samples", "tokens", "busy_s", "samples_decoded", "tokens_decoded", "retired_loaders"):
            if getattr(src, k) is not None:
                out[(s, k)] += getattr(src, k)
    for lo in m.loaders:
        for k in LOADER_COUNTERS:
            if getattr(lo.metrics, k) is not None:
                out[(lo.metrics.source, "all." + k)] += getattr(lo.metrics, k)
    for s, r in m.retired.items():
        for k in LOADER_COUNTERS:
            if r.count(k) is not None:
                out[(s, "all." + k)] += r.count(k)
    out[("*", "loader_samples")] = m.loader_samples
    out[("*", "loader_calls")] = m.loader_calls
    return dict(out)


def _went_back(before: ExecutorMetrics, after: ExecutorMetrics) -> dict[tuple[str, str], tuple[float, float]]:
    a, b = _counters(before), _counters(after)
    return {k: (v, b.get(k, 0)) for k, v in a.items() if b.get(k, 0) < v}


def test_a_resize_mid_serve_keeps_every_source_counter(dask_client: Client, stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)
    meta = oracle.meta
    served: collections.Counter[str] = collections.Counter()  # tokens of each source's segments in the batches

    def take(stream: StreamClient, n: int) -> None:
        for _ in range(n):
            b = next(stream)
            oracle.check(b)
            for src, ln in zip(b.segments["source"].tolist(), b.segments["length"].tolist(), strict=True):
                served[meta.sources[src]] += ln

    with (
        Executor(stream_plan, dask_client, loaders_per_source={"web": 2, "code": 1}) as ex,
        StreamClient(stream_plan, 0) as r0,
        StreamClient(stream_plan, 1) as r1,
    ):
        mb = meta.micro_batches
        for r in (r0, r1):
            take(r, 2 * mb)  # two steps on each rank
        first = ex.metrics()
        assert first.sources["web"].tokens > 0 and first.sources["web"].loaders == 2
        assert ex.set_loaders("web", 1) == 1  # two loaders retire
        resized = ex.metrics()
        assert resized.sources["web"].loaders == 1 and resized.sources["web"].retired_loaders == 2
        assert resized.retired["web"].unanswered == 0  # closed loaders answered with their final counters
        assert _went_back(first, resized) == {}
        for r in (r0, r1):
            take(r, mb)
        assert ex.set_loaders("web", 3) == 3  # one more retires, mid-serve again
        assert ex.set_loaders("code", 2) == 2
        for r in (r0, r1):
            take(r, (meta.steps - 3) * mb)  # the rest of the plan
        last = ex.metrics()
    assert _went_back(resized, last) == {}
    assert {s: last.sources[s].retired_loaders for s in meta.sources} == {"web": 3, "code": 1}
    assert {s: last.sources[s].tokens for s in meta.sources} == dict(served)  # every token served counted once


def test_loaders_retired_before_any_report_count_their_final_counters(
    dask_client: Client, stream_plan: Path, loomtest: Any
) -> None:
    """No report asked the old loaders anything before they retired (no `last_seen`): only their final metrics,
    asked once they are closed, can keep their counters; every token served is still counted once."""
    oracle = loomtest.Oracle(stream_plan)
    meta = oracle.meta
    served: collections.Counter[str] = collections.Counter()
    with (
        Executor(stream_plan, dask_client, loaders_per_source={"web": 2, "code": 1}) as ex,
        StreamClient(stream_plan, 0) as r0,
        StreamClient(stream_plan, 1) as r1,
    ):
        assert ex.set_loaders("web", 1) == 1 and ex.set_loaders("code", 2) == 2  # before any step: nothing served
        for r in (r0, r1):
            for _ in range(2 * meta.micro_batches):
                b = next(r)
                oracle.check(b)
                for src, ln in zip(b.segments["source"].tolist(), b.segments["length"].tolist(), strict=True):
                    served[meta.sources[src]] += ln
        assert ex.set_loaders("web", 2) == 2 and ex.set_loaders("code", 1) == 1  # these served: they retire now
        for r in (r0, r1):
            for _ in range((meta.steps - 2) * meta.micro_batches):
                b = next(r)
                for src, ln in zip(b.segments["source"].tolist(), b.segments["length"].tolist(), strict=True):
                    served[meta.sources[src]] += ln
        last = ex.metrics()
    assert {s: (r.loaders, r.unanswered) for s, r in last.retired.items()} == {"web": (3, 0), "code": (3, 0)}
    assert {s: last.sources[s].tokens for s in meta.sources} == dict(served)
