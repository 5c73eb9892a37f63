"""Synthetic index tables for planning benchmarks: the planner needs only lengths, not data files."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from loomdata.schemas.tables import synthetic_index


def index_table(lengths: np.ndarray) -> pa.Table:
    """An index table (INDEX_SCHEMA columns) of text samples with these token counts, one shard."""
    return synthetic_index(lengths)
