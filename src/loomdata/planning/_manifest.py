"""Writes the manifest in step-range partitions with a bounded buffer: `manifest/steps-<first>-<last>.parquet`.

Rows arrive step by step, already sorted by (dp_rank, micro_batch, placement order). A partition is
flushed once it holds `rows_per_file` rows (at a step boundary), so memory stays bounded by one
partition whatever the plan's size, and the partition boundaries depend only on the plan's content.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from loomdata.schemas.plan import ManifestFile
from loomdata.schemas.tables import MANIFEST_SCHEMA, TableKind, write_table

__all__ = ["ManifestWriter"]

ROWS_PER_FILE = 1 << 18
_COLUMNS = [(f.name, f.type.to_pandas_dtype()) for f in MANIFEST_SCHEMA]


class ManifestWriter:
    """Buffers per-step rows and writes a partition file whenever the buffer is full."""

    def __init__(self, plan_dir: Path, plan_id: str, rows_per_file: int | None = None) -> None:
        self._dir = plan_dir
        self._plan_id = plan_id
        self._rows_per_file = ROWS_PER_FILE if rows_per_file is None else rows_per_file
        self._buf: list[dict[str, np.ndarray]] = []
        self._rows = 0
        self._first = 0
        self._last = -1
        self.files: list[ManifestFile] = []

    def add(self, step: int, columns: dict[str, np.ndarray]) -> None:
        """Append one step's rows (a column dict without `step`); flush when the partition is full."""
        n = len(columns["sample"])
        if n:
            self._buf.append({"step": np.full(n, step, dtype=np.uint32), **columns})
            self._rows += n
        self._last = step
        if self._rows >= self._rows_per_file:
            self._flush()

    def close(self, last_step: int) -> list[ManifestFile]:
        """Flush the rest (covering every step up to `last_step`) and return the partition list."""
        self._last = last_step
        if self._rows or not self.files or self._first <= last_step:
            self._flush()
        return self.files

    def _flush(self) -> None:
        arrays = [
            pa.array(
                np.concatenate([b[name] for b in self._buf]).astype(dtype, copy=False)
                if self._buf
                else np.zeros(0, dtype=dtype)
            )
            for name, dtype in _COLUMNS
        ]
        table = pa.Table.from_arrays(arrays, schema=MANIFEST_SCHEMA)
        rel = f"manifest/steps-{self._first:08d}-{self._last:08d}.parquet"
        write_table(table, self._dir / rel, TableKind.MANIFEST, {"plan_id": self._plan_id}, row_group_size=1 << 17)
        self.files.append(ManifestFile(path=rel, first_step=self._first, last_step=self._last, rows=table.num_rows))
        self._buf.clear()
        self._rows = 0
        self._first = self._last + 1
