"""Plan-driven unit caching: pending uses, the shared budget (farthest next use goes), last-use drops, kept rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._loader_cache import CachePolicy, PlanUnitCache, UnitUses, WorkerPool, unit_key
from loomdata.schemas import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import KeptRows, make_reader, parquet


def test_uses_count_down_and_next_use_skips_spent_and_old_steps() -> None:
    u = UnitUses(span=100)
    k = unit_key(np.array([0, 0, 1, 1, 1]), np.array([2, 2, 0, 0, 0]))
    u.add(k, np.array([5, 9, 5, 5, 7]))  # key (0,2) at steps 5, 9; key (1,0) twice at 5, once at 7
    a, b = int(k[0]), int(k[2])
    assert u.next_use(np.array([a, b, 12345]), floor=0).tolist() == [5, 5, -1]
    u.consume(np.array([b]), np.array([5]))
    assert u.next_use(np.array([b]), 0).tolist() == [5]  # one of its two step-5 reads is still to come
    u.consume(np.array([b, a, a]), np.array([5, 5, 5]))  # a's second step-5 read was never planned: ignored
    assert u.next_use(np.array([a, b]), 0).tolist() == [9, 7]
    assert u.next_use(np.array([a, b]), floor=8).tolist() == [9, -1]  # uses before the floor are over
    u.prune(8)
    assert len(u) == 1 and u.next_use(np.array([a]), 0).tolist() == [9]
    u.add(np.array([b]), np.array([20]))  # a later chunk merges in
    assert u.next_use(np.array([a, b]), 0).tolist() == [9, 20]


def test_pool_evicts_the_farthest_next_use_across_owners() -> None:
    pool = WorkerPool(budget=300)
    assert pool.offer(1, ("x", 0), "x0", 100, next_use=10)
    assert pool.offer(2, ("y", 0), "y0", 100, next_use=30)
    assert pool.offer(1, ("x", 1), "x1", 100, next_use=20)
    assert pool.offer(2, ("y", 1), "y1", 100, next_use=15)  # over budget: y0 (step 30) goes
    assert pool.get(2, ("y", 0)) is None and pool.get(1, ("x", 1)) == "x1" and pool.nbytes == 300
    assert pool.offer(1, ("x", 2), "x2", 100, next_use=40)  # needed later than all held: kept while its read runs
    pool.trim()  # ... and the first to go when the budget is restored
    assert pool.get(1, ("x", 2)) is None and pool.nbytes == 300
    assert not pool.offer(1, ("x", 3), "x3", 301, next_use=0)  # larger than the whole budget
    pool.update(1, {("x", 0): -1, ("x", 1): 12})  # x0's last use served
    assert pool.get(1, ("x", 0)) is None and pool.held(1) == [("x", 1)] and pool.nbytes == 200
    pool.drop_owner(2)
    assert pool.nbytes == 100 and pool.owner_bytes(1) == 100


def test_policy_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="worker_bytes"):
        CachePolicy(worker_bytes=-1, horizon_steps=2)
    assert CachePolicy.of(1 << 20, window=3).horizon_steps == 5


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """One Parquet file of 12 rows in 4 row groups of 3 (row r holds tokens [r, r + 1])."""
    p = tmp_path / "s.parquet"
    pq.write_table(
        pa.table({"ids": pa.array([[r, r + 1] for r in range(12)], pa.list_(pa.int32()))}), p, row_group_size=3
    )
    return p


def _reader(shard: Path) -> object:
    src = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids")
    return make_reader(src, TokenizerSpec(), ImageSpec())


def _counting_reader(shard: Path) -> tuple[Any, list[int]]:
    """A real Parquet reader and the row groups it fetches from the file (appended as it reads them)."""
    reader = _reader(shard)
    fetched: list[int] = []
    real = reader._read_row_groups  # type: ignore[attr-defined]

    def counting(path, info, rgs, columns):  # type: ignore[no-untyped-def]
        fetched.extend(int(g) for g in rgs)
        return real(path, info, rgs, columns)

    reader._read_row_groups = counting  # type: ignore[attr-defined]
    return reader, fetched


def test_a_row_group_is_fetched_once_kept_while_planned_and_dropped_at_its_last_use(shard: Path) -> None:
    reader, fetched = _counting_reader(shard)
    cache = PlanUnitCache(
        "plan-a", steps=10, policy=CachePolicy(worker_bytes=1 << 20, horizon_steps=4), shard_of={str(shard): 7}
    )
    reader.use_unit_cache(cache)  # type: ignore[attr-defined]
    # the plan: step 0 reads rows 0, 4; step 1 rows 1, 7; step 2 row 2; step 3 row 5
    plan_rows = {0: [0, 4], 1: [1, 7], 2: [2], 3: [5]}
    steps = np.concatenate([[s] * len(r) for s, r in plan_rows.items()])
    rows = np.concatenate(list(plan_rows.values()))
    keys = unit_key(7, reader.units(shard, rows))  # type: ignore[attr-defined]
    assert reader.units(shard, np.array([0, 3, 11, 12])).tolist() == [0, 1, 3, -1]  # type: ignore[attr-defined]
    cache.plan(keys, steps)
    held = []
    for s, r in plan_rows.items():
        got = reader.read(shard, np.array(r))  # type: ignore[attr-defined]
        assert [x.tokens.tolist() for x in got] == [[v, v + 1] for v in r]  # what is read never depends on the cache
        sel = steps == s
        cache.served(keys[sel], steps[sel])
        held.append(sorted(k[1] for k in cache._pool.held(cache._owner)))
    assert sorted(fetched) == [0, 1, 2]  # each row group once: group 0 (steps 0-2), 1 (0 and 3), 2 (1)
    # after step 0: groups 0 and 1 are still needed; after 1: group 2 (row 7) is done; after 3: nothing
    assert held == [[0, 1], [0, 1], [1], []]
    assert cache.nbytes == 0
    cache.close()
    cache.close()


def test_under_budget_pressure_the_unit_needed_soonest_stays(shard: Path) -> None:
    reader = _reader(shard)
    one_group = reader._read_row_groups(shard, reader._open(shard), np.array([0]), ["ids"]).column(0).combine_chunks()  # type: ignore[attr-defined]
    budget = int(one_group.nbytes) + 1  # room for one row group
    cache = PlanUnitCache(
        "plan-b", steps=10, policy=CachePolicy(worker_bytes=budget, horizon_steps=8), shard_of={str(shard): 0}
    )
    reader.use_unit_cache(cache)  # type: ignore[attr-defined]
    rows = np.array([0, 3, 1, 4])  # step 0 reads groups 0 and 1; group 1 is needed again at step 1, group 0 at step 5
    steps = np.array([0, 0, 5, 1])
    cache.plan(unit_key(0, reader.units(shard, rows)), steps)  # type: ignore[attr-defined]
    reader.read(shard, rows[:2])  # type: ignore[attr-defined]
    cache.served(unit_key(0, reader.units(shard, rows[:2])), steps[:2])  # type: ignore[attr-defined]
    assert [k[1] for k in cache._pool.held(cache._owner)] == [1]  # group 1 (next use step 1) beat group 0 (step 5)
    cache.close()


def test_planned_rows_are_all_a_unit_keeps_and_a_newly_planned_row_drops_it(
    shard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parquet, "_WHOLE_SHARE", 1.01)  # 3-row groups: never kept whole here
    reader = _reader(shard)
    decoded: list[int] = []
    real = reader._decode_row_group  # type: ignore[attr-defined]

    def counting(path, info, g):  # type: ignore[no-untyped-def]
        decoded.append(int(g))
        return real(path, info, g)

    reader._decode_row_group = counting  # type: ignore[attr-defined]
    cache = PlanUnitCache(
        "plan-rows", steps=20, policy=CachePolicy(worker_bytes=1 << 20, horizon_steps=8), shard_of={str(shard): 2}
    )
    reader.use_unit_cache(cache)  # type: ignore[attr-defined]
    rows, steps = np.array([0, 2, 2, 4]), np.array([0, 1, 3, 2])  # group 0: rows 0, 2; group 1: row 4
    keys = unit_key(2, reader.units(shard, rows))  # type: ignore[attr-defined]
    cache.plan(keys, steps, rows)
    assert cache.wanted((str(shard), 0)).tolist() == [0, 2] and cache.wanted((str(shard), 3)).tolist() == []
    assert [s.tokens.tolist() for s in reader.read(shard, np.array([0]))] == [[0, 1]]  # type: ignore[attr-defined]
    (kept,) = [v for _, v in cache._pool.items(cache._owner)]
    assert isinstance(kept, KeptRows) and kept.rows.tolist() == [0, 2] and kept.values.to_pylist() == [[0, 1], [2, 3]]
    assert cache.nbytes == kept.values.nbytes + kept.rows.nbytes  # the budget counts what is kept
    assert [s.tokens.tolist() for s in reader.read(shard, np.array([2, 0]))] == [[2, 3], [0, 1]]  # type: ignore[attr-defined]
    assert decoded == [0]  # served from the kept rows
    assert cache.holds(unit_key(2, np.array([0])), np.array([2])) and not cache.holds(
        unit_key(2, np.array([0])), np.array([1])
    )
    assert [s.tokens.tolist() for s in reader.read(shard, np.array([1]))] == [[1, 2]]  # type: ignore[attr-defined]
    assert decoded == [0, 0]  # an unplanned row of a held group: decoded again, still exact
    cache.plan(unit_key(2, np.array([0])), np.array([5]), np.array([1]))  # a new chunk plans row 1 of group 0
    assert cache._pool.items(cache._owner) == []  # the held rows lack it: dropped, to be read again whole
    cache.close()


def test_the_default_lru_keeps_whole_units(shard: Path) -> None:
    reader = _reader(shard)
    assert reader.unit_cache.wanted((str(shard), 0)) is None  # type: ignore[attr-defined]
    reader.read(shard, np.array([1]))  # type: ignore[attr-defined]
    assert reader.unit_cache.get((str(shard), 0)).to_pylist() == [[0, 1], [1, 2], [2, 3]]  # type: ignore[attr-defined]


def test_a_rank_far_behind_its_peers_keeps_its_units_until_it_stops_asking(shard: Path) -> None:
    """Uses of a step asked for recently stay pending, however far the newest step is ahead (`floor`)."""
    reader, fetched = _counting_reader(shard)
    now = [0.0]
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=4, lag_hold_s=30.0)
    cache = PlanUnitCache("plan-lag", steps=64, policy=policy, shard_of={str(shard): 0}, clock=lambda: now[0])
    reader.use_unit_cache(cache)  # type: ignore[attr-defined]
    # rank B (behind) reads row 3 at step 1, rows 0 and 1 (group 0) at steps 2 and 3;
    # rank A (ahead) rows 9 and 10 at steps 40 and 41
    plan_rows = {1: 3, 2: 0, 3: 1, 40: 9, 41: 10}
    steps = np.array(list(plan_rows), dtype=np.int64)
    rows = np.array(list(plan_rows.values()))
    keys = unit_key(0, reader.units(shard, rows))  # type: ignore[attr-defined]
    cache.plan(keys, steps)

    def serve(step: int) -> None:
        sel = steps == step
        reader.read(shard, rows[sel])  # type: ignore[attr-defined]
        cache.served(keys[sel], steps[sel])

    serve(1)  # B
    now[0] = 1.0
    serve(40)  # A, a chunk ahead: the uses are pruned up to the floor, which B holds at step 1
    assert cache.floor == 1
    serve(2)  # B: group 0 is decoded and kept for step 3 ...
    assert [k[1] for k in cache._pool.held(cache._owner)] == [0]
    serve(3)  # ... which reads it without decoding it again
    assert fetched.count(0) == 1
    now[0] = 100.0  # B has not asked for 97 s: it no longer holds the floor back
    serve(41)
    assert cache.floor == 41 - 4
    cache.close()


def test_rows_of_served_steps_are_not_wanted_again_while_the_floor_lags(
    shard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lagging floor (`lag_hold_s`) keeps pending uses, not the rows of steps already served."""
    monkeypatch.setattr(parquet, "_WHOLE_SHARE", 1.01)  # 3-row groups: never kept whole here
    reader = _reader(shard)
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=4, chunk_steps=2, lag_hold_s=30.0)
    cache = PlanUnitCache("plan-served", steps=64, policy=policy, shard_of={str(shard): 0}, clock=lambda: 0.0)
    reader.use_unit_cache(cache)  # type: ignore[attr-defined]
    rows, steps = np.array([0, 1, 2, 9]), np.array([1, 3, 9, 8])  # group 0 at steps 1, 3, 9; group 3 at step 8
    keys = unit_key(0, reader.units(shard, rows))  # type: ignore[attr-defined]
    cache.plan(keys, steps, rows)
    assert cache.wanted((str(shard), 0)).tolist() == [0, 1, 2]
    cache.served(keys[:1], steps[:1])  # a rank behind serves step 1 ...
    cache.served(keys[3:], steps[3:])  # ... and one ahead step 8: the floor stays at step 1 (asked within 30 s)
    assert cache.floor == 1
    assert cache.wanted((str(shard), 0)).tolist() == [1, 2]  # before: [0, 1, 2], so units looked mostly wanted
    assert len(cache.rows) == 2  # pruned at the new chunk: the served rows went with their uses
    cache.close()


def test_a_row_planned_past_the_reach_keeps_the_unit_until_that_row_nears(
    shard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a global shuffle most held units gain a row with every chunk planned: one planned past the reach
    (`keep_steps`) does not drop the unit at once, only when its step comes within the reach (then read again)."""
    monkeypatch.setattr(parquet, "_WHOLE_SHARE", 1.01)
    reader, fetched = _counting_reader(shard)
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=4, chunk_steps=100, keep_steps=12)
    cache = PlanUnitCache("plan-keep", steps=64, policy=policy, shard_of={str(shard): 0})
    reader.use_unit_cache(cache)  # type: ignore[attr-defined]
    assert cache.plan_reach == 16 and cache.near() == 4
    rows = np.array([0, 2, 9, 9, 9, 9, 9, 9])  # group 0 at steps 0, 1; group 3 (row 9) at steps 2..7
    steps = np.array([0, 1, 2, 3, 4, 5, 6, 7])
    keys = unit_key(0, reader.units(shard, rows))  # type: ignore[attr-defined]
    cache.plan(keys, steps, rows)
    reader.read(shard, np.array([0]))  # type: ignore[attr-defined]
    held = dict(cache._pool.items(cache._owner))
    assert held[(str(shard), 0)].rows.tolist() == [0, 2]
    late = unit_key(0, np.array([0]))
    cache.plan(late, np.array([12]), np.array([1]))  # row 1 at step 12: past the reach of step 0 (4)
    assert (str(shard), 0) in dict(cache._pool.items(cache._owner))  # kept: row 1 is not due yet
    cache.plan(late, np.array([3]), np.array([1]))  # ... but a row it lacks within the reach drops it at once
    assert (str(shard), 0) not in dict(cache._pool.items(cache._owner))
    reader.read(shard, np.array([0]))  # type: ignore[attr-defined]
    assert dict(cache._pool.items(cache._owner))[(str(shard), 0)].rows.tolist() == [0, 1, 2]
    cache.plan(late, np.array([14]), np.array([1]))  # covered: nothing to mark
    reader.read(shard, np.array([9]))  # type: ignore[attr-defined]
    cache.served(keys[:3], steps[:3])  # steps 0-2: group 0 is next used at step 3, within the reach
    assert (str(shard), 0) in dict(cache._pool.items(cache._owner))
    before = fetched.count(0)
    for s in range(3, 8):  # group 3's steps; group 0's next use (step 12) lies within the planned reach
        sel = steps == s
        cache.served(keys[sel], steps[sel])
    assert (str(shard), 0) in dict(cache._pool.items(cache._owner)) and fetched.count(0) == before
    cache.close()


def test_policy_keep_steps() -> None:
    with pytest.raises(ValueError, match="keep_steps"):
        CachePolicy(worker_bytes=1, horizon_steps=2, keep_steps=-1)
    assert CachePolicy.of(1 << 20, window=3).keep_steps > 0
    assert CachePolicy.of(0, window=3).keep_steps == 0  # no cache: nothing to keep rows for


def test_keep_now_shortens_gradually_with_the_bytes_held() -> None:
    """Rows past the horizon (read ahead, or kept past the reach) are held for fewer steps as the worker's loaders
    hold more than the soft bytes: in proportion, never below a `KEEP_MIN_SHARE`th (no cliff where every use decodes
    again)."""
    from loomdata.execution._loader_cache import KEEP_MIN_SHARE, KEEP_SOFT_BYTES

    policy = CachePolicy(worker_bytes=2000, horizon_steps=4, keep_steps=40, keep_soft_bytes=100)
    cache = PlanUnitCache("plan-soft", steps=64, policy=policy, shard_of={"f": 0})
    pool, owner = cache._pool, cache._owner
    cache.extra_steps = 8  # a read-ahead's cover for storage latency past the horizon: never narrowed
    assert cache.keep_now == 40 and cache.reach == 12
    rows = KeptRows(np.array([0]), "rows")
    pool.offer(owner, ("f", 9), "whole", 900, next_use=1)  # whole units are not counted: they serve many reads
    assert cache.keep_now == 40 and cache.reach == 12
    pool.offer(owner, ("f", 0), rows, 100, next_use=1)
    assert cache.keep_now == 40 and cache.reach == 12  # at the soft bytes: all of it
    pool.offer(owner, ("f", 1), rows, 100, next_use=1)
    assert cache.keep_now == 20 and cache.reach == 2 + 8  # twice the soft bytes: half the steps (of the horizon)
    pool.offer(owner, ("f", 2), rows, 800, next_use=1)
    assert cache.keep_now == 40 // KEEP_MIN_SHARE and cache.reach == 4 // KEEP_MIN_SHARE + 8  # ten times: the floor
    assert cache.plan_reach == 52 and cache.floor == -5  # planned (and dropped) as before, the floor unscaled
    pool.drop(owner, ("f", 2))
    assert pool.rows_nbytes == 200 and pool.nbytes == 1100 and cache.keep_now == 20
    cache.close()
    assert CachePolicy.of(256 << 20, window=3).keep_soft_bytes == KEEP_SOFT_BYTES  # the default budget
    assert CachePolicy.of(1 << 30, window=3).keep_soft_bytes == (1 << 30) // 32  # a larger budget keeps more rows
    assert CachePolicy.of(1 << 10, window=3).keep_soft_bytes == 1 << 10  # at most the budget
    with pytest.raises(ValueError, match="keep_soft_bytes"):
        CachePolicy(worker_bytes=1, horizon_steps=2, keep_soft_bytes=-1)


def test_rows_wanted_stop_at_the_steps_kept_now(shard: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the soft bytes a unit keeps the rows planned within the reach and `keep_now`; a later row makes it
    stale, so it is read again (with that row) when the row's step nears, not kept all the way out."""
    monkeypatch.setattr(parquet, "_WHOLE_SHARE", 1.01)
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=4, chunk_steps=100, keep_steps=12, keep_soft_bytes=1)
    cache = PlanUnitCache("plan-soft-rows", steps=64, policy=policy, shard_of={str(shard): 0})
    keys = unit_key(np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64))
    cache.plan(keys, np.array([0, 6, 15]), np.array([0, 1, 2]))
    assert cache.wanted((str(shard), 0)).tolist() == [0, 1, 2]  # nothing held: the whole keep_steps
    cache._pool.offer(cache._owner, ("other", 0), KeptRows(np.array([0]), "x"), 1000, next_use=1)  # 1000x the soft
    assert cache.keep_now == 3 and cache.reach == 1
    assert cache.wanted((str(shard), 0)).tolist() == [0]  # steps 6 and 15 lie past 0 + 1 + 3
    assert cache.first_missing((str(shard), 0), np.array([0])) == 6
    cache.close()
