"""Where each sample of one loader partition lives (sample -> shard, row), in compact arrays.

A loader looks up every requested sample here. Kept as three int64 arrays (sample, shard, row) it cost
24 bytes a sample: 300 sources x 8,000 samples took 32 MiB of a worker's 150 loaders. Index samples
are dense and in (shard, row) order (the index contract), so the sample ids are a range (kept only if
they are not), the shard of each sample is a few runs (run starts and shard ids), and a row takes 2 or 4
bytes unless the format's rows are byte offsets past 4 GiB: 2-4 bytes a sample (plus 4 for a checksum).
Where the rows of each run count up by one (Parquet, Megatron: a shard's samples are its rows 0, 1, 2, ...),
no row is kept at all: a row is its run's first row plus its place in the run (`rows` None, `run_rows`), which
took 2.3 MiB off each of the two workers serving 300 sources (150 loaders x 8,000 samples x 2 bytes).

Checksums (`verify: sample`, 4 bytes a sample: 4.4-4.7 MiB a worker at 300 sources): a planned loader holds only
those of the samples its plan reads from the cache's floor (the oldest step a request may still ask) to the newest
step planned ahead (`HeldChecksums`), each until its last planned step falls behind the floor; a sample outside them
(a rank restarted from an earlier step) has the partition's checksums read again from samples.parquet, only from
the index the loader started with (its fingerprint checked on every read), kept while a request lags behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from loomdata.schemas.errors import StaleIndexError

__all__ = ["HeldChecksums", "SampleIndex"]

_NONE = np.zeros(0, dtype=np.uint32)
_NO_DROP = np.iinfo(np.int64).max
_STEP = np.int32  # a plan step (plans have far fewer than 2^31 steps): 4 bytes a held position's last step


@dataclass(frozen=True, slots=True)
class _Held:
    """One consistent state of `HeldChecksums` (replaced whole, never changed in place)."""

    pos: np.ndarray  # sorted distinct positions held (uint32, int64 past 4G)
    sums: np.ndarray  # uint32: their checksums
    until: np.ndarray  # int32: the last planned step that reads each (dropped once the floor passes it)
    every: np.ndarray | None  # uint32 of every position: read for a sample outside the held steps, or dense
    least: int  # min(until): a floor at or below it drops nothing


class HeldChecksums:
    """The index's checksum (uint32) of each position of a partition, held only for the positions its plan reads
    from the cache's floor to the newest step planned ahead: `hold` as planning reads the manifest, `release` as
    the floor moves; `[pos]` answers like the array it replaces.

    A position not held (a request behind the held steps) reads every checksum again (`load`: the partition's
    column, from the index the loader started with, or a specific error) and keeps them while the floor is
    behind the held steps (a lagging rank keeps asking there). Where the held positions would cost more than
    every checksum (12 bytes a position against 4 a sample: a third of the partition), every checksum is held
    from then on (`dense`). Threads: planning holds, reads look up; a state is replaced whole under the lock.
    """

    def __init__(self, load: Callable[[], np.ndarray], size: int, every: np.ndarray | None = None) -> None:
        """`every`: the checksums read with the index at start (they give the first span's, then go: no load)."""
        self._load = load
        self.size = size
        self._pos_dtype = np.uint32 if size <= np.iinfo(np.uint32).max else np.int64
        self._lock = threading.Lock()
        none = np.zeros(0, dtype=self._pos_dtype)
        self._state = _Held(none, _NONE, np.zeros(0, _STEP), _checked(every, size), _NO_DROP)
        self._from: int | None = None  # every planned read from this step on is held (None: nothing held yet)
        self._gap_until = -1  # a span's hold failed: its steps up to this one are not held (every kept for them)
        self.dense = False
        self.loads = 0  # times every checksum was read from samples.parquet (planning a span or a read's miss)
        self.rereads = 0  # of them, by a read (a sample outside the held steps)

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        st = self._state
        return int(st.pos.nbytes + st.sums.nbytes + st.until.nbytes + (st.every.nbytes if st.every is not None else 0))

    @property
    def held(self) -> int:
        """Positions whose checksums are held now (every one, where `every` is)."""
        st = self._state
        return self.size if st.every is not None else len(st.pos)

    def _read(self) -> np.ndarray:
        every = _checked(self._load(), self.size)
        assert every is not None
        self.loads += 1
        return every

    def hold(self, pos: np.ndarray, steps: np.ndarray, first_step: int) -> None:
        """Hold the checksums of positions `pos` read at planned `steps` (one manifest span from `first_step`).

        Reads every checksum again (once) only where a position is new; raises what that read raises (planning
        counts it and goes on: the read that needs one reads them again and reports the error).
        """
        if self.dense:
            return
        with self._lock:
            if self.dense:  # went dense meanwhile
                return
            st = self._state
            kept = st.every if self._from is not None else None  # those read at start serve the first span only
            p = np.concatenate([st.pos.astype(np.int64), np.asarray(pos, dtype=np.int64)])
            u = np.concatenate([st.until, np.asarray(steps, dtype=_STEP)])
            order = np.lexsort((u, p))  # by position, then step: the last of each position is its latest step
            p, u = p[order], u[order]
            last = np.ones(len(p), dtype=bool)
            last[:-1] = p[1:] != p[:-1]
            p, u = p[last], u[last]
            if len(p) > len(st.pos):  # a position not held yet: its checksum from every one (read again, or held)
                try:
                    every = st.every if st.every is not None else self._read()
                except BaseException:  # this span is not held: reads in it keep every checksum once they read them
                    if len(steps):
                        self._gap_until = max(self._gap_until, int(np.max(steps)))
                    raise
                if 3 * len(p) >= self.size:  # 12 bytes a position cost more than every checksum's 4: hold those
                    self.dense = True
                    self._state = _Held(st.pos[:0], _NONE, st.until[:0], every, _NO_DROP)
                    return
                sums = every[p]
            else:
                sums = st.sums
            self._state = _Held(p.astype(self._pos_dtype), sums, u, kept, int(u.min()) if len(u) else _NO_DROP)
            self._from = first_step if self._from is None else self._from

    def release(self, floor: int) -> None:
        """The cache's floor is `floor` now: drop the checksums no planned step from it on reads, and every
        checksum (read for a lagging request) once the floor is back within the held steps."""
        if self.dense:
            return
        st = self._state
        keep_every = self._from is None or floor < self._from or floor <= self._gap_until
        if floor <= st.least and (st.every is None or keep_every):
            return
        with self._lock:
            if self.dense:  # went dense meanwhile (its every checksum stays)
                return
            st = self._state
            keep = st.until >= floor
            u = st.until[keep]
            every = st.every if keep_every else None
            self._state = _Held(st.pos[keep], st.sums[keep], u, every, int(u.min()) if len(u) else _NO_DROP)
            if self._from is not None:
                self._from = max(self._from, floor)

    def covers(self, pos: np.ndarray) -> bool:
        """Whether the checksums of every one of `pos` are held (looking them up reads nothing)."""
        st = self._state
        return st.every is not None or bool(self._found(st, np.asarray(pos))[1].all())

    @staticmethod
    def _found(st: _Held, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = pos.astype(st.pos.dtype, copy=False)  # positions are in [0, size): no search over a widened copy
        at = np.searchsorted(st.pos, pos)
        ok = at < len(st.pos)
        ok[ok] = st.pos[at[ok]] == pos[ok]
        return at, ok

    def __getitem__(self, pos: np.ndarray) -> np.ndarray:
        """The checksum of each of positions `pos` (an int array), as indexing the full array would give it."""
        pos = np.asarray(pos, dtype=np.int64)
        st = self._state
        if st.every is not None:
            return st.every[pos]
        at, ok = self._found(st, pos)
        if ok.all():
            return st.sums[at]
        with self._lock:  # outside the held steps: every checksum, kept while the floor is behind them
            st = self._state
            every = st.every
            if every is None:
                every = self._read()
                self.rereads += 1
                self._state = replace(st, every=every)
        return every[pos]


def _checked(every: np.ndarray | None, size: int) -> np.ndarray | None:
    """`every` as uint32, refused unless one a position (the loader's `load` checks the index's identity first)."""
    if every is None:
        return None
    out = np.asarray(every).astype(np.uint32, copy=False)
    if len(out) != size:
        raise StaleIndexError(f"{len(out)} checksums read for {size} index positions: the index changed under a loader")
    return out


@dataclass(frozen=True, slots=True, eq=False)
class SampleIndex:
    """Sample -> (shard, row) of one partition; positions are ranks of samples in sorted order."""

    first: int  # the smallest sample id
    samples: np.ndarray | None  # sorted sample ids; None: they are first .. first + len - 1
    run_starts: np.ndarray  # int64: the position where each run of one shard starts
    run_shards: np.ndarray  # int64: the shard of each run
    rows: np.ndarray | None  # the smallest of uint16, uint32, int64 that holds every row; None: implied (run_rows)
    size: int  # positions (samples)
    checksums: np.ndarray | HeldChecksums | None = None  # uint32 per position, when samples are verified
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

    def shard_row_at(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`shard_at` and `row_at` of each position, with one search of the runs (planning asks both of every read)."""
        if self.rows is not None:
            return self.shard_at(pos), self.rows[pos].astype(np.int64)
        assert self.run_rows is not None
        run = self._run_of(pos)
        return self.run_shards[run], self.run_rows[run] + (np.asarray(pos, dtype=np.int64) - self.run_starts[run])

    def _run_of(self, pos: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.run_starts, pos, side="right") - 1
