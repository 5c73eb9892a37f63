"""Manifest rows for packing tests: the placement columns a test chose, random provenance around them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.execution._manifest import ManifestRows


def rows_of(cols: dict[str, list[int]], step: int, rng: np.random.Generator) -> ManifestRows:
    """One step's rows with `cols`' dp_rank, micro_batch, length and lane; source, sample and offset drawn from rng."""
    m = len(cols["length"])
    return ManifestRows(
        step=np.full(m, step, dtype=np.int64),
        dp_rank=np.array(cols["dp_rank"], dtype=np.int32),
        micro_batch=np.array(cols["micro_batch"], dtype=np.int32),
        source=rng.integers(0, 3, size=m).astype(np.uint16),
        sample=rng.integers(0, 1000, size=m).astype(np.uint64),
        offset=rng.integers(0, 50, size=m).astype(np.uint32),
        length=np.array(cols["length"], dtype=np.uint32),
        lane=np.array(cols["lane"], dtype=np.int32),
    )


@dataclass
class PackMeta:
    """The plan facts packing reads (micro-batches a rank, each lane's sequence length), without a plan."""

    micro_batches: int
    lanes: tuple[int, ...]

    def lane_seq_len(self, lane: int) -> int:
        return self.lanes[lane]
