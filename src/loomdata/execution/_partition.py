"""Pure partitioners: which shards each Source Loader owns, which ranks each Data Constructor serves.

A loader partition is a contiguous range of shards of one source. Index samples are dense and in
(shard, row) order, so a shard range is also a contiguous sample range `[first_sample, stop_sample)`:
a constructor routes a sample to its loader with one `searchsorted` over partition starts, without
holding any index.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from loomdata.schemas.errors import ContractError, ExecutionError

__all__ = ["LoaderPartition", "partition_source", "rank_groups"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderPartition:
    """Shards `[first_shard, stop_shard)` = samples `[first_sample, stop_sample)` of one source."""

    source_id: int
    source: str
    part: int
    first_shard: int
    stop_shard: int
    first_sample: int
    stop_sample: int

    def __post_init__(self) -> None:
        if self.stop_shard <= self.first_shard or self.stop_sample < self.first_sample:
            raise ExecutionError(f"empty or inverted loader partition {self}")


def partition_source(source_id: int, source: str, sample_shards: np.ndarray, n: int) -> list[LoaderPartition]:
    """Split a source into at most `n` contiguous shard ranges of about equal sample counts.

    `sample_shards` is the index's `shard` column (non-decreasing: samples are in shard order).
    Fewer partitions come back when the source has fewer non-empty shards than `n`.
    """
    if n < 1:
        raise ExecutionError(f"source {source!r}: loaders per source must be >= 1, got {n}")
    shards = np.asarray(sample_shards, dtype=np.int64)
    if len(shards) == 0:
        raise ExecutionError(f"source {source!r}: the index has no samples; nothing to serve")
    if np.any(np.diff(shards) < 0):
        raise ContractError(f"source {source!r}: index samples are not in shard order; rebuild it with `loom index`")
    counts = np.bincount(shards)  # samples per shard id, 0..max shard
    nonempty = np.flatnonzero(counts)
    n = min(n, len(nonempty))
    cum = np.cumsum(counts)  # samples up to the end of each shard id
    # Cut (as an index into the non-empty shards) where the cumulative count reaches k/n of the total,
    # then make the cuts strictly increasing so every partition keeps at least one non-empty shard.
    ideal = np.searchsorted(cum[nonempty], (np.arange(1, n) * int(cum[-1])) // n, side="left") + 1
    cuts = [int(c) for c in ideal]
    for k in range(len(cuts)):
        cuts[k] = max(cuts[k], cuts[k - 1] + 1 if k else 1)
    for k in reversed(range(len(cuts))):
        cuts[k] = min(cuts[k], len(nonempty) - (len(cuts) - k), cuts[k + 1] - 1 if k + 1 < len(cuts) else len(nonempty))
    bounds = [0, *[int(nonempty[c]) for c in cuts], len(counts)]
    parts: list[LoaderPartition] = []
    for a, b in itertools.pairwise(bounds):
        first = int(cum[a - 1]) if a > 0 else 0
        stop = int(cum[b - 1])
        if stop == first:
            continue
        parts.append(
            LoaderPartition(
                source_id=source_id,
                source=source,
                part=len(parts),
                first_shard=a,
                stop_shard=b,
                first_sample=first,
                stop_sample=stop,
            )
        )
    return parts


def rank_groups(dp_size: int, constructors: int) -> list[list[int]]:
    """Contiguous groups of data-parallel ranks, one per constructor (at most one group per rank)."""
    if constructors < 1:
        raise ExecutionError(f"constructors must be >= 1, got {constructors}")
    n = min(constructors, dp_size)
    return [a.tolist() for a in np.array_split(np.arange(dp_size), n)]
