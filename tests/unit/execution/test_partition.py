"""Loader partitions (contiguous shard ranges = sample ranges) and constructor rank groups."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomdata.execution._partition import partition_source, rank_groups
from loomdata.schemas import ContractError, ExecutionError


def test_partitions_cover_every_sample_once_with_balanced_counts() -> None:
    shards = np.repeat(np.arange(8), [10, 10, 10, 10, 10, 10, 10, 10])
    parts = partition_source(0, "web", shards, 4)
    assert [(p.first_shard, p.stop_shard) for p in parts] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [(p.first_sample, p.stop_sample) for p in parts] == [(0, 20), (20, 40), (40, 60), (60, 80)]
    assert [p.part for p in parts] == [0, 1, 2, 3]


def test_uneven_shards_and_more_loaders_than_shards() -> None:
    shards = np.repeat(np.array([0, 1, 3]), [50, 5, 5])  # shard 2 has no samples
    parts = partition_source(1, "code", shards, 8)
    assert len(parts) == 3
    assert parts[0].first_sample == 0 and parts[-1].stop_sample == 60
    assert all(a.stop_sample == b.first_sample for a, b in itertools.pairwise(parts))
    one = partition_source(1, "code", shards, 1)
    assert [(p.first_shard, p.stop_shard, p.first_sample, p.stop_sample) for p in one] == [(0, 4, 0, 60)]


def test_unsorted_or_empty_index_is_refused() -> None:
    with pytest.raises(ContractError, match="not in shard order"):
        partition_source(0, "web", np.array([1, 0]), 2)
    with pytest.raises(ExecutionError, match="no samples"):
        partition_source(0, "web", np.zeros(0, dtype=np.int64), 2)
    with pytest.raises(ExecutionError, match=">= 1"):
        partition_source(0, "web", np.zeros(3, dtype=np.int64), 0)


def test_rank_groups_are_contiguous_and_complete() -> None:
    assert rank_groups(5, 2) == [[0, 1, 2], [3, 4]]
    assert rank_groups(2, 4) == [[0], [1]]
    with pytest.raises(ExecutionError):
        rank_groups(2, 0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=20), st.integers(1, 12))
def test_any_shards_any_loader_count(counts: list[int], n: int) -> None:
    if sum(counts) == 0:
        return
    shards = np.repeat(np.arange(len(counts)), counts)
    parts = partition_source(0, "s", shards, n)
    assert len(parts) == min(n, sum(1 for c in counts if c))
    assert parts[0].first_sample == 0 and parts[-1].stop_sample == sum(counts)
    last_nonempty = max(i for i, c in enumerate(counts) if c)  # trailing empty shards are not in the index
    assert parts[0].first_shard == 0 and parts[-1].stop_shard == last_nonempty + 1
    for a, b in itertools.pairwise(parts):
        assert a.stop_sample == b.first_sample and a.stop_shard == b.first_shard
    assert all(p.stop_sample > p.first_sample for p in parts)


def test_the_serving_process_keeps_samples_per_shard_and_still_refuses_an_index_out_of_shard_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`FleetOps` keeps counts, not the index's shard column; partitions made from them are the same."""
    import pyarrow as pa

    from loomdata.execution import _actors
    from loomdata.schemas.layout import IndexFiles

    column = np.array([0, 0, 0, 2, 2, 3, 3, 3, 3], dtype=np.uint32)  # shard 1 empty
    monkeypatch.setattr(IndexFiles, "sample_shards", lambda self: pa.table({"shard": column}))
    sizes = _actors._shard_sizes(tmp_path, "web")
    assert sizes.tolist() == [3, 0, 2, 4]
    rebuilt = np.repeat(np.arange(len(sizes)), sizes)
    assert partition_source(0, "web", rebuilt, 2) == partition_source(0, "web", column, 2)
    column = np.array([0, 2, 1], dtype=np.uint32)
    with pytest.raises(ContractError, match="'web': index samples are not in shard order"):
        _actors._shard_sizes(tmp_path, "web")
