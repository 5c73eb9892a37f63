"""Writes the manifest in step-range partitions with a bounded buffer: `manifest/steps-<first>-<last>.parquet`.

Rows arrive step by step, already sorted by (dp_rank, micro_batch, placement order). Partition boundaries
are decided up front from what membership draws (`file_bounds`: a partition ends at the first step by
which it holds `ROWS_PER_FILE` drawn segments), never from the rows balancing makes, so any contiguous
range of steps that starts at a boundary can be balanced and written on its own (planning._distributed)
and the files are the same as one process writes. Memory stays bounded by one partition.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from loomdata.schemas.plan import ManifestFile
from loomdata.schemas.tables import MANIFEST_SCHEMA, TableKind, write_table

__all__ = ["ManifestWriter", "file_bounds"]

ROWS_PER_FILE = 1 << 18
"""Drawn segments per manifest partition (read at call time, so tests may lower it)."""
_COLUMNS = [(f.name, f.type.to_pandas_dtype()) for f in MANIFEST_SCHEMA]


def file_bounds(drawn: np.ndarray, rows_per_file: int | None = None) -> np.ndarray:
    """First step of every partition, and the number of steps appended: `drawn[t]` is the number of segments
    step t draws; a partition closes at the first step by which it holds `rows_per_file` of them."""
    per = ROWS_PER_FILE if rows_per_file is None else rows_per_file
    if per < 1:
        raise ValueError(f"rows_per_file must be >= 1, got {per}")
    cum = np.concatenate([[0], np.cumsum(np.asarray(drawn, dtype=np.int64))])
    steps = len(cum) - 1
    out = [0]
    while out[-1] < steps:  # one iteration per partition file
        t = int(np.searchsorted(cum, cum[out[-1]] + per, side="left"))  # cum[t] >= start + per: steps < t
        out.append(min(max(t, out[-1] + 1), steps))
    return np.asarray(out, dtype=np.int64)


class ManifestWriter:
    """Buffers the rows of the steps from `first_step` on and writes a partition file at each bound."""

    def __init__(self, plan_dir: Path, plan_id: str, bounds: np.ndarray, first_step: int = 0) -> None:
        """`bounds`: file_bounds of the plan (first step of each partition, then the step count); `first_step`:
        the first step this writer receives, a partition's first step."""
        if first_step not in bounds:
            raise ValueError(f"first_step {first_step} is not the first step of a partition")
        self._dir = plan_dir
        self._plan_id = plan_id
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._buf: list[dict[str, np.ndarray]] = []
        self._first = first_step
        self._next = self._bound_after(first_step)
        self.files: list[ManifestFile] = []

    def add(self, step: int, columns: dict[str, np.ndarray]) -> None:
        """Append one step's rows (a column dict without `step`); a step past the partition's last flushes it."""
        while step >= self._next:
            self._flush()
        n = len(columns["sample"])
        if n:
            self._buf.append({"step": np.full(n, step, dtype=np.uint32), **columns})

    def add_block(self, steps: range, step: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        """Append the rows of consecutive `steps` (`step`: each row's step, ascending; columns without `step`),
        flushing every partition that ends before the block's last step, as add does step by step."""
        lo = 0
        while steps.stop - 1 >= self._next:
            hi = int(np.searchsorted(step, self._next, side="left"))
            if hi > lo:
                self._buf.append({"step": step[lo:hi], **{k: v[lo:hi] for k, v in columns.items()}})
            lo = hi
            self._flush()
        if len(step) > lo:
            self._buf.append({"step": step[lo:], **{k: v[lo:] for k, v in columns.items()}})

    def close(self, last_step: int) -> list[ManifestFile]:
        """Flush every partition up to the one holding `last_step` (it must end there) and return the list."""
        while self._first <= last_step:
            self._flush()
        if self._first != last_step + 1:
            raise ValueError(f"step {last_step} is not the last step of a partition")
        return self.files

    def _bound_after(self, step: int) -> int:
        return int(self._bounds[np.searchsorted(self._bounds, step, side="right")])

    def _flush(self) -> None:
        last = self._next - 1
        arrays = [
            pa.array(
                np.concatenate([b[name] for b in self._buf]).astype(dtype, copy=False)
                if self._buf
                else np.zeros(0, dtype=dtype)
            )
            for name, dtype in _COLUMNS
        ]
        table = pa.Table.from_arrays(arrays, schema=MANIFEST_SCHEMA)
        rel = f"manifest/steps-{self._first:08d}-{last:08d}.parquet"
        write_table(table, self._dir / rel, TableKind.MANIFEST, {"plan_id": self._plan_id}, row_group_size=1 << 17)
        self.files.append(ManifestFile(path=rel, first_step=self._first, last_step=last, rows=table.num_rows))
        self._buf.clear()
        self._first = self._next
        self._next = self._bound_after(self._first) if self._first < int(self._bounds[-1]) else self._first + 1
