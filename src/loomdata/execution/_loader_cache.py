"""Plan-driven caching of decoded read units (Parquet row groups) for Source Loaders: Belady's rule.

No LRU can know whether a row group will be read again; a loader can: the manifest names every
future read. So a loader learns, a few steps ahead of the newest step it served, which units each
step needs (`UnitUses`: pending segment reads per (unit, step)), keeps a decoded unit only while a
pending step within the horizon still needs it, and drops it as soon as its last such use is served.

All loaders of one plan in one worker process share one budget (`WorkerPool`, `ServeConfig.loader_memory`):
they are separate actors but one process's memory. Over budget, the unit whose next use is farthest
is evicted, whichever loader it belongs to (steps of one plan are one timeline for every source); a
new unit needed later than everything held is not kept at all. A unit not kept is only read again:
what a read returns never depends on the cache.

Rows, not whole units: the plan also says which rows of a unit its pending steps read (`UnitRows`), so
the cache names them to the reader (`wanted`), which keeps only those (`KeptRows`, a `take` of the
decoded unit). Under a global shuffle a step reads a few rows of each unit it touches: whole decoded
row groups filled the budget with rows no planned step reads (300 sources: 256 MiB per worker against
~10 MiB of rows the horizon's steps read). Rows are wanted only while a planned read of them is still to be
served (a floor held back by a lagging rank keeps its pending reads, not the rows already served). A newly
planned row a held unit did not keep drops that unit when the row's step is within the reach, so the read-ahead
reads it again with every row then planned, off the read path; a row planned further ahead (`keep_steps`) drops
it only once its step comes within the reach. Under a global shuffle nearly every held unit gains a row with each
chunk planned, and dropping it at once decoded every unit again for every chunk.

How far ahead is held follows the bytes held (session 16): past `keep_soft_bytes` that a worker's loaders hold as
rows, the horizon and `keep_steps` shrink in proportion (soft / held, to a quarter at least), so fewer rows are held and
a unit is decoded again sooner, both by degrees. A hard allowance for rows past the reach (session 15) was a cliff:
once spent, every unit kept as rows was decoded again per use (7.6x the loaders' CPU on a long 2-source run).

Threads: loaders read in their own threads and on the worker's event loop; every operation on a pool
and on the uses of its loaders holds the pool's lock (each is a few NumPy calls on small arrays, or a few
updates of a packed array per segment served).
"""

from __future__ import annotations

import array
import bisect
import collections
import enum
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from loomdata.execution._config import LOCAL_READ_AHEAD, ServeConfig
from loomdata.sources import KeptRows, UnitKey

__all__ = [
    "KEEP_AHEAD",
    "PREFETCH_STEPS",
    "CachePolicy",
    "Offered",
    "PlanUnitCache",
    "UnitRows",
    "UnitUses",
    "WorkerPool",
    "int_key",
    "pool_for",
    "split_key",
    "unit_key",
]

FEW_READS = 64
"""`UnitUses.consume` takes up to this many segment reads one at a time (a list update each, no NumPy call); more at
once (a constructor's build group of hundreds of steps) are counted in NumPy first, then updated per key."""

_UNIT_BITS = 24  # row groups per file below 2**24; a unit key is shard << 24 | unit

PREFETCH_STEPS = 16
"""Steps beyond the window + 2 a prefetching loader looks (and keeps units) ahead: a few GET latencies of steps."""

KEEP_AHEAD = 3
"""Serving's `CachePolicy.keep_steps`, in horizons: rows a unit keeps for planned steps this far past the reach."""

KEEP_SOFT_BYTES = 8 * 1024 * 1024
"""Serving's `CachePolicy.keep_soft_bytes` (at most the budget; a 32nd of a budget above 256 MiB): bytes of kept rows
(`KeptRows`) a worker's loaders hold before the horizon and `keep_steps` shrink (`scaled`). 300 sources x 16 ranks:
first coverage 459-470 MiB against main's 488-512, the long 2-source run's CPU 1.005x and 1.05x (session 16; 4 MiB:
440 MiB, 1.07x). Measured with int32 rows: rows of a unit kept narrow (uint16 ids, `sources.parquet`) take half the
bytes, so the same bound holds about twice their rows (session 19: reach 57-63 steps against 35-38)."""

KEEP_MIN_SHARE = 4
"""`scaled` never goes below a `KEEP_MIN_SHARE`th of the steps: a unit is decoded again at most about this many
times as often as with all of them (no cliff)."""


def unit_key(shard: np.ndarray | int, unit: np.ndarray | int) -> np.ndarray:
    """One int64 per (shard, unit): the key `UnitUses` counts by."""
    return (np.asarray(shard, dtype=np.int64) << _UNIT_BITS) | np.asarray(unit, dtype=np.int64)


def int_key(shard: int, unit: int) -> int:
    """`unit_key` of one (shard, unit), in plain ints (a scalar through NumPy costs microseconds, on every read)."""
    return (int(shard) << _UNIT_BITS) | int(unit)


def split_key(key: int) -> tuple[int, int]:
    """The (shard, unit) of a unit key."""
    return int(key) >> _UNIT_BITS, int(key) & ((1 << _UNIT_BITS) - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class CachePolicy:
    """How a loader caches: the worker's budget (bytes, shared by its loaders) and the look-ahead.

    `horizon_steps`: a unit is kept only for a use at most this many steps after the newest step
    served (the serving window and a few steps beyond); `chunk_steps`: manifest steps read at a time;
    `prefetch`: units a loader reads ahead at once (`_prefetch`; 0: none), for uses within the horizon.
    `start_step`: the step serving starts at, which a new loader plans (and reads ahead) from before any
    request arrives. `lag_hold_s`: a step asked for within this many seconds keeps its uses pending even
    when it lags the newest step by more than the horizon (a rank behind its peers: see `PlanUnitCache.floor`).
    `keep_steps`: steps beyond the reach that are planned too, and whose rows a unit kept as rows keeps: such a
    unit is decoded again only when a row it lacks comes within the reach, about once per `keep_steps`, not once
    per chunk planned (see `PlanUnitCache.plan`).
    `keep_soft_bytes`: above this many bytes held as rows by the worker's loaders, the horizon (not a read-ahead's
    latency cover) and `keep_steps` are scaled down by soft / held (to at least a `KEEP_MIN_SHARE`th; 0: never):
    what is held shrinks as the held bytes grow, and the decodes again it costs grow with it, gradually (`scaled`).
    `local_read_ahead`: for local files, "on" (read ahead at `prefetch`), "off" (never) or "auto" (only once the
    loader's own reads are measured to stall its steps: `_prefetch.ReadStall`); object URLs always read ahead.
    """

    worker_bytes: int
    horizon_steps: int
    chunk_steps: int = 32
    prefetch: int = 0
    start_step: int = 0
    lag_hold_s: float = 30.0
    keep_steps: int = 0
    keep_soft_bytes: int = 0
    local_read_ahead: str = "on"

    def __post_init__(self) -> None:
        if self.worker_bytes < 0:
            raise ValueError(f"CachePolicy.worker_bytes must be >= 0, got {self.worker_bytes!r}")
        if self.horizon_steps < 1 or self.chunk_steps < 1:
            raise ValueError(f"CachePolicy horizon_steps and chunk_steps must be >= 1, got {self!r}")
        if self.prefetch < 0:
            raise ValueError(f"CachePolicy.prefetch must be >= 0 units in flight, got {self.prefetch!r}")
        if self.start_step < 0:
            raise ValueError(f"CachePolicy.start_step must be >= 0, got {self.start_step!r}")
        if self.lag_hold_s < 0:
            raise ValueError(f"CachePolicy.lag_hold_s must be >= 0 seconds, got {self.lag_hold_s!r}")
        if self.keep_steps < 0:
            raise ValueError(f"CachePolicy.keep_steps must be >= 0 steps, got {self.keep_steps!r}")
        if self.keep_soft_bytes < 0:
            raise ValueError(f"CachePolicy.keep_soft_bytes must be >= 0 bytes, got {self.keep_soft_bytes!r}")
        if self.local_read_ahead not in LOCAL_READ_AHEAD:
            raise ValueError(
                f"CachePolicy.local_read_ahead must be one of {LOCAL_READ_AHEAD}, got {self.local_read_ahead!r}"
            )

    @classmethod
    def serving(cls, config: ServeConfig) -> CachePolicy:
        """The policy of the loaders a `ServeConfig` serves with (its budget, window, read-ahead and start step)."""
        return cls.of(
            config.loader_memory, config.window, config.loader_prefetch, config.start_step, config.local_read_ahead
        )

    @classmethod
    def of(
        cls, loader_memory: int, window: int, prefetch: int = 0, start_step: int = 0, local_read_ahead: str = "auto"
    ) -> CachePolicy:
        """The policy serving uses: the configured budget, the window plus a few steps (more to read ahead into)."""
        extra = PREFETCH_STEPS if prefetch > 0 and loader_memory > 0 else 0
        horizon = window + 2 + extra
        return cls(
            worker_bytes=loader_memory,
            horizon_steps=horizon,
            prefetch=prefetch,
            start_step=start_step,
            keep_steps=KEEP_AHEAD * horizon if loader_memory > 0 else 0,
            keep_soft_bytes=min(max(KEEP_SOFT_BYTES, loader_memory // 32), loader_memory),  # a larger budget: more
            local_read_ahead=local_read_ahead,
        )


class UnitUses:
    """Pending uses of units by steps: how many segment reads of each (unit key, step) are still to come.

    Per unit key, one `array('q')` of its pairs with reads left, ascending: each a step and its reads left (> 0) packed
    in one int64 (`_LEFT_BITS`), so a step's pair is the first value >= step << `_LEFT_BITS`. Serving a read updates
    a value in place (a `bisect` each), and a key's next use from a step on is one `bisect` (session 27: over sorted
    NumPy arrays of every pair, each read cost some 25 NumPy calls and a copy of everything held). Session 28: one
    packed array per key, not two lists of Python ints (a step's int object and two list slots: the workers' Python
    arenas grew 3-4 MiB with them at 300 sources). A chunk planned is grouped by key in NumPy and merged per key
    (appended, as a chunk planned in order comes after everything held). Only pairs with reads left are held (one
    served to none is removed), and so only keys with pairs.
    """

    def __init__(self, span: int) -> None:
        self.span = max(int(span), 1)
        self._uses: dict[int, array.array[int]] = {}  # key -> step << _LEFT_BITS | reads left (> 0), ascending
        self._pairs = 0
        self._spent: dict[int, set[int]] = {}  # key -> steps of its pairs served to none since `take_spent`

    def __len__(self) -> int:
        return self._pairs

    def add(self, keys: np.ndarray, steps: np.ndarray) -> None:
        """Count one planned read per (keys[i], steps[i]) (a manifest segment), merged with those held."""
        k, s = np.asarray(keys, dtype=np.int64), np.asarray(steps, dtype=np.int64)
        if len(k) == 0:
            return
        if int(s.min()) < 0 or int(s.max()) >> (63 - _LEFT_BITS):
            bad = int(np.flatnonzero(s >> (63 - _LEFT_BITS))[0])
            raise ValueError(
                f"UnitUses: planned steps must be in 0..2**{63 - _LEFT_BITS}, got {int(s.min())}..{int(s.max())} "
                f"(read {bad}: unit key {int(k[bad])}, step {int(s[bad])})"
            )
        keys_l, steps_l, count, runs, packed = _pair_runs(k, s)
        uses, spent, b = self._uses, self._spent, _LEFT_BITS
        for lo, hi in itertools.pairwise(runs):
            if spent and (gone := spent.get(keys_l[lo])) is not None:  # served to none, then planned again: held
                gone.difference_update(steps_l[lo:hi])
            got = uses.get(keys_l[lo])
            if got is None:
                uses[keys_l[lo]] = packed[lo:hi]
                self._pairs += hi - lo
                continue
            if got[-1] >> b < steps_l[lo]:  # after every step held (a key's array is never empty)
                got.extend(packed[lo:hi])
                self._pairs += hi - lo
                continue
            for x, c in zip(steps_l[lo:hi], count[lo:hi], strict=True):
                i = bisect.bisect_left(got, x << b)
                if i < len(got) and got[i] >> b == x:
                    got[i] += c
                else:
                    got.insert(i, x << b | c)
                    self._pairs += 1

    def left(self, keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Segment reads still to come per (keys[i], steps[i]) (0 where none is planned)."""
        k, s = np.asarray(keys, dtype=np.int64), np.asarray(steps, dtype=np.int64)
        out, uses, b = [], self._uses, _LEFT_BITS
        for key, x in zip(k.tolist(), s.tolist(), strict=True):
            got = uses.get(key)
            n = 0
            if got is not None and x >= 0:
                i = bisect.bisect_left(got, x << b)
                if i < len(got) and got[i] >> b == x:
                    n = got[i] & _LEFT_MASK
            out.append(n)
        return np.array(out, dtype=np.int64)

    def holds(self, key: int, steps: np.ndarray) -> np.ndarray:
        """Whether each (key, steps[i]) has a read left (`left` > 0) for one key: one search of its steps."""
        got = self._uses.get(int(key))
        s = np.asarray(steps, dtype=np.int64)
        if got is None or len(s) == 0:
            return np.zeros(len(s), dtype=bool)
        st = np.frombuffer(got, dtype=np.int64) >> _LEFT_BITS  # a copy: the array is free to grow again
        at = st.searchsorted(s)
        np.minimum(at, len(st) - 1, out=at)
        return st[at] == s

    def consume(self, keys: np.ndarray | list[int], steps: np.ndarray | list[int]) -> None:
        """Segment reads served: one use of each (keys[i], steps[i]) less (unplanned pairs are ignored).

        A few (`FEW_READS`): one update each. More (a constructor's build group, hundreds of steps): counted per
        distinct pair in NumPy, then per key, where the pairs served are the key's first ones held and each is served
        to none (steps served in order), one slice of its array goes; otherwise an update per pair."""
        if len(keys) > FEW_READS:
            self._consume_many(np.asarray(keys, dtype=np.int64), np.asarray(steps, dtype=np.int64))
            return
        for key, x in zip(_ints(keys), _ints(steps), strict=True):
            self._take(key, x, 1)

    def _take(self, key: int, x: int, n: int) -> None:
        """`n` reads of (key, x) served: the pair goes once none is left (served to none); an unplanned one: ignored."""
        got = self._uses.get(key)
        if got is None or x < 0:
            return
        i = bisect.bisect_left(got, x << _LEFT_BITS)
        if i == len(got) or got[i] >> _LEFT_BITS != x:
            return
        if got[i] & _LEFT_MASK > n:
            got[i] -= n
            return
        del got[i]  # served to none: no longer held
        self._pairs -= 1
        if not got:
            del self._uses[key]
        if (gone := self._spent.get(key)) is None:
            self._spent[key] = {x}
        else:
            gone.add(x)

    def _consume_many(self, keys: np.ndarray, steps: np.ndarray) -> None:
        keys_l, steps_l, count, runs, packed = _pair_runs(keys, steps)
        uses, b = self._uses, _LEFT_BITS
        for lo, hi in itertools.pairwise(runs):
            key, got = keys_l[lo], uses.get(keys_l[lo])
            if got is None:
                continue
            mine, m = steps_l[lo:hi], hi - lo
            # its first pairs, each served to none (steps past any planned are not packed: never these)
            if m <= len(got) and mine[0] >= 0 and not mine[-1] >> (63 - b) and got[:m] == packed[lo:hi]:
                del got[:m]
                self._pairs -= m
                if not got:
                    del uses[key]
                self._spent.setdefault(key, set()).update(mine)
                continue
            for x, n in zip(mine, count[lo:hi], strict=True):
                self._take(key, x, n)

    def take_spent(self) -> tuple[np.ndarray, np.ndarray, int, int] | None:
        """The pairs served to none since the last call and not planned again (None: none), for `UnitRows.prune`:
        their keys (sorted, distinct), a code per pair (its key's place among them * span + its step; sorted) and
        their first and last step."""
        spent, self._spent = self._spent, {}
        keys = sorted(k for k, gone in spent.items() if gone)
        if not keys:
            return None
        sizes = [len(spent[k]) for k in keys]
        steps = np.fromiter(itertools.chain.from_iterable(spent[k] for k in keys), dtype=np.int64, count=sum(sizes))
        code = np.repeat(np.arange(len(keys), dtype=np.int64) * self.span, sizes) + steps
        code.sort()
        return np.array(keys, dtype=np.int64), code, int(steps.min()), int(steps.max())

    def next_use(self, keys: np.ndarray, floor: int) -> np.ndarray:
        """Per key, the first step >= `floor` with a pending use; -1 where none is known."""
        return np.array(self.next_steps(_ints(keys), floor), dtype=np.int64)

    def next_steps(self, keys: list[int], floor: int) -> list[int]:
        """`next_use` of plain ints (`PlanUnitCache.served` asks it of every held unit at every read)."""
        f, uses, out, b = max(int(floor), 0) << _LEFT_BITS, self._uses, [], _LEFT_BITS
        for key in keys:
            got = uses.get(key)
            if got is None:
                out.append(-1)
                continue
            i = bisect.bisect_left(got, f)
            out.append(got[i] >> b if i < len(got) else -1)
        return out

    def pending(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys with a pending use in steps lo..hi and the first such step, in plan order (step, then key)."""
        f, keys, steps, b = max(int(lo), 0) << _LEFT_BITS, [], [], _LEFT_BITS
        for key, got in self._uses.items():
            i = bisect.bisect_left(got, f)
            if i < len(got) and got[i] >> b <= hi:
                keys.append(key)
                steps.append(got[i] >> b)
        k, s = np.array(keys, dtype=np.int64), np.array(steps, dtype=np.int64)
        order = np.lexsort((k, s))
        return k[order], s[order]

    def prune(self, floor: int) -> None:
        """Forget uses before `floor` (served, or skipped by a resume), and the keys with none left."""
        uses, f = self._uses, max(int(floor), 0) << _LEFT_BITS
        for key in [k for k, got in uses.items() if got[0] < f]:
            got = uses[key]
            i = bisect.bisect_left(got, f)
            self._pairs -= i
            if i == len(got):
                del uses[key]
            else:
                del got[:i]


_LEFT_BITS = 32  # `UnitUses` packs a (unit, step) pair's step and its reads left into one int64
_LEFT_MASK = (1 << _LEFT_BITS) - 1


def _pair_runs(
    keys: np.ndarray, steps: np.ndarray
) -> tuple[list[int], list[int], list[int], list[int], array.array[int]]:
    """The distinct (key, step) pairs of `keys`, `steps` sorted by key then step, as plain ints: their keys, steps,
    how many times each occurs, where each key's run starts (then the end), and each step and count packed as
    `UnitUses` holds them (meaningful for steps in 0..2**31 only)."""
    order = np.lexsort((steps, keys))
    k, s = keys[order], steps[order]
    first = np.ones(len(k), dtype=bool)
    first[1:] = (k[1:] != k[:-1]) | (s[1:] != s[:-1])
    at = np.flatnonzero(first)
    count = np.diff(np.append(at, len(k)))
    k, s = k[at], s[at]
    runs = [*np.flatnonzero(np.append(True, k[1:] != k[:-1])).tolist(), len(k)]
    packed = array.array("q")
    packed.frombytes(((s << _LEFT_BITS) | count).tobytes())
    return k.tolist(), s.tolist(), count.tolist(), runs, packed


def _ints(values: np.ndarray | list[int]) -> list[int]:
    """Plain ints of an array (a list as it is)."""
    return values if isinstance(values, list) else np.asarray(values).tolist()


class UnitRows:
    """The rows planned reads take from each unit, with their steps: what of a unit to keep (`KeptRows`).

    Pure NumPy: (key, step, row) triples sorted by key (a key's in the order planned), so one key's rows are one
    `searchsorted` slice; a triple is two int64s, its key and its step and row packed (`_ROW_BITS`). Two such runs:
    the held triples and a tail of those planned since the tail was last merged into them. A chunk planned is merged
    into the tail, and the tail into the held triples once it is about the square root of twice their size times a
    chunk's, by a mask (session 28: `np.insert` of three arrays of everything held per chunk planned was the largest
    term of planning); a key's rows are its slice of each, the held ones first (planned earlier). Reads served are
    told apart by the `UnitUses` given to `planned`; `prune` forgets the steps behind the floor and the reads served
    since it last ran (looking every held triple up in `UnitUses` at each prune was the strands' largest cost).
    """

    def __init__(self) -> None:
        empty = np.zeros(0, dtype=np.int64)
        self._held = (empty, empty)  # keys sorted, step << _ROW_BITS | row
        self._tail = (empty, empty)

    def __len__(self) -> int:
        return len(self._held[0]) + len(self._tail[0])

    def add(self, keys: np.ndarray, steps: np.ndarray, rows: np.ndarray) -> None:
        """Planned reads of `rows[i]` of unit `keys[i]` at `steps[i]`."""
        k = np.asarray(keys, dtype=np.int64)
        if len(k) == 0:
            return
        s, r = np.asarray(steps, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        if ((r >> _ROW_BITS) | (s >> (63 - _ROW_BITS))).any():  # negative, or too large to pack
            bad = int(np.flatnonzero((r >> _ROW_BITS) | (s >> (63 - _ROW_BITS)))[0])
            raise ValueError(
                f"UnitRows: planned read {bad} (unit key {int(k[bad])}) has row {int(r[bad])} or step {int(s[bad])} "
                f"outside 0..2**{_ROW_BITS} and 0..2**{63 - _ROW_BITS}"
            )
        order = np.argsort(k, kind="stable")
        self._tail = _merged(self._tail, (k[order], ((s << _ROW_BITS) | r)[order]))
        if len(self._tail[0]) ** 2 > 2 * max(len(self._held[0]), 1) * len(k):  # about sqrt(2 held chunk): merged
            empty = np.zeros(0, dtype=np.int64)
            self._held, self._tail = _merged(self._held, self._tail), (empty, empty)

    def planned(self, key: int, floor: int, uses: UnitUses | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The (row, step) of each planned read of unit `key` at a step >= `floor` (with `uses`: of those still to be
        served, a read left in `uses`)."""
        got = _slice_of(self._held, key)
        if len(self._tail[0]) and len(more := _slice_of(self._tail, key)):
            got = np.concatenate([got, more])
        step = got >> _ROW_BITS
        live = step >= floor
        if uses is not None and len(step):
            live &= uses.holds(key, step)
        return got[live] & _ROW_MASK, step[live]

    def prune(self, floor: int, uses: UnitUses) -> None:
        """Forget reads before step `floor` and those served since the last prune (no read left in `uses`).

        The pairs `uses` served to none since (`UnitUses.take_spent`) are matched against the triples in their steps'
        range, in the held run and in the tail alike (`_pruned`: one search of the pairs' codes per run; looking every
        held triple up in `UnitUses` at each prune was the strands' largest bookkeeping cost); a triple whose pair left
        `uses` otherwise (its own `prune` at a later floor) stays until the floor passes it: `planned` tells it apart
        all the same."""
        spent = uses.take_spent()
        self._held = _pruned(self._held, floor, spent, uses.span)
        self._tail = _pruned(self._tail, floor, spent, uses.span)


def _distinct(values: np.ndarray) -> np.ndarray:
    """`np.unique` of a small int array, sorted (NumPy 2's `unique` costs ~20 us a call on a few hundred values)."""
    v = np.sort(values)
    if len(v) < 2:
        return v
    first = np.empty(len(v), dtype=bool)
    first[0] = True
    np.not_equal(v[1:], v[:-1], out=first[1:])
    return v[first]


_ROW_BITS = 32  # `UnitRows` packs a planned read's step and row (a row of one unit's file) into one int64
_ROW_MASK = (1 << _ROW_BITS) - 1


def _merged(into: tuple[np.ndarray, np.ndarray], new: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """`UnitRows` triples `new` (sorted by key) merged into `into`: each after its key's triples there (planned later).
    By a mask, not `np.insert` (tens of microseconds of checks a call, per array)."""
    if len(into[0]) == 0:
        return new
    n = len(into[0]) + len(new[0])
    at = np.searchsorted(into[0], new[0], side="right")
    at += np.arange(len(at))
    old = np.ones(n, dtype=bool)
    old[at] = False
    out = []
    for a, b in zip(into, new, strict=True):
        c = np.empty(n, dtype=np.int64)
        c[old] = a
        c[at] = b
        out.append(c)
    return out[0], out[1]


def _slice_of(triples: tuple[np.ndarray, np.ndarray], key: int) -> np.ndarray:
    """One key's packed steps and rows."""
    keys = triples[0]
    return triples[1][keys.searchsorted(key) : keys.searchsorted(key + 1)]


def _pruned(
    triples: tuple[np.ndarray, np.ndarray], floor: int, spent: tuple[np.ndarray, np.ndarray, int, int] | None, span: int
) -> tuple[np.ndarray, np.ndarray]:
    """`UnitRows.prune` of one run of triples: those before `floor`, and those of a pair in `spent`, go (a step is
    compared packed: a step >= s is a packed value >= s << `_ROW_BITS`)."""
    key, packed = triples
    if len(key) == 0:
        return triples
    floor = max(int(floor), 0)
    keep = packed >= floor << _ROW_BITS
    if spent is not None:
        known, code, lo, hi = spent
        near = np.flatnonzero((packed >= max(lo, floor) << _ROW_BITS) & (packed < (hi + 1) << _ROW_BITS))
        if len(near):
            k = key[near]
            at = np.minimum(np.searchsorted(known, k), len(known) - 1)
            mine = at * span + (packed[near] >> _ROW_BITS)
            pos = np.minimum(np.searchsorted(code, mine), len(code) - 1)
            keep[near[(code[pos] == mine) & (known[at] == k)]] = False
    if np.count_nonzero(keep) == len(keep):
        return triples
    return key[keep], packed[keep]


@dataclass(slots=True)
class _Entry:
    value: Any
    nbytes: int
    next_use: int


class WorkerPool:
    """The decoded units all loaders of one plan keep in one worker process, under one byte budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nbytes = 0
        self.rows_nbytes = 0  # of `nbytes`, units kept as some of their rows (`KeptRows`)
        self.reserved = 0  # bytes the worker's reads ahead in flight will hold (`reserve`), every loader's
        self.lock = threading.RLock()
        self.owners = 0
        self._owned: dict[int, dict[UnitKey, _Entry]] = {}

    @property
    def free_bytes(self) -> int:
        """Bytes of the budget not held now (0: spent, a read ahead would push out a unit needed sooner); reads in
        flight reserve theirs apart (`reserved`)."""
        return max(self.budget - self.nbytes, 0)

    def reserve(self, nbytes: int) -> None:
        """Count `nbytes` (negative: release) that reads ahead in flight will hold: every loader of the worker sizes
        its reads from the same free bytes, less the others' reservations (`_prefetch.ReadDepth.free`)."""
        with self.lock:
            self.reserved += nbytes

    def get(self, owner: int, key: UnitKey) -> Any | None:
        with self.lock:
            e = self._owned.get(owner, {}).get(key)
            return e.value if e is not None else None

    def offer(self, owner: int, key: UnitKey, value: Any, nbytes: int, next_use: int, strict: bool = False) -> bool:
        """Keep a unit needed next at step `next_use`, evicting units needed later while over budget.

        A unit is kept even when everything held is needed sooner: the read that offers it holds it
        anyway until it returns, and `trim` (after each served read) restores the budget with the
        next uses then known. `strict` (a read ahead, which nobody holds yet): not kept then either.
        False: not kept (larger than the whole budget, or strict and no room).
        """
        with self.lock:
            self._drop(owner, key)
            if nbytes > self.budget:
                return False
            while self.nbytes + nbytes > self.budget and self.nbytes > 0:
                o, k, far = self._farthest()
                if far.next_use <= next_use:
                    if strict:
                        return False
                    break
                self._drop(o, k)
            self._owned.setdefault(owner, {})[key] = _Entry(value, nbytes, next_use)
            self.nbytes += nbytes
            if isinstance(value, KeptRows):
                self.rows_nbytes += nbytes
            return True

    def trim(self) -> None:
        """Evict the units whose next use is farthest until the pool is within its budget."""
        with self.lock:
            while self.nbytes > self.budget:
                o, k, _ = self._farthest()
                self._drop(o, k)

    def _farthest(self) -> tuple[int, UnitKey, _Entry]:
        return max(((o, k, e) for o, d in self._owned.items() for k, e in d.items()), key=lambda t: t[2].next_use)

    def held(self, owner: int) -> list[UnitKey]:
        with self.lock:
            return list(self._owned.get(owner, {}))

    def entries(self, owner: int) -> dict[UnitKey, _Entry]:
        """The units `owner` holds, live (read and change them only under the pool's lock; drop through `drop`)."""
        return self._owned.get(owner, {})

    def items(self, owner: int) -> list[tuple[UnitKey, Any]]:
        """(key, value) of each unit `owner` holds."""
        with self.lock:
            return [(k, e.value) for k, e in self._owned.get(owner, {}).items()]

    def drop(self, owner: int, key: UnitKey) -> None:
        with self.lock:
            self._drop(owner, key)

    def owner_bytes(self, owner: int) -> int:
        with self.lock:
            return sum(e.nbytes for e in self._owned.get(owner, {}).values())

    def update(self, owner: int, next_uses: dict[UnitKey, int]) -> None:
        """New next uses of an owner's units; a unit with none (-1) is dropped: its last use was served."""
        with self.lock:
            mine = self._owned.get(owner, {})
            for key, n in next_uses.items():
                if n < 0:
                    self._drop(owner, key)
                elif (e := mine.get(key)) is not None:
                    e.next_use = n

    def drop_owner(self, owner: int) -> None:
        with self.lock:
            for e in self._owned.pop(owner, {}).values():
                self.nbytes -= e.nbytes
                if isinstance(e.value, KeptRows):
                    self.rows_nbytes -= e.nbytes

    def _drop(self, owner: int, key: UnitKey) -> None:
        e = self._owned.get(owner, {}).pop(key, None)
        if e is not None:
            self.nbytes -= e.nbytes
            if isinstance(e.value, KeptRows):
                self.rows_nbytes -= e.nbytes


_POOLS: dict[str, WorkerPool] = {}  # per plan id, in this worker process: the one object its loaders share
_POOLS_LOCK = threading.Lock()
_OWNERS = itertools.count()


def pool_for(plan_id: str, budget: int) -> tuple[WorkerPool, int]:
    """This process's pool of `plan_id` (made on first use; the latest budget applies) and a new owner id."""
    with _POOLS_LOCK:
        pool = _POOLS.get(plan_id)
        if pool is None:
            pool = _POOLS[plan_id] = WorkerPool(budget)
        pool.budget = budget
        pool.owners += 1
        return pool, next(_OWNERS)


def _leave(plan_id: str, pool: WorkerPool, owner: int) -> None:
    with _POOLS_LOCK:
        pool.drop_owner(owner)
        pool.owners -= 1
        if pool.owners <= 0 and _POOLS.get(plan_id) is pool:
            del _POOLS[plan_id]


def over_soft(policy: CachePolicy, pool: WorkerPool) -> bool:
    """Whether a worker's loaders hold more than the policy's soft bytes as rows (`KeptRows`).

    Units kept whole are not counted: most of their rows are wanted, so they serve many reads a byte (2 sources:
    the budget held whole, and a reach narrowed by all bytes held took 2.6x the loaders' CPU, session 16).
    """
    return 0 < policy.keep_soft_bytes < pool.rows_nbytes


def scaled(steps: int, policy: CachePolicy, pool: WorkerPool) -> int:
    """`steps` held past the horizon (read ahead, or kept past the reach) scaled down by the policy's soft bytes over
    the bytes held as rows, once over (`over_soft`), to at least a `KEEP_MIN_SHARE`th.

    Fewer steps held mean fewer rows held and a unit decoded again about once per fewer steps: both change in
    proportion to the bytes held, with no threshold where every use decodes again (session 15's allowance: 7.6x
    the loaders' CPU). A held unit is dropped only past the full reach and `keep_steps`, so a reach narrowed by
    held bytes stops new reads, not the ones made. The floor behind the newest step is never scaled (it holds the
    uses of lagging constructors).
    """
    if not over_soft(policy, pool):
        return steps
    return max(steps * policy.keep_soft_bytes // pool.rows_nbytes, -(-steps // KEEP_MIN_SHARE))


def _renew(
    held: dict[UnitKey, _Entry],
    ints: list[int],
    nxt: list[int],
    stale: dict[int, int],
    near: int,
    last: int,
    whole: int,
) -> tuple[list[UnitKey], dict[int, int]]:
    """`PlanUnitCache.served`'s verdict on each held unit (int key `ints[i]`, next use `nxt[i]`, -1: none): the units to
    drop (a row it lacks now due by step `near`, `stale`: read again with every row; no use left up to step `last`, or
    `whole` for a unit kept whole) and the stale units still held; every other unit's next use is set in place."""
    drop: list[UnitKey] = []
    still: dict[int, int] = {}
    for (key, e), k, n in zip(held.items(), ints, nxt, strict=True):
        lacks = stale.get(k) if stale else None
        if lacks is not None and lacks <= near:
            drop.append(key)
            continue
        if lacks is not None:
            still[k] = lacks
        if 0 <= n <= (last if isinstance(e.value, KeptRows) else whole):
            e.next_use = n
        else:
            drop.append(key)
    return drop, still


class Offered(enum.Enum):
    """What became of a unit read ahead (`PlanUnitCache.put_ahead`): kept, no room in the worker's budget (reading
    further ahead waits for a served step), or not due: no use within the reach now (the reach narrowed, or it is no
    longer planned), a shard this loader does not serve, the cache closed, or (`Prefetcher`) nothing was read."""

    KEPT = "kept"
    NO_ROOM = "no room"
    NOT_DUE = "not due"


class PlanUnitCache:
    """One loader's `UnitCache` (sources._base): keeps a unit while a planned step within its reach needs it.

    The reach: the policy's horizon, `scaled` by the bytes held, plus `extra_steps` (a read-ahead's cover for measured
    storage latency). The loader tells it what the plan will read (`plan`, with the rows: `wanted` names them and
    the reader keeps only those) and what it served (`served`); the reader offers and asks for units by `(path,
    unit)`, which `shard_of` maps to the loader's shard ids."""

    def __init__(
        self,
        plan_id: str,
        steps: int,
        policy: CachePolicy,
        shard_of: dict[str, int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.uses = UnitUses(steps)
        self.rows = UnitRows()  # the rows planned reads take (empty unless `plan` was given rows)
        self._by_rows = False  # `plan` was given rows: units are kept as the rows wanted
        self.newest = -1  # the newest step served
        self._plan_id = plan_id
        self._shard_of = shard_of
        self._ints: dict[UnitKey, int] = {}  # `_key` of the units seen (a loader's units: its shards' row groups)
        self._pool, self._owner = pool_for(plan_id, policy.worker_bytes)
        self._closed = False
        self.extra_steps = 0  # steps beyond the horizon a read-ahead needs to cover storage latency (`_prefetch`)
        self.plans = 0  # `plan` calls so far: rows wanted grow only with them (a read ahead checks its rows if any)
        # held units kept as rows lacking a later planned row (int key -> its step): dropped when it nears (`served`)
        self._stale: dict[int, int] = {}
        self._clock = clock
        self._front = -1  # the newest step a read ahead was issued for (`near`): rows wanted reach past its reach
        # (time, oldest step) of recent requests, oldest step increasing: the head is the oldest within `lag_hold_s`
        self._asked: collections.deque[tuple[float, int]] = collections.deque()

    @property
    def reach(self) -> int:
        """Steps beyond the newest served that units are read ahead and kept for: the horizon `scaled`, plus
        `extra_steps` (never narrowed); a held unit is dropped only past all of it and `keep_steps`."""
        return scaled(self.policy.horizon_steps, self.policy, self._pool) + self.extra_steps

    @property
    def plan_reach(self) -> int:
        """Steps beyond the newest served that are planned: the horizon, `extra_steps` and `keep_steps`, unscaled."""
        return self.policy.horizon_steps + self.extra_steps + self.policy.keep_steps

    @property
    def keep_now(self) -> int:
        """Steps past the reach that a unit kept as rows keeps rows for now: `keep_steps`, `scaled`."""
        return scaled(self.policy.keep_steps, self.policy, self._pool)

    def near(self, front: int = 0) -> int:
        """The last step a unit is read (ahead) for now: the reach beyond the newest step served or asked (`front`)."""
        with self._pool.lock:  # read-ahead threads call it too
            self._front = max(self._front, front)
        return max(self.newest, front, 0) + self.reach

    @property
    def nbytes(self) -> int:
        """Bytes of decoded units this loader holds now."""
        return self._pool.owner_bytes(self._owner)

    @property
    def floor(self) -> int:
        """Uses before this step are over: the horizon behind the newest step served, or the oldest step asked for
        within `lag_hold_s` if older: a loader serves every group, and one whose ranks run far behind (a slow
        consumer, a rank restarted from a checkpoint) would otherwise find its units' uses forgotten and read each
        unit again at every request. A rank that stops asking stops holding the floor back after `lag_hold_s`."""
        with self._pool.lock:  # re-entrant (callers inside it hold it); `served` moves what it reads
            return min(self.newest - self.policy.horizon_steps, self._asked[0][1] if self._asked else self.newest)

    def _asked_for(self, oldest: int) -> None:
        """Record a request whose oldest step is `oldest` (under the pool's lock)."""
        now = self._clock()
        while self._asked and self._asked[-1][1] >= oldest:
            self._asked.pop()
        self._asked.append((now, oldest))
        while self._asked[0][0] < now - self.policy.lag_hold_s:
            self._asked.popleft()

    def _key(self, key: UnitKey) -> int:
        """The int key of a unit (remembered: `served` asks it of every held unit at every read)."""
        if (k := self._ints.get(key)) is None:
            k = self._ints[key] = int_key(self._shard_of[str(key[0])], key[1])
        return k

    def get(self, key: UnitKey) -> Any | None:
        return self._pool.get(self._owner, key)

    def wanted(self, key: UnitKey) -> np.ndarray | None:
        """The rows of unit `key` planned reads from the floor on take (None: keep whole units, no rows planned)."""
        if not self._by_rows or str(key[0]) not in self._shard_of:
            return None
        with self._pool.lock:
            # reads from the floor on still to be served (rows served behind a lagging floor are not wanted again:
            # kept, they made units look mostly wanted, kept whole)
            rows, steps = self.rows.planned(self._key(key), max(self.floor, 0), self.uses)
            if over_soft(self.policy, self._pool):  # rows planned past what is kept now: read again when they near
                rows = rows[steps <= max(self.newest, self._front, 0) + self.reach + self.keep_now]
            return _distinct(rows)

    def holds(self, keys: np.ndarray, rows: np.ndarray) -> bool:
        """Whether reading `rows[i]` of unit `keys[i]` (int keys) for every i needs no decoding: all kept."""
        by_key = {self._key(k): v for k, v in self._pool.items(self._owner)}
        for k in np.unique(keys).tolist():
            v = by_key.get(int(k))
            if v is None:
                return False
            if isinstance(v, KeptRows) and not np.isin(rows[keys == k], v.rows).all():
                return False
        return True

    def put(self, key: UnitKey, value: Any, nbytes: int) -> None:
        if self._closed or str(key[0]) not in self._shard_of:
            return
        with self._pool.lock:
            k = self._key(key)
            n = int(self.uses.next_use(np.array([k]), self.floor)[0])
            if 0 <= n <= max(self.newest, 0) + self._limit(value) and self._pool.offer(
                self._owner, key, value, nbytes, n
            ):
                self._note_kept(k, value)

    def put_ahead(self, key: UnitKey, value: Any, nbytes: int, front: int) -> Offered:
        """Offer a unit read ahead for a use within the horizon of step `front`; kept only if it fits (strict)."""
        if str(key[0]) not in self._shard_of:
            return Offered.NOT_DUE
        with self._pool.lock:
            if self._closed:  # checked under the lock: `close` may run in another thread
                return Offered.NOT_DUE
            self._front = max(self._front, front)
            k = self._key(key)
            n = int(self.uses.next_use(np.array([k]), self.floor)[0])
            if not 0 <= n <= max(self.newest, front, 0) + self._limit(value):
                return Offered.NOT_DUE
            if not self._pool.offer(self._owner, key, value, nbytes, n, strict=True):
                return Offered.NO_ROOM
            self._note_kept(k, value)
            return Offered.KEPT

    def first_missing(self, key: UnitKey, kept: np.ndarray) -> int:
        """The first step from the floor on of a planned read of unit `key` whose row is not in `kept`; -1: none."""
        with self._pool.lock:
            return self._first_missing(self._key(key), kept)

    def _first_missing(self, k: int, kept: np.ndarray) -> int:
        rows, steps = self.rows.planned(k, max(self.floor, 0), self.uses)  # from the floor on, still to be served
        missing = ~np.isin(rows, kept)
        return int(steps[missing].min()) if missing.any() else -1

    def _limit(self, value: Any) -> int:
        """How far past the newest step a unit's next use may lie to be kept: rows, reach + `keep_now`; whole, reach."""
        return self.reach + self.keep_now if isinstance(value, KeptRows) else self.reach

    def _note_kept(self, k: int, value: Any) -> None:
        """A unit was kept: note the first later planned row it lacks (a chunk planned while it was read)."""
        first = self._first_missing(k, value.rows) if isinstance(value, KeptRows) else -1
        if first >= 0:
            self._stale[k] = first
        else:
            self._stale.pop(k, None)

    def pending(self, front: int) -> tuple[np.ndarray, np.ndarray]:
        """Units with a pending use from the floor to the horizon of step `front`, in plan order, and that use."""
        with self._pool.lock:
            self._front = max(self._front, front)
            return self.uses.pending(max(self.floor, 0), max(self.newest, front, 0) + self.reach)

    def held_keys(self) -> np.ndarray:
        """Unit keys (int64) of the units this loader holds now."""
        return np.array([self._key(k) for k in self._pool.held(self._owner)], dtype=np.int64)

    @property
    def pool(self) -> WorkerPool:
        """The worker's pool this loader's units are held in (its budget, free and reserved bytes: `_prefetch`)."""
        return self._pool

    def plan(self, keys: np.ndarray, steps: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Planned segment reads (unit key, step, and the row read) of steps not planned before.

        With `rows`, a held unit that did not keep a row now planned is dropped (read again with every row then
        planned) when that row's step is within the reach; planned further ahead (`keep_steps`), it stays and is
        dropped once that step comes within the reach (`served`): under a global shuffle most held units gain a
        row with every chunk planned, and dropping them at once decoded each again for every chunk.
        """
        with self._pool.lock:
            if rows is not None:  # first: it refuses a row or step it cannot pack before anything is counted
                self.rows.add(keys, steps, rows)
            self.uses.add(keys, steps)
            self.plans += 1
            if rows is not None:
                self._by_rows = True
                k, st, r = (np.asarray(a, dtype=np.int64) for a in (keys, steps, rows))
                self._mark_uncovered(k, st, r)

    def _mark_uncovered(self, keys: np.ndarray, steps: np.ndarray, rows: np.ndarray) -> None:
        near = self.near()
        held = [(key, value) for key, value in self._pool.items(self._owner) if isinstance(value, KeptRows)]
        ints = np.array([self._key(key) for key, _ in held], dtype=np.int64)
        for i in np.flatnonzero(np.isin(ints, keys)).tolist() if held else []:  # only units it reads gain a row
            (key, value), k = held[i], int(ints[i])
            sel = keys == k
            new = ~np.isin(rows[sel], value.rows)
            if not new.any():
                continue
            first = int(steps[sel][new].min())
            if first <= near:
                self._pool.drop(self._owner, key)
                self._stale.pop(k, None)
            else:
                self._stale[k] = min(self._stale.get(k, first), first)

    def served(self, keys: np.ndarray, steps: np.ndarray) -> None:
        """Segment reads served: count them off and drop every held unit whose last use (in the horizon) is over."""
        with self._pool.lock:
            few = len(steps) <= FEW_READS  # plain ints: a few list updates per segment, no NumPy call
            ks, ss = (_ints(keys), _ints(steps)) if few else (keys, np.asarray(steps, dtype=np.int64))
            self.uses.consume(ks, ss)
            if len(ss):
                self._asked_for(int(min(ss) if few else np.min(ss)))
                newest = max(self.newest, int(max(ss) if few else np.max(ss)))
                moved = newest // self.policy.chunk_steps != self.newest // self.policy.chunk_steps
                self.newest = newest
                if moved:  # keeps the arrays small
                    floor = self.floor
                    self.uses.prune(floor)
                    self.rows.prune(floor, self.uses)
            held = self._pool.entries(self._owner)  # live: changed below only after the loop
            if not held:
                self._stale.clear()
                self._pool.trim()
                return
            ints = [self._key(k) for k in held]
            nxt, last = self.uses.next_steps(ints, self.floor), self.newest + self.plan_reach  # last: unscaled
            whole = last - self.policy.keep_steps  # a unit kept whole: the reach only
            drop, self._stale = _renew(held, ints, nxt, self._stale, self.newest + self.reach, last, whole)
            for key in drop:
                self._pool.drop(self._owner, key)
            self._pool.trim()

    def close(self) -> None:
        """Drop every unit of this loader and leave the pool (idempotent)."""
        if not self._closed:
            self._closed = True
            _leave(self._plan_id, self._pool, self._owner)
