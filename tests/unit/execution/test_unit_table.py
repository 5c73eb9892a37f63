"""`UnitTable` (session 27): the unit key of every (shard, row) in one search of all shards' unit starts equals a
per-shard search of each shard's own starts, as `ParquetReader.units` answers (empty row groups, rows out of range,
shards not told, shards told in any order and in several batches)."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.execution._loader_cache import unit_key
from loomdata.execution._plan_ahead import UnitTable


def _reference(starts: dict[int, np.ndarray], shard: np.ndarray, row: np.ndarray) -> list[int]:
    """`ParquetReader.units` per shard (searchsorted of its starts, -1 out of range), as a unit key."""
    out = []
    for s, r in zip(shard.tolist(), row.tolist(), strict=True):
        got = starts.get(s)
        if got is None or not 0 <= r < int(got[-1]):
            out.append(-1)
            continue
        g = int(np.searchsorted(got, r, side="right")) - 1
        out.append(int(unit_key(s, g)) if g >= 0 else -1)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_unit_keys_of_all_shards_at_once_equal_each_shards_own_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    starts = {}
    for s in rng.choice(50, 12, replace=False).tolist():
        sizes = rng.integers(0, 6, int(rng.integers(0, 7)))  # empty row groups (0 rows) and empty files too
        starts[s] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    table, told = UnitTable(), {}
    shards = list(starts)
    for batch in np.array_split(np.array(shards), 3):  # told in batches, the later ones between the earlier
        table.add({s: starts[s] for s in batch.tolist()})
        told.update({s: starts[s] for s in batch.tolist()})
        assert all(s in table for s in told) and 999 not in table
        shard = rng.choice(np.array([*shards, 999]), 300)
        row = rng.integers(-2, 30, 300)
        assert table.keys(shard, row).tolist() == _reference(told, shard, row)


def test_an_empty_table_knows_no_unit() -> None:
    assert UnitTable().keys(np.array([1, 2]), np.array([0, 0])).tolist() == [-1, -1]
