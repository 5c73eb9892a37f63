"""Plan-driven read-ahead: which units, in which order, how many at once, within the budget, and failures."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._loader_cache import CachePolicy, Offered, PlanUnitCache, UnitUses, unit_key
from loomdata.execution._prefetch import (
    FAST_STEPS_PER_S,
    MAX_EXTRA_STEPS,
    MAX_READS_IN_FLIGHT,
    Prefetcher,
    ReadDepth,
    StepRate,
    coalesce,
    extra_steps,
    plan_prefetch,
    reads_in_flight,
)
from loomdata.schemas import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.schemas.errors import SourceDataError
from loomdata.sources import KeptRows, parquet
from loomdata.sources.parquet import ParquetReader
from loomdata.storage import Location, read_range, request_latency, reset_request_latency
from loomdata.storage._latency import _LATENCY

SRC = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids")


def test_pending_lists_units_by_their_first_use_in_the_range_then_key() -> None:
    u = UnitUses(span=100)
    k = unit_key(0, np.array([5, 3, 5, 9, 1, 7]))
    u.add(k, np.array([4, 2, 1, 2, 30, 0]))
    u.consume(unit_key(0, np.array([7])), np.array([0]))  # unit 7's only use is served: not pending
    keys, first = u.pending(1, 10)
    assert (keys & 0xFFFFFF).tolist() == [5, 3, 9] and first.tolist() == [1, 2, 2]  # unit 1 (step 30) is too far
    keys, first = u.pending(3, 40)
    assert (keys & 0xFFFFFF).tolist() == [5, 1] and first.tolist() == [4, 30]  # unit 5's step-1 use is before lo


def test_plan_prefetch_keeps_plan_order_skips_busy_units_and_bounds_the_count() -> None:
    keys = np.array([50, 30, 90, 10, 70])
    steps = np.array([1, 2, 2, 3, 3])
    assert plan_prefetch(keys, steps, np.array([30, 10]), slots=2).tolist() == [50, 90]
    assert plan_prefetch(keys, steps, np.array([], dtype=np.int64), slots=10).tolist() == [50, 30, 90, 10, 70]
    assert plan_prefetch(keys, steps, np.array([50]), slots=0).tolist() == []


def test_coalesce_joins_free_neighbours_of_one_shard_within_the_gap_count_and_size_bounds() -> None:
    a, b = [int(k) for k in unit_key(1, np.arange(10))], [int(k) for k in unit_key(2, np.arange(3))]
    spans = {k: (100 * i, 100 * i + 90) for i, k in enumerate(a)}  # 10-byte gaps between a's units
    spans |= {k: (100 * i, 100 * i + 90) for i, k in enumerate(b)}
    spans[a[6]] = (600, 600)  # unit 6 empty; unit 7 starts 200 bytes after unit 5 ends (another column between)
    spans[a[7]] = (900, 990)

    def span(k: int) -> tuple[int, int] | None:
        return spans.get(k)

    free = set(a) | set(b)
    # from a[2] forward to a[5] (a[6]'s range is joined too), then back to a[0]; b[0] does not join a[9]
    assert coalesce([a[2], b[0]], free, span, reads=4, max_units=8, max_gap=50) == [a[0:7], b[0:3]]
    assert coalesce([a[2]], free, span, reads=4, max_units=3) == [a[2:5]]  # forward first, then back
    assert coalesce([a[2]], free, span, reads=4, max_bytes=300) == [a[2:5]]  # 2..4: 290 bytes, 2..5 would be 390
    assert coalesce([a[2], a[5]], free - {a[3]}, span, reads=4) == [a[0:3], a[4:10]]  # a held unit splits the run
    assert coalesce([a[7], a[8]], free, span, reads=1, max_gap=50) == [a[7:10]]  # a[6] is 300 bytes back
    assert coalesce([a[1], b[1]], free, lambda k: None, reads=1) == [[a[1]]]  # no ranges: one unit per read, bounded
    assert coalesce([a[1], a[2]], free, lambda k: None, reads=5) == [[a[1]], [a[2]]]


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """One Parquet file of 24 rows in 8 row groups of 3 (row r holds tokens [r, r + 1])."""
    p = tmp_path / "s.parquet"
    pq.write_table(
        pa.table({"ids": pa.array([[r, r + 1] for r in range(24)], pa.list_(pa.int32()))}), p, row_group_size=3
    )
    return p


class _GatedReader(ParquetReader):
    """A real Parquet reader whose read-ahead waits for a gate and records what it loads and how many at once."""

    def __init__(
        self, gate: threading.Event, log: list[int], live: list[int], entered: threading.Event | None = None
    ) -> None:
        super().__init__(SRC, TokenizerSpec(), ImageSpec())
        self.gate, self.log, self.live, self.entered = gate, log, live, entered

    def load_unit(self, path: Location, unit: int, rows: np.ndarray | None = None) -> tuple[Any, int] | None:
        if self.entered is not None:
            self.entered.set()
        self.live[0] += 1
        self.live[1] = max(self.live[1], self.live[0])
        self.gate.wait(10)
        self.log.append(unit)
        try:
            return super().load_unit(path, unit, rows)
        finally:
            self.live[0] -= 1


class _Entered:
    """Set once `n` reads have entered `load_unit` (a `_GatedReader`'s `entered`): both reads of a bound of two are
    inside before the gate opens, so the most at once is not left to which thread starts first."""

    def __init__(self, n: int) -> None:
        self._left, self._lock, self.all_in = n, threading.Lock(), threading.Event()

    def set(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self.all_in.set()


def _setup(
    shard: Path,
    limit: int,
    budget: int = 1 << 20,
    plan_id: str = "p",
    by_rows: bool = False,
    assumed: float = 0.0,
    entered: Any = None,
) -> tuple[Any, ...]:
    gate, log, live = threading.Event(), [], [0, 0]
    policy = CachePolicy(worker_bytes=budget, horizon_steps=6, prefetch=limit)
    cache = PlanUnitCache(plan_id, steps=50, policy=policy, shard_of={str(shard): 3})
    # no assumed step rate: these tests check the horizon itself (a gated read would look slow and widen it)
    pf = Prefetcher(
        cache, lambda: _GatedReader(gate, log, live, entered), {3: shard}, limit, "t", assumed_steps_per_s=assumed
    )
    main = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
    main.use_unit_cache(pf)
    # the plan: step s reads row group order[s] (rows 3g, 3g+1); row group 7 is first needed at step 20
    order = [4, 1, 6, 0, 2, 5]
    rows = np.array([3 * g + i for g in order for i in (0, 1)] + [21])
    steps = np.array([s for s in range(len(order)) for _ in (0, 1)] + [20])
    cache.plan(unit_key(3, main.units(shard, rows)), steps, rows if by_rows else None)
    return gate, log, live, cache, pf, main, order, rows, steps


def test_reads_ahead_in_plan_order_within_the_horizon_and_the_in_flight_bound(shard: Path) -> None:
    entered = _Entered(2)
    gate, log, live, cache, pf, main, order, rows, steps = _setup(shard, limit=2, entered=entered)
    pf.pump(np.array([0]))
    assert pf.in_flight() == 2 and pf.counters.issued == 2  # the bound holds before anything finishes
    assert entered.all_in.wait(10)  # both reads run at once (CI once opened the gate before the second began)
    gate.set()
    assert pf.settle(10)
    assert live[1] == 2  # never more than two at once
    assert sorted(log) == sorted(order)  # the units of steps 0..6 (horizon 6), not group 7 (step 20)
    assert pf.counters.prefetched == 6 and pf.counters.errors == 0
    for s in range(len(order)):  # the served rows equal a plain read; every unit comes from the read-ahead
        sel = steps == s
        got = main.read(shard, rows[sel])
        assert [x.tokens.tolist() for x in got] == [[r, r + 1] for r in rows[sel].tolist()]
        cache.served(unit_key(3, main.units(shard, rows[sel])), steps[sel])
    assert pf.counters.hits == 6 and cache.nbytes == 0  # each dropped at its last use
    pf.close()
    cache.close()


def test_one_at_a_time_follows_the_plan_exactly(shard: Path) -> None:
    gate, log, _, cache, pf, _, order, _, _ = _setup(shard, limit=1, plan_id="p1")
    gate.set()
    pf.pump(np.array([0]))
    assert pf.settle(10)
    assert log == order
    pf.close()
    cache.close()


def test_nothing_is_kept_beyond_the_budget_and_the_soonest_units_are_kept(shard: Path) -> None:
    one = ParquetReader(SRC, TokenizerSpec(), ImageSpec()).load_unit(shard, 0)[1]
    gate, log, _, cache, pf, _, order, _, _ = _setup(shard, limit=1, budget=2 * one + 1, plan_id="p2")
    gate.set()
    pf.pump(np.array([0]))
    assert pf.settle(10)
    held = sorted(k[1] for k in cache._pool.held(cache._owner))
    assert held == sorted(order[:2]) and cache.nbytes <= 2 * one + 1  # the two needed first; the budget is full
    assert pf.counters.prefetched == 2 and len(log) == 3 and pf.counters.dropped == 1  # then it stops issuing
    pf.close()
    cache.close()


def test_a_failed_read_ahead_is_counted_and_the_read_that_needs_it_reports_the_error(shard: Path) -> None:
    gate, _, _, cache, pf, main, _, rows, _ = _setup(shard, limit=2, plan_id="p3")
    shard.write_bytes(b"not parquet at all")  # the read-ahead's own reader opens the file now and fails
    gate.set()
    pf.pump(np.array([0]))
    assert pf.settle(10)
    assert pf.counters.errors > 0 and pf.counters.prefetched == 0 and "s.parquet" in str(pf.last_error)
    fresh = ParquetReader(SRC, TokenizerSpec(), ImageSpec())  # reads the footer anew, as a fresh loader would
    with pytest.raises(SourceDataError, match="not a readable Parquet file"):
        fresh.read(shard, rows[:2])
    with pytest.raises(SourceDataError, match="corrupt or truncated"):  # the held layout: the row group fails
        main.read(shard, rows[:2])
    pf.close()
    cache.close()


def test_extra_steps_cover_the_read_latency_at_the_served_rate() -> None:
    # 0.1 s reads at 200 steps/s: LATENCY_MARGIN (4) reads = 80 steps, 60 of them beyond a 20-step horizon
    assert extra_steps(0.1, 200.0, horizon=20) == 60
    assert extra_steps(0.01, 200.0, horizon=20) == 0  # the horizon already covers fast storage
    assert extra_steps(5.0, 1000.0, horizon=20) == MAX_EXTRA_STEPS
    assert extra_steps(0.0, 200.0, horizon=20) == 0 and extra_steps(0.1, 0.0, horizon=20) == 0  # nothing measured


def test_the_step_rate_is_measured_from_the_first_served_step_not_the_idle_start() -> None:
    rate = StepRate()
    assert not rate.observe(-1, 0.0)  # warmed up at t=0, nothing served for 8 s (the serve starting)
    assert not rate.observe(0, 8.0)  # the first served step starts the measure
    assert not rate.observe(40, 8.0625)  # too soon to measure
    assert rate.observe(125, 8.125)  # 125 steps in 0.125 s: not diluted by the 8 idle seconds
    assert rate.steps_per_s == pytest.approx(1000.0)
    assert not rate.observe(200, 8.25)  # later measures every half second, averaged with the last
    assert rate.observe(1125, 8.625) and rate.steps_per_s == pytest.approx(0.5 * (1000.0 + 2000.0))
    assert not rate.observe(5, 9.0)  # a resume further back restarts the measure, keeps the rate
    assert rate.steps_per_s == pytest.approx(1500.0)


def test_a_wider_reach_reads_further_ahead_and_keeps_those_units(shard: Path) -> None:
    gate, log, _, cache, pf, main, order, _, _ = _setup(shard, limit=8, plan_id="p4")
    gate.set()
    assert cache.reach == 6
    cache.extra_steps = 14  # what a slow store at this rate asks for: group 7 (step 20) is within reach now
    pf.pump(np.array([0]))
    assert pf.settle(10)
    assert sorted(log) == sorted([*order, 7]) and pf.counters.prefetched == 7
    got = main.read(shard, np.array([21]))
    assert [x.tokens.tolist() for x in got] == [[21, 22]] and pf.counters.misses == 0 and pf.counters.hits == 1
    pf.close()
    cache.close()


def test_before_any_step_is_served_a_slow_read_widens_the_reach_at_a_fast_assumed_rate(shard: Path) -> None:
    gate, log, _, cache, pf, *_ = _setup(shard, limit=8, plan_id="p-fast", assumed=FAST_STEPS_PER_S)
    gate.set()
    pf.read_s = 0.1  # a warm-up read took 0.1 s (an object store's latency); no step served, no rate measured
    pf.pump(np.array([0]))
    assert pf.settle(10)
    assert cache.extra_steps >= extra_steps(0.1, FAST_STEPS_PER_S, horizon=6) > 14  # step 20 is within reach
    assert 7 in log and pf.counters.prefetched == 7  # group 7 (first used at step 20) read ahead too
    pf.close()
    cache.close()


def test_for_object_urls_the_reach_is_sized_from_the_stores_get_latency_not_the_whole_read() -> None:
    """A read slowed by decoding or by waiting for a CPU (`read_s`) does not widen the reach; the store's GETs do."""
    url = "memory://loomreach/s.parquet"
    fs = fsspec.filesystem("memory")
    fs.pipe("/loomreach/s.parquet", b"x" * 4096)
    reset_request_latency()
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=6, prefetch=8)
    cache = PlanUnitCache("p-url", steps=2000, policy=policy, shard_of={url: 3})
    pf = Prefetcher(cache, lambda: ParquetReader(SRC, TokenizerSpec(), ImageSpec()), {3: url}, 8, "t", FAST_STEPS_PER_S)
    try:
        read_range(url, 0, 100)  # a real GET of a store with no added latency: well under a millisecond or two
        pf.read_s = 0.1  # yet a whole read took 0.1 s (decode, CPU queueing on a loaded machine)
        pf.pump(np.array([0]))
        assert pf.latency() == request_latency([url]) < 0.05
        assert cache.extra_steps == extra_steps(pf.latency(), FAST_STEPS_PER_S, horizon=6) < 50
        for _ in range(64):  # the store answers its GETs in 100 ms now (the median of its recent GETs)
            _LATENCY.record(url, 0.1)
        pf.pump(np.array([0]))
        assert cache.extra_steps == extra_steps(0.1, FAST_STEPS_PER_S, horizon=6) == 394
    finally:
        pf.close()
        cache.close()
        fs.rm("/loomreach", recursive=True)
        reset_request_latency()


def test_for_local_files_the_reach_is_still_sized_from_the_whole_read(shard: Path) -> None:
    _, _, _, cache, pf, *_ = _setup(shard, limit=8, plan_id="p-local", assumed=FAST_STEPS_PER_S)
    pf.read_s = 0.1
    pf.pump(np.array([0]))
    assert pf.latency() == 0.1 and cache.extra_steps == extra_steps(0.1, FAST_STEPS_PER_S, horizon=6)
    pf.close()
    cache.close()


def test_local_files_assume_no_step_rate_before_one_is_measured(shard: Path) -> None:
    """A slow local read (waiting for a CPU on a loaded worker, not storage) before any step is served keeps the
    horizon: at a fast assumed rate it widened every loader's reach to the cap, and the loaders kept every planned
    step's rows (memory.py, 300 sources)."""
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=6, prefetch=8)
    cache = PlanUnitCache("p-local-default", steps=50, policy=policy, shard_of={str(shard): 3})
    pf = Prefetcher(cache, lambda: ParquetReader(SRC, TokenizerSpec(), ImageSpec()), {3: shard}, 8, "t")
    try:
        pf.read_s = 0.5
        pf.pump(np.array([0]))
        assert pf.settle(10)
        assert cache.extra_steps == 0 and cache.reach == 6
    finally:
        pf.close()
        cache.close()


def test_object_urls_assume_a_fast_rank_before_a_rate_is_measured() -> None:
    url = "memory://loomassumed/s.parquet"
    reset_request_latency()
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=6, prefetch=8)
    cache = PlanUnitCache("p-url-default", steps=2000, policy=policy, shard_of={url: 3})
    pf = Prefetcher(cache, lambda: ParquetReader(SRC, TokenizerSpec(), ImageSpec()), {3: url}, 8, "t")
    try:
        for _ in range(64):
            _LATENCY.record(url, 0.1)
        pf.pump(np.array([0]))
        assert cache.extra_steps == extra_steps(0.1, FAST_STEPS_PER_S, horizon=6) == 394
    finally:
        pf.close()
        cache.close()
        reset_request_latency()


def _count_decodes(reader: Any) -> list[int]:
    """The row groups `reader` decodes from now on (each a fetch of its own, not a unit read ahead)."""
    decoded: list[int] = []
    real = reader._decode_row_group
    reader._decode_row_group = lambda path, info, g: decoded.append(g) or real(path, info, g)
    return decoded


def test_read_ahead_keeps_only_the_planned_rows_and_reads_are_exact(
    shard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parquet, "_WHOLE_SHARE", 1.01)  # 3-row groups: never kept whole here
    gate, _, _, cache, pf, main, order, rows, steps = _setup(shard, limit=2, plan_id="p-rows", by_rows=True)
    gate.set()
    pf.pump(np.array([0]))
    assert pf.settle(10)
    held = dict(cache._pool.items(cache._owner))
    assert sorted(k[1] for k in held) == sorted(order)
    assert all(isinstance(v, KeptRows) and v.rows.tolist() == [3 * k[1], 3 * k[1] + 1] for k, v in held.items())
    for s in range(len(order)):
        sel = steps == s
        got = main.read(shard, rows[sel])
        assert [x.tokens.tolist() for x in got] == [[r, r + 1] for r in rows[sel].tolist()]
        cache.served(unit_key(3, main.units(shard, rows[sel])), steps[sel])
    assert pf.counters.hits == 6 and pf.counters.misses == 0 and cache.nbytes == 0
    pf.close()
    cache.close()


def test_rows_planned_while_a_unit_is_read_ahead_are_kept_too(shard: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk planned during a unit's read ahead wants another row of it: the unit is read again, off the read
    path, so the read of that row finds it held (before: held short, the read fetched the unit itself)."""
    monkeypatch.setattr(parquet, "_WHOLE_SHARE", 1.01)  # 3-row groups: never kept whole here
    gate, log, live, cache, pf, main, *_ = _setup(shard, limit=1, plan_id="p-late", by_rows=True)
    entered = threading.Event()
    pf._make_reader = lambda: _GatedReader(gate, log, live, entered)
    pf.pump(np.array([0]))
    assert entered.wait(10)  # group 4 (rows 12, 13 at step 0) is being read, held at the gate
    cache.plan(unit_key(3, main.units(shard, np.array([14]))), np.array([3]), np.array([14]))  # row 14, step 3
    gate.set()
    assert pf.settle(10)
    held = dict(cache._pool.items(cache._owner))
    assert held[(str(shard), 4)].rows.tolist() == [12, 13, 14] and pf.counters.reread == 1
    assert log.count(4) == 2  # read again at once (the reader's log), never on the read path
    decoded = _count_decodes(main)  # row groups the loader's own reader decodes (fetches) itself
    got = main.read(shard, np.array([14, 12]))
    assert [x.tokens.tolist() for x in got] == [[14, 15], [12, 13]]
    assert decoded == [] and pf.counters.misses == 0 and pf.counters.hits == 1
    pf.close()
    cache.close()


def test_a_row_planned_past_the_reach_during_a_read_ahead_does_not_read_the_unit_again(
    shard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk planned during a unit's read ahead wants a row of it only past the reach: the unit is kept as read
    and read again only when that row's step nears (`PlanUnitCache.served`), not once per chunk planned."""
    monkeypatch.setattr(parquet, "_WHOLE_SHARE", 1.01)  # 3-row groups: never kept whole here
    gate, log, live, cache, pf, main, *_ = _setup(shard, limit=1, plan_id="p-far", by_rows=True)
    entered = threading.Event()
    pf._make_reader = lambda: _GatedReader(gate, log, live, entered)
    pf.pump(np.array([0]))
    assert entered.wait(10)  # group 4 (rows 12, 13 at step 0) is being read, held at the gate
    cache.plan(unit_key(3, main.units(shard, np.array([14]))), np.array([30]), np.array([14]))  # row 14, step 30
    gate.set()
    assert pf.settle(10)
    held = dict(cache._pool.items(cache._owner))
    assert held[(str(shard), 4)].rows.tolist() == [12, 13] and pf.counters.reread == 0 and log.count(4) == 1
    pf.close()
    cache.close()


def test_a_unit_held_short_of_a_row_that_the_reader_fetches_itself_is_a_miss(
    shard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that finds its unit held without a row it asks for decodes the unit itself: counted as a miss."""
    monkeypatch.setattr(parquet, "_WHOLE_SHARE", 1.01)  # 3-row groups: never kept whole here
    gate, _, _, cache, pf, main, *_ = _setup(shard, limit=2, plan_id="p-short", by_rows=True)
    gate.set()
    pf.pump(np.array([0]))
    assert pf.settle(10)
    assert cache._pool.get(cache._owner, (str(shard), 4)).rows.tolist() == [12, 13]  # row 14 not planned: not kept
    decoded = _count_decodes(main)
    got = main.read(shard, np.array([14]))
    assert [x.tokens.tolist() for x in got] == [[14, 15]]
    assert decoded == [4] and pf.counters.misses == 1 and pf.counters.hits == 0  # its read ahead was no hit
    pf.close()
    cache.close()


def test_put_ahead_says_why_a_unit_was_not_kept_and_only_no_room_stalls_the_read_ahead(shard: Path) -> None:
    one = ParquetReader(SRC, TokenizerSpec(), ImageSpec()).load_unit(shard, 0)[1]
    _, _, _, cache, pf, main, order, _, _ = _setup(shard, limit=1, budget=2 * one + 1, plan_id="p-why")
    loaded = main.load_unit(shard, 7)
    assert loaded is not None
    assert cache.put_ahead((str(shard), 7), loaded[0], loaded[1], 0) is Offered.NOT_DUE  # first use step 20
    for g in order[:2]:
        got = main.load_unit(shard, g)
        assert got is not None and cache.put_ahead((str(shard), g), got[0], got[1], 0) is Offered.KEPT
    got = main.load_unit(shard, order[2])
    assert got is not None and cache.put_ahead((str(shard), order[2]), got[0], got[1], 0) is Offered.NO_ROOM
    pf._keep(99, shard, 7, loaded, 0)  # not due: declined, but units due sooner may still be read ahead
    assert not pf._stalled and 99 in pf._declined
    pf._keep(98, shard, order[2], got, 0)  # no room: nothing more is issued until a step is served
    assert pf._stalled
    pf._keep(97, shard, 7, loaded, 0)  # a later "not due" does not lift the stall
    assert pf._stalled
    pf.close()
    cache.close()


def test_reads_in_flight_follow_littles_law_between_the_configured_floor_and_the_cap() -> None:
    assert reads_in_flight(100.0, 0.1, floor=8, cap=32) == 20  # 2 x 100 units/s x 0.1 s
    assert reads_in_flight(10.0, 0.1, floor=8, cap=32) == 8  # 2 needed: the configured floor
    assert reads_in_flight(1000.0, 0.1, floor=8, cap=32) == 32  # 200 needed: the cap
    assert reads_in_flight(0.0, 0.1, floor=8, cap=32) == reads_in_flight(100.0, 0.0, floor=8, cap=32) == 8
    assert reads_in_flight(1000.0, 0.1, floor=40, cap=32) == 40  # a floor above the cap: the user's knob wins


def test_the_step_rate_leaves_out_the_time_spent_waiting_on_storage() -> None:
    """Measured while starved, the rate is the store's: sizing reads in flight from it kept them starved."""
    rate = StepRate()
    assert not rate.observe(0, 0.0, waited=0.0)
    assert rate.observe(100, 0.2, waited=0.1)  # 100 steps in 0.2 s, 0.1 s of it waiting: 1000 steps/s, not 500
    assert rate.steps_per_s == pytest.approx(1000.0)
    assert rate.observe(600, 0.8, waited=0.7)  # waited 0.6 of 0.6 s: at most 90% is left out (500 / 0.06)
    assert rate.steps_per_s == pytest.approx(0.5 * (1000.0 + 500 / 0.06))


def _memory_shard(name: str) -> str:
    """The `shard` fixture's Parquet file (8 row groups of 3 rows) as an object URL in fsspec's memory store."""
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"ids": pa.array([[r, r + 1] for r in range(24)], pa.list_(pa.int32()))}), buf, 3)
    fsspec.filesystem("memory").pipe(f"/{name}/s.parquet", buf.getvalue().to_pybytes())
    return f"memory://{name}/s.parquet"


def test_object_urls_read_more_than_the_configured_count_ahead_once_a_rate_is_measured_and_local_files_do_not(
    shard: Path,
) -> None:
    """At warm-up (no rate yet) a loader of object URLs keeps `limit` in flight, so the first steps' GETs land
    first; with a rate and the store's latency it keeps what they need; local files keep `limit` (decoding)."""
    url = _memory_shard("loomwarm")
    reset_request_latency()
    gate, log, live = threading.Event(), [], [0, 0]
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=10, prefetch=2)
    cache = PlanUnitCache("p-warm", steps=50, policy=policy, shard_of={url: 3})
    pf = Prefetcher(cache, lambda: _GatedReader(gate, log, live), {3: url}, 2, "t")
    try:
        cache.plan(unit_key(3, np.arange(8)), np.arange(8))  # step s reads row group s
        pf.pump(np.array([0]))
        assert pf.depth.reads == 2 and pf.in_flight() == 2  # warm-up: the first steps' units only
        for _ in range(64):
            _LATENCY.record(url, 0.1)  # the store answers in 100 ms
        pf.depth.unit_bytes = 1024.0  # a unit's decoded size known (none landed: the gate holds them)
        cache.served(unit_key(3, np.array([0])), np.array([0]))  # step 0 served, 0.1 s after step -10 was:
        pf.rate._mark = (time.monotonic() - 0.1, -10, 0.0)  # ~100 steps/s, measured at the next pump
        pf.pump(np.array([0]))  # the units first used a step (over the reach, widened by the rate) x ~100 steps/s x
        assert pf.depth.reads > 2 and pf.in_flight() == pf.depth.reads  # 0.1 s x 2, sized and issued at once
        gate.set()
        assert pf.settle(10)
        assert sorted(log) == list(range(8))  # unit 0's step was served while it was read: read, not kept
        assert (pf.counters.prefetched, pf.counters.dropped) == (7, 1)
    finally:
        gate.set()
        pf.close()
        cache.close()
        fsspec.filesystem("memory").rm("/loomwarm", recursive=True)
        reset_request_latency()
    _, _, live, cache, pf, *_ = _setup(shard, limit=2, plan_id="p-warm-local", assumed=FAST_STEPS_PER_S)
    pf.rate.steps_per_s = 100.0
    pf.read_s = 0.1
    pf.pump(np.array([0]))
    assert pf.depth.reads == 2 and pf.in_flight() == 2
    pf.close()
    cache.close()


def test_measured_reads_in_flight_are_bounded_by_the_cap_and_above_the_floor_by_the_free_budget() -> None:
    url = _memory_shard("loombound")
    reset_request_latency()
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=10, prefetch=2)
    cache = PlanUnitCache("p-bound", steps=50, policy=policy, shard_of={url: 3})
    pf = Prefetcher(cache, lambda: ParquetReader(SRC, TokenizerSpec(), ImageSpec()), {3: url}, 2, "t")
    try:
        for _ in range(64):
            _LATENCY.record(url, 0.1)  # the store answers in 100 ms
        pf.rate.steps_per_s, pf.depth.units_per_step = 50.0, 1.0  # 50 units/s: 2 x 50 x 0.1 = 10 reads in flight
        free = cache.pool.free_bytes
        assert pf.depth.size(pf.rate.steps_per_s, pf.latency(), pf.counters, free) == 2  # no unit's size known yet
        pf.depth.unit_bytes = 1024.0
        assert pf.depth.size(pf.rate.steps_per_s, pf.latency(), pf.counters, free) == 10
        pf.rate.steps_per_s = 1000.0  # 200 wanted: the cap
        assert pf.depth.size(pf.rate.steps_per_s, pf.latency(), pf.counters, free) == MAX_READS_IN_FLIGHT
        pf.depth.unit_bytes = float(1 << 18)  # a unit decodes to a quarter of the budget: 4 reads in flight fit
        assert pf.depth.size(pf.rate.steps_per_s, pf.latency(), pf.counters, free) == 4
        pf.depth.unit_bytes = float(1 << 20)  # none fits: the configured floor still reads ahead (offered strictly)
        assert pf.depth.size(pf.rate.steps_per_s, pf.latency(), pf.counters, free) == 2
    finally:
        pf.close()
        cache.close()
        fsspec.filesystem("memory").rm("/loombound", recursive=True)
        reset_request_latency()


def test_reads_in_flight_reserve_their_bytes_for_the_other_loaders_of_the_worker_until_they_end() -> None:
    """Loaders of one worker size their reads from the same free bytes: a read in flight reserves what it will hold
    (against the others, not its own loader) until it ends, before its follow-up pump; close releases queued ones."""
    url = _memory_shard("loomreserve")
    gate, log, live = threading.Event(), [], [0, 0]
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=10, prefetch=2)
    cache = PlanUnitCache("p-reserve", steps=50, policy=policy, shard_of={url: 3})
    other = PlanUnitCache("p-reserve", steps=50, policy=policy, shard_of={"elsewhere": 0})
    pf = Prefetcher(cache, lambda: _GatedReader(gate, log, live), {3: url}, 2, "t")
    try:
        assert cache.pool is other.pool
        cache.plan(unit_key(3, np.arange(8)), np.arange(8))
        pf.depth.unit_bytes = 1024.0  # what a unit decodes to, as if measured
        pf.pump(np.array([0]))
        assert pf.in_flight() == 2 and cache.pool.reserved == 2048  # two units in flight, 1 KiB each
        assert pf.depth.free(cache.pool) == cache.pool.free_bytes  # its own reads count as its requests
        assert ReadDepth(2, sized=True).free(other.pool) == other.pool.free_bytes - 2048  # another loader's view
        gate.set()
        assert pf.settle(10)
        assert cache.pool.reserved == 0
    finally:
        gate.set()
        pf.close()
    gate2 = threading.Event()
    fresh = PlanUnitCache("p-reserve2", steps=50, policy=policy, shard_of={url: 3})
    pf2 = Prefetcher(fresh, lambda: _GatedReader(gate2, [], [0, 0]), {3: url}, 2, "t2")
    try:
        fresh.plan(unit_key(3, np.arange(8)), np.arange(8))
        pf2.depth.unit_bytes = 1024.0
        pf2.pump(np.array([0]))
        assert fresh.pool.reserved == 2048
        pf2.close()  # queued or gated reads no longer size anything: released at close
        assert fresh.pool.reserved == 0
    finally:
        gate2.set()
        pf2.close()
        fresh.close()
        cache.close()
        other.close()
        fsspec.filesystem("memory").rm("/loomreserve", recursive=True)


def test_a_read_that_waits_on_a_unit_in_flight_is_logged_with_when_that_read_was_issued(
    shard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loomdata.execution import _prefetch

    gate, _, _, cache, pf, _, order, _, _ = _setup(shard, limit=2, plan_id="pw")
    pf.pump(np.array([0]))
    assert pf.in_flight() == 2 and not pf.waits
    real = _prefetch.wait_for

    def opening(futs: Any, timeout: float | None = None) -> Any:  # the gate opens once the reader waits
        gate.set()
        return real(futs, timeout)

    monkeypatch.setattr(_prefetch, "wait_for", opening)
    before = time.time()
    assert pf.get((str(shard), order[0])) is not None  # waited for the read ahead, then found the unit held
    assert pf.counters.waited == 1 and len(pf.waits) == 1
    w = pf.waits[0]
    assert w.issued_at <= before <= w.at and w.seconds >= 0 and w.in_flight == 2
    assert w.issued_front == 0 and w.newest == -1  # issued for step 0; nothing served yet
    assert pf.settle(10)
    assert pf.get((str(shard), order[1])) is not None and len(pf.waits) == 1  # held already: no wait, none logged
    pf.close()
    cache.close()
