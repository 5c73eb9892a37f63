"""The loader's sample -> (shard, row) index: compact, and the same answers as plain sorted arrays."""

from __future__ import annotations

import numpy as np

from loomdata.execution._sample_index import SampleIndex


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
