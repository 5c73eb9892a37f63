"""Where each sample of one loader partition lives (sample -> shard, row), in compact arrays.

A loader looks up every requested sample here. Kept as three int64 arrays (sample, shard, row) it cost
24 bytes a sample: 300 sources x 8,000 samples took 32 MiB of a worker's 150 loaders. Index samples
are dense and in (shard, row) order (the index contract), so the sample ids are a range (kept only if
they are not), the shard of each sample is a few runs (run starts and shard ids), and a row takes 2 or 4
bytes unless the format's rows are byte offsets past 4 GiB: 2-4 bytes a sample (plus 4 for a checksum).
Where the rows of each run count up by one (Parquet, Megatron: a shard's samples are its rows 0, 1, 2, ...),
no row is kept at all: a row is its run's first row plus its place in the run (`rows` None, `run_rows`), which
took 2.3 MiB off each of the two workers serving 300 sources (150 loaders x 8,000 samples x 2 bytes).

Checksums (`verify: sample`, 4 bytes a sample: 4.4-4.7 MiB a worker at 300 sources) are held only for the samples
of the plan spans a loader plans from now (`SpanChecksums.hold`, from its `PlanAhead`); a sample outside them (a
rank restarted from an earlier step) has the partition's checksums read again from samples.parquet, held until
the spans move on. What is verified and the error on a mismatch do not change: the values are the index's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loomdata.schemas.errors import ExecutionError

__all__ = ["SampleIndex", "SpanChecksums"]


class SpanChecksums:
    """The index's checksum (uint32) of each position of a partition, held only for the positions of the plan spans
    in use (`hold`); `[pos]` gives them like the array they replace, reading every checksum again (`load`: the
    partition's column from samples.parquet, by position) when a position asked for is not held.

    Threads: `hold` (the loader's planning threads) and lookups (its read thread, the event loop) each see one
    consistent state: it is replaced whole, under a lock only for the replacement.
    """

    def __init__(self, load: Callable[[], np.ndarray], size: int) -> None:
        self._load = load
        self.size = size
        self._lock = threading.Lock()
        # (held positions, sorted; their checksums; every checksum, read for a miss, kept until the next `hold`)
        self._state: tuple[np.ndarray, np.ndarray, np.ndarray | None] = (
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.uint32),
            None,
        )
        self.loads = 0  # times every checksum was read (at a `hold` of new positions or a miss)

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        held, sums, every = self._state
        return int(held.nbytes + sums.nbytes + (every.nbytes if every is not None else 0))

    def _every(self) -> np.ndarray:
        every = np.asarray(self._load(), dtype=np.uint32)
        if len(every) != self.size:
            raise ExecutionError(
                f"checksums: {len(every)} read for {self.size} samples: the index changed since this loader started; "
                "restart `loom serve`"
            )
        self.loads += 1
        return every

    def hold(self, pos: np.ndarray) -> None:
        """Hold the checksums of positions `pos` (any order, repeats) and only those: the plan spans now in use."""
        want = np.unique(np.asarray(pos, dtype=np.int64))
        with self._lock:
            held, sums, every = self._state
            if every is None:
                at = np.minimum(np.searchsorted(held, want), max(len(held) - 1, 0))
                known = at < len(held)
                known[known] = held[at[known]] == want[known]
                if not known.all():
                    every = self._every()
            new = every[want] if every is not None else sums[at]
            self._state = (want, new, None)

    def __getitem__(self, pos: np.ndarray) -> np.ndarray:
        """The checksum of each of positions `pos` (an int array), as indexing the full array would give it."""
        pos = np.asarray(pos, dtype=np.int64)
        held, sums, every = self._state
        if every is not None:
            return every[pos]
        at = np.searchsorted(held, pos)
        ok = at < len(held)
        ok[ok] = held[at[ok]] == pos[ok]
        if ok.all():
            return sums[at]
        with self._lock:  # a position outside the spans: read every checksum, held until the spans move on
            held, sums, every = self._state
            if every is None:
                every = self._every()
                self._state = (held, sums, every)
        return every[pos]


@dataclass(frozen=True, slots=True, eq=False)
class SampleIndex:
    """Sample -> (shard, row) of one partition; positions are ranks of samples in sorted order."""

    first: int  # the smallest sample id
    samples: np.ndarray | None  # sorted sample ids; None: they are first .. first + len - 1
    run_starts: np.ndarray  # int64: the position where each run of one shard starts
    run_shards: np.ndarray  # int64: the shard of each run
    rows: np.ndarray | None  # the smallest of uint16, uint32, int64 that holds every row; None: implied (run_rows)
    size: int  # positions (samples)
    checksums: np.ndarray | SpanChecksums | None = None  # uint32 per position, when samples are verified
    run_rows: np.ndarray | None = None  # int64: the row of each run's first position, where `rows` is None

    @classmethod
    def of(
        cls, sample: np.ndarray, shard: np.ndarray, row: np.ndarray, checksum: np.ndarray | None = None
    ) -> SampleIndex:
        """The index of these (sample, shard, row[, checksum]) columns, in any order."""
        order = np.argsort(sample, kind="stable")
        s = np.asarray(sample)[order].astype(np.int64)
        sh = np.asarray(shard)[order].astype(np.int64)
        r = np.asarray(row)[order].astype(np.int64)
        first = int(s[0]) if len(s) else 0
        dense = not len(s) or int(s[-1]) - first + 1 == len(s)  # sorted and distinct (index contract): a range
        cut = np.flatnonzero(np.diff(sh)) + 1
        starts = np.concatenate([[0], cut]).astype(np.int64) if len(sh) else np.zeros(0, np.int64)
        lo, hi = (int(r.min()), int(r.max())) if len(r) else (0, 0)
        fits = [d for d in (np.uint16, np.uint32) if lo >= 0 and hi <= np.iinfo(d).max]
        row_dtype = fits[0] if fits else np.int64
        step_up = np.zeros(len(r), dtype=bool)
        step_up[starts] = True  # where a run starts, any row may follow
        implied = len(r) > 0 and bool(np.all((np.diff(r, prepend=r[:1]) == 1) | step_up))
        return cls(
            first=first,
            samples=None if dense else s.astype(np.uint64),
            run_starts=starts,
            run_shards=sh[starts],
            rows=None if implied else r.astype(row_dtype),
            checksums=None if checksum is None else np.asarray(checksum)[order].astype(np.uint32),
            run_rows=r[starts] if implied else None,
            size=len(r),
        )

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        extra = [a for a in (self.samples, self.checksums, self.rows, self.run_rows) if a is not None]
        return int(self.run_starts.nbytes + self.run_shards.nbytes + sum(a.nbytes for a in extra))

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position, found) of each of `samples`; a position where not found is some valid one (0 if empty)."""
        samples = np.asarray(samples)
        n = len(self)
        if self.samples is None:
            pos = samples.astype(np.int64) - self.first
            found = (samples >= self.first) & (pos < n)
        else:
            pos = np.searchsorted(self.samples, samples).astype(np.int64)
            found = pos < n
            found[found] = self.samples[pos[found]] == samples[found]
        return np.where(found, pos, 0), found

    def shard_at(self, pos: np.ndarray) -> np.ndarray:
        """The shard (int64) of each position."""
        return self.run_shards[self._run_of(pos)]

    def row_at(self, pos: np.ndarray) -> np.ndarray:
        """The row (int64) of each position."""
        if self.rows is not None:
            return self.rows[pos].astype(np.int64)
        assert self.run_rows is not None
        run = self._run_of(pos)
        return self.run_rows[run] + (np.asarray(pos, dtype=np.int64) - self.run_starts[run])

    def _run_of(self, pos: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.run_starts, pos, side="right") - 1
