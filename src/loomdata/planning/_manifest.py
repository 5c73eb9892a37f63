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
    """Buffers the rows of the steps from `first_step` on and writes a partition file at each bound.

    The rows go straight into one array a column in the column's final dtype (grown as needed, kept between
    partitions), so a partition is written from those arrays as they are: no list of blocks to concatenate and
    cast at every flush, and a block's gathered columns (`add_block`'s `take`) are written once, in place."""

    def __init__(self, plan_dir: Path, plan_id: str, bounds: np.ndarray, first_step: int = 0) -> None:
        """`bounds`: file_bounds of the plan (first step of each partition, then the step count); `first_step`:
        the first step this writer receives, a partition's first step."""
        if first_step not in bounds:
            raise ValueError(f"first_step {first_step} is not the first step of a partition")
        self._dir = plan_dir
        self._plan_id = plan_id
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._cols: dict[str, np.ndarray] = {name: np.empty(0, dtype=dtype) for name, dtype in _COLUMNS}
        self._rows = 0
        self._first = first_step
        self._next = self._bound_after(first_step)
        self.files: list[ManifestFile] = []

    def add(self, step: int, columns: dict[str, np.ndarray]) -> None:
        """Append one step's rows (a column dict without `step`); a step past the partition's last flushes it."""
        while step >= self._next:
            self._flush()
        n = len(columns["sample"])
        if n:
            at = self._reserve(n)
            self._cols["step"][at : at + n] = step
            for k, v in columns.items():
                self._cols[k][at : at + n] = v  # cast to the column's dtype as astype does

    def add_block(
        self,
        steps: range,
        row_step: np.ndarray,
        columns: dict[str, np.ndarray],
        take: tuple[np.ndarray, dict[str, np.ndarray]] | None = None,
        offset_delta: np.ndarray | None = None,
    ) -> None:
        """Append the rows of consecutive `steps` (`row_step`: each row's step within the block, ascending;
        `columns` without `step`, one value a row), flushing every partition that ends before the block's last
        step, as add does step by step. `take`: (item, base columns): the row's value of each such column is
        `base[item]`, gathered straight into the buffer; `offset_delta` is then added to the gathered `offset`
        (the piece's first token within its segment)."""
        lo = 0
        while steps.stop - 1 >= self._next:
            hi = int(np.searchsorted(row_step, self._next - steps.start, side="left"))
            self._put(steps.start, row_step, columns, take, offset_delta, lo, hi)
            lo = hi
            self._flush()
        self._put(steps.start, row_step, columns, take, offset_delta, lo, len(row_step))

    def close(self, last_step: int) -> list[ManifestFile]:
        """Flush every partition up to the one holding `last_step` (it must end there) and return the list."""
        while self._first <= last_step:
            self._flush()
        if self._first != last_step + 1:
            raise ValueError(f"step {last_step} is not the last step of a partition")
        return self.files

    def _put(
        self,
        start: int,
        row_step: np.ndarray,
        columns: dict[str, np.ndarray],
        take: tuple[np.ndarray, dict[str, np.ndarray]] | None,
        offset_delta: np.ndarray | None,
        lo: int,
        hi: int,
    ) -> None:
        """Rows lo..hi-1 of a block into the buffers (the same values as astype of each column to its dtype)."""
        n = hi - lo
        if n <= 0:
            return
        at = self._reserve(n)
        cols = self._cols
        np.add(row_step[lo:hi], start, out=cols["step"][at : at + n], casting="unsafe")
        for k, v in columns.items():
            cols[k][at : at + n] = v[lo:hi]
        if take is not None:
            item, base = take
            part = item[lo:hi]
            for k, v in base.items():
                out = cols[k][at : at + n]
                if v.dtype == out.dtype:
                    np.take(v, part, out=out)
                else:
                    out[:] = v[part]
            if offset_delta is not None:
                out = cols["offset"][at : at + n]
                np.add(out, offset_delta[lo:hi], out=out, casting="unsafe")  # int64 sum, then cast as astype

    def _reserve(self, n: int) -> int:
        """Room for n more rows in every column (the rows so far kept); returns the first new row. Grown to what is
        needed or by a quarter, so the buffers stay near the largest partition's rows (a doubling left up to twice
        that held: +1 B of peak RSS a sample at 300 sources x 10M)."""
        at = self._rows
        need = at + n
        have = len(self._cols["step"])
        if need > have:
            cap = max(need, have + have // 4)
            for k, v in self._cols.items():
                grown = np.empty(cap, dtype=v.dtype)
                grown[:at] = v[:at]
                self._cols[k] = grown
        self._rows = need
        return at

    def _bound_after(self, step: int) -> int:
        return int(self._bounds[np.searchsorted(self._bounds, step, side="right")])

    def _flush(self) -> None:
        last = self._next - 1
        rows = self._rows
        table = pa.Table.from_arrays(
            [pa.array(self._cols[name][:rows]) for name, _ in _COLUMNS], schema=MANIFEST_SCHEMA
        )
        rel = f"manifest/steps-{self._first:08d}-{last:08d}.parquet"
        write_table(table, self._dir / rel, TableKind.MANIFEST, {"plan_id": self._plan_id}, row_group_size=1 << 17)
        self.files.append(ManifestFile(path=rel, first_step=self._first, last_step=last, rows=table.num_rows))
        del table  # the buffers are reused for the next partition: nothing may keep a view of them
        self._rows = 0
        self._first = self._next
        self._next = self._bound_after(self._first) if self._first < int(self._bounds[-1]) else self._first + 1
