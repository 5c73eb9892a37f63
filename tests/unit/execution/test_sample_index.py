"""The loader's sample -> (shard, row) index: compact, and the same answers as plain sorted arrays; the checksums a
planned loader holds (`HeldChecksums`): from the floor to the spans planned, the index's values, read again only
for a read behind them."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.execution._sample_index import HeldChecksums, SampleIndex
from loomdata.schemas.errors import StaleIndexError


def _plain(sample: np.ndarray, shard: np.ndarray, row: np.ndarray, ask: np.ndarray) -> tuple[np.ndarray, ...]:
    order = np.argsort(sample, kind="stable")
    s, sh, r = sample[order], shard[order], row[order]
    pos = np.minimum(np.searchsorted(s, ask), len(s) - 1)
    found = s[pos] == ask
    return found, sh[pos][found], r[pos][found]


def test_a_dense_index_keeps_no_sample_ids_and_two_bytes_a_row() -> None:
    n = 8000
    sample = np.arange(100, 100 + n, dtype=np.uint64)
    shard = np.repeat(np.arange(4), n // 4) + 7
    row = np.tile(np.arange(n // 4), 4)[::-1].copy()  # rows not counting up within a shard: kept
    rng = np.random.default_rng(0)
    perm = rng.permutation(n)  # handed over in any order
    idx = SampleIndex.of(sample[perm], shard[perm], row[perm])
    assert idx.samples is None and idx.rows is not None and idx.rows.dtype == np.uint16
    assert idx.run_shards.tolist() == [7, 8, 9, 10] and len(idx) == n
    assert idx.nbytes < 3 * n  # was 24 bytes a sample
    wide = SampleIndex.of(sample, shard, row + 70_000).rows
    assert wide is not None and wide.dtype == np.uint32
    ask = np.array([100, 2099, 2100, 8099, 99, 8100, 5000], dtype=np.uint64)
    pos, found = idx.locate(ask)
    want_found, want_shard, want_row = _plain(sample, shard, row, ask)
    assert found.tolist() == want_found.tolist() == [True, True, True, True, False, False, True]
    assert idx.shard_at(pos[found]).tolist() == want_shard.tolist()
    assert idx.row_at(pos[found]).tolist() == want_row.tolist()


def test_rows_counting_up_within_each_shard_are_implied_not_kept() -> None:
    n = 8000
    sample = np.arange(100, 100 + n, dtype=np.uint64)
    shard = np.repeat(np.arange(4), n // 4) + 7
    row = np.tile(np.arange(n // 4), 4) + np.repeat([0, 5, 0, 70_000], n // 4)  # each shard's rows from some row on
    perm = np.random.default_rng(1).permutation(n)
    idx = SampleIndex.of(sample[perm], shard[perm], row[perm])
    assert idx.rows is None and len(idx) == n and idx.nbytes < 100  # runs only, no bytes per sample
    ask = np.array([100, 2099, 2100, 2101, 8099, 99, 8100, 5000, 7000], dtype=np.uint64)
    pos, found = idx.locate(ask)
    want_found, want_shard, want_row = _plain(sample, shard, row, ask)
    assert found.tolist() == want_found.tolist()
    assert idx.shard_at(pos[found]).tolist() == want_shard.tolist()
    assert idx.row_at(pos[found]).tolist() == want_row.tolist()
    skipped = np.delete(np.arange(n), 3000)  # a row missing inside shard 8: its rows stop counting by one
    kept = SampleIndex.of(sample[skipped], shard[skipped], row[skipped])
    assert kept.rows is not None
    assert kept.row_at(kept.locate(sample[skipped])[0]).tolist() == row[skipped].tolist()


def test_gaps_keep_the_ids_and_large_rows_stay_int64() -> None:
    sample = np.array([5, 9, 2, 40], dtype=np.uint64)  # not a range (skipped samples)
    shard = np.array([1, 2, 1, 2])
    row = np.array([10, 1 << 33, 3, 7])  # a byte offset past 4 GiB
    idx = SampleIndex.of(sample, shard, row, checksum=np.array([50, 90, 20, 400]))
    assert idx.samples is not None and idx.rows is not None and idx.rows.dtype == np.int64
    ask = np.array([9, 3, 40, 2], dtype=np.uint64)
    pos, found = idx.locate(ask)
    want_found, want_shard, want_row = _plain(sample, shard, row, ask)
    assert found.tolist() == want_found.tolist() == [True, False, True, True]
    assert idx.shard_at(pos[found]).tolist() == want_shard.tolist() == [2, 2, 1]
    assert idx.row_at(pos[found]).tolist() == want_row.tolist() == [1 << 33, 7, 3]
    assert idx.checksums is not None and idx.checksums[pos[found]].tolist() == [90, 400, 20]


class _Index:
    """A partition's checksums as samples.parquet holds them; `load` reads them again (counted), or fails."""

    def __init__(self, n: int) -> None:
        self.every = np.random.default_rng(5).integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
        self.reads = 0
        self.fail: Exception | None = None

    def load(self) -> np.ndarray:
        if self.fail is not None:
            raise self.fail
        self.reads += 1
        return self.every.copy()


def test_held_checksums_follow_the_floor_and_the_spans_planned() -> None:
    n = 8000
    idx = _Index(n)
    held = HeldChecksums(idx.load, n, every=idx.every.copy())  # read with the index at start
    rng = np.random.default_rng(1)
    plan = [rng.choice(n, size=20, replace=False) for _ in range(100)]  # 100 steps of 20 samples
    span = 4  # steps a manifest span holds: the reach (12) spans several
    held.hold(np.concatenate(plan[:span]), np.repeat(np.arange(span), 20), 0)
    assert idx.reads == 0 and held.held <= 20 * span  # the first span's from those read at start, which go
    for first in range(span, 16, span):
        held.hold(np.concatenate(plan[first : first + span]), np.repeat(np.arange(first, first + span), 20), first)
    for step in range(100):
        floor = step - 8  # the cache's: the horizon behind the newest step served
        nxt = step + 12
        if nxt % span == 0 and nxt < 100:  # planning reads the span the reach enters
            held.hold(np.concatenate(plan[nxt : nxt + span]), np.repeat(np.arange(nxt, nxt + span), 20), nxt)
        np.testing.assert_array_equal(held[plan[step]], idx.every[plan[step]])
        held.release(floor)
        if step >= 8:
            live = np.unique(np.concatenate(plan[max(floor, 0) : min(nxt + span, 100)]))
            assert held.held <= len(live) and held.held < n // 3  # only from the floor on, never every one
    assert held.rereads == 0  # a forward run never reads them again for a read
    assert 0 < held.loads == idx.reads <= 100 // span  # one read a span planned, at most
    assert held.nbytes < n  # 12 bytes a held sample, against 4 a sample (32,000 bytes) for every one


def test_a_read_behind_the_held_steps_reads_them_again_and_keeps_them_while_it_lags() -> None:
    n = 1000
    idx = _Index(n)
    held = HeldChecksums(idx.load, n)
    held.hold(np.array([5, 6, 7]), np.array([40, 40, 41]), 40)
    held.release(38)
    assert idx.reads == 1 and held.held == 3 and held.covers(np.array([5, 7])) and not held.covers(np.array([1]))
    np.testing.assert_array_equal(held[np.array([1, 2, 5])], idx.every[[1, 2, 5]])  # a rank restarted at step 3
    assert held.rereads == 1 and idx.reads == 2 and held.held == n
    held.release(3)  # it holds the floor back: every checksum kept, read once
    np.testing.assert_array_equal(held[np.array([3, 900])], idx.every[[3, 900]])
    assert held.rereads == 1
    held.release(41)  # caught up (or stopped asking): back to the held steps only
    assert held.held == 1 and held.covers(np.array([7])) and held.nbytes < 100
    idx.fail = StaleIndexError("samples.parquet: index changed since `loom serve` started")
    np.testing.assert_array_equal(held[np.array([7])], idx.every[[7]])  # held: no read
    with pytest.raises(StaleIndexError):  # the read's own error, never values of another index
        held[np.array([8])]
    with pytest.raises(StaleIndexError):  # planning's caller counts it and goes on
        held.hold(np.array([9]), np.array([42]), 42)
    assert not held.covers(np.array([9])) and held.held == 1


def test_holding_more_than_a_third_of_the_partition_holds_every_checksum() -> None:
    n = 300
    idx = _Index(n)
    held = HeldChecksums(idx.load, n)
    held.hold(np.arange(0, 180, 2), np.zeros(90, dtype=np.int64), 0)  # 90 positions: 1,080 bytes, < every's 1,200
    assert not held.dense and held.held == 90 and held.nbytes == 90 * 12 < 4 * n
    held.hold(np.arange(1, 40, 2), np.ones(20, dtype=np.int64), 0)  # 110 of 300: 1,320 bytes
    assert held.dense and held.held == n and held.nbytes == 4 * n
    held.release(10**6)
    held.hold(np.arange(250, 290), np.full(40, 9, dtype=np.int64), 8)
    assert held.held == n and idx.reads == 2  # one read a span held, none once every one is
    np.testing.assert_array_equal(held[np.array([299, 0])], idx.every[[299, 0]])


def test_a_span_whose_hold_failed_keeps_every_checksum_read_for_it_until_the_floor_passes_it() -> None:
    """A transient failure holding a span's checksums costs one read again for that span, not one a request."""
    n = 1000
    idx = _Index(n)
    held = HeldChecksums(idx.load, n)
    held.hold(np.array([1, 2]), np.array([0, 1]), 0)
    idx.fail = OSError("samples.parquet: a transient read error")
    with pytest.raises(OSError):
        held.hold(np.array([10, 11, 12, 13]), np.array([2, 3, 4, 5]), 2)  # planning counts it and goes on
    idx.fail = None
    reads = idx.reads
    for step, pos in zip(range(2, 6), (10, 11, 12, 13), strict=True):
        np.testing.assert_array_equal(held[np.array([pos])], idx.every[[pos]])
        held.release(step)  # the floor moves through the span whose hold failed
    assert idx.reads == reads + 1 and held.rereads == 1  # read again once, kept through the span
    held.release(6)  # past it: every checksum goes
    assert held.held == 0
