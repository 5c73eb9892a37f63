"""Synthetic index tables for planning benchmarks: the planner needs only lengths, not data files."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def index_table(lengths: np.ndarray) -> pa.Table:
    """An index table (INDEX_SCHEMA columns) of text samples with these token counts, one shard."""
    n = len(lengths)
    return pa.table(
        {
            "sample": pa.array(np.arange(n, dtype=np.uint64)),
            "shard": pa.array(np.zeros(n, dtype=np.uint32)),
            "row": pa.array(np.arange(n, dtype=np.uint64)),
            "num_tokens": pa.array(np.asarray(lengths, dtype=np.uint32)),
            "num_image_tokens": pa.array(np.zeros(n, dtype=np.uint32)),
        }
    )
