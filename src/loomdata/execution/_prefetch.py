"""Plan-driven read-ahead for Source Loaders: fetch the units the next planned steps need before they are asked.

The loader's `PlanUnitCache` already knows which read units (Parquet row groups) its pending steps
need. `Prefetcher` turns that into reads ahead: the units with a pending use within the cache's
horizon that are neither held nor in flight, in plan order (earliest use first), at most `limit` in
flight on the worker process's read-ahead threads (shared by its loaders), each read with a fresh
`sibling` of the loader's reader (readers are not thread-safe), closed when the read is done: it shares
the loader's parsed footers, so opening costs no request, and no reader holds file handles between
reads (kept, 8 readers x 4 files of each of 150 loaders held ~18 MiB of a worker in Parquet handles). A
unit read ahead is offered to the cache strictly (it counts against the worker's budget, never
pushes out a unit needed sooner) and dropped at its last use like any other. Nothing is issued while
the budget is spent or a unit read ahead found no room, and a failed unit is not read ahead again,
until the next step is served.

Depth from latency: the static horizon (window + a few steps) is a number of steps, storage latency a time.
`Prefetcher` measures both sides, the latency and the rate steps are served (`StepRate`, from the first served
step), and raises the cache's reach (`PlanUnitCache.extra_steps`) so that a read issued at the reach's edge
lands `LATENCY_MARGIN` latencies before its step: a rank never waits on storage when the budget holds that
many steps' units (at most `MAX_EXTRA_STEPS` steps more). Until a rate is measured it assumes a fast rank
(`FAST_STEPS_PER_S`) for object URLs: the first steps after warm-up are served faster than any later ones
(their batches were built ahead); local files assume no rate (the horizon alone). The latency of object URLs
is the store's alone (the median of the process's recent range GETs to it, `storage.request_latency`), not the
whole read: a read's decode and its wait for a CPU grow with the machine's load, and its duration is known
only once the first row group has landed, while the shard opens' GETs give the store's latency before any:
sized from reads, the reach stayed at the horizon while the first 8 reads held every slot, and the units of
step ~145 were read late (session 7). Local files keep the read's own duration (a decaying high-water mark;
milliseconds when the machine is idle, adding nothing; under load it is mostly waiting for a CPU, so no rate
is assumed for them).

Reads in flight from the rate (session 22): for object URLs `limit` (`loader_prefetch`) is a floor. A read ahead
holds its slot for a GET's latency, so at most `limit` / latency units land a second (Little's law): 8 GETs of
~0.6 MB at 110 ms moved ~45 MB/s where two consumers of the object-store benchmark use ~115 MB/s (71-77 storage
waits a run). `Prefetcher` keeps `reads_in_flight` = `READS_MARGIN` x units first used a step (the pending plan,
between the newest step served and the reach's edge) x the served-step rate x the store's latency, at least `limit`,
at most `MAX_READS_IN_FLIGHT`, and above `limit` only as many as the worker's free budget, less the other loaders'
reads in flight (`WorkerPool.reserve`), holds at the decoded size of the units read lately (a unit read ahead is
offered strictly: one with no room is dropped, its GET wasted; none above `limit` before a unit's size is known).
The rate leaves out the time the loader waited on reads in flight (`StepRate.observe`'s `waited`):
measured while starved, it was the store's rate, and reads sized from it stayed starved (9-11 in flight). Until
a rate is measured (0.1 s after the first served step), `limit`: all 32 at warm-up shared the proxy's and the
store's CPU with the first steps' GETs, and the first batch came after 0.5 s instead of 0.1 s. Local files keep
exactly `limit` and the rate with waits in it: their reads are decoding and waiting for a CPU.

Local files read ahead only where their reads stall (session 23, `local_read_ahead` auto): reading ahead a file
the page cache holds is double work (thread hand-offs, futures, the pool's bookkeeping; `--loader-prefetch 0` gave
16.9-18.1M tokens per CPU-second against 14.3-14.9M at one consumer), but a cold or networked disk (NFS, Lustre, a
spinning disk) needs it. `ReadStall` starts a loader of local files with none (its reader reads what a step needs
inline), times each of those reads, and turns the read-ahead on (at `limit`) when a window of them stalls the steps
(`judge_stall`): their wall time at least `STALL_SHARE` of the window's (the read wait a step over the step interval),
their median at least `SLOW_READ_S` (a row group the page cache holds decodes in ~1-4 ms here; a cold disk or NFS
read adds 5-50 ms), and the process read from storage meanwhile (`storage_read_bytes`, the kernel's block input;
left out for files on a network filesystem or FUSE and off Linux, `counts_storage`: their reads' times decide):
on two loaded cores, reads of cached files took a median 5-29 ms and 25-92% of the time at 4 consumers (waiting for
a CPU, which a read-ahead thread waits for too), and wall time alone turned it on. Once on, it measures the reads
ahead the same way and turns off only after `QUIET_WINDOWS` windows in a row of fast reads (it does not flap).
Object URLs always read ahead.

The loader's own reader sees the cache through `Prefetcher` (a `UnitCache`): a `get` of a unit in
flight waits for that read instead of issuing a second one. Served bytes never depend on it: a unit
read ahead is the same decoded array `read` would keep. A failed read ahead keeps nothing and is
counted (`errors`); the step that needs the unit reads it itself, so the real error (retried by
storage where transient) is reported by that read, with the verifier's words.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loomdata.execution._loader_cache import Offered, PlanUnitCache, WorkerPool, int_key, split_key
from loomdata.execution._strand import process_threads
from loomdata.sources import FormatReader, KeptRows, UnitKey
from loomdata.storage import Location, is_url, request_latency, store_of

__all__ = [
    "COALESCE_BYTES",
    "COALESCE_GAP",
    "COALESCE_UNITS",
    "FAST_STEPS_PER_S",
    "LATENCY_MARGIN",
    "MAX_EXTRA_STEPS",
    "MAX_READS_IN_FLIGHT",
    "QUIET_WINDOWS",
    "READS_MARGIN",
    "SLOW_READ_S",
    "STALL_MIN_READS",
    "STALL_SHARE",
    "STALL_WINDOW_S",
    "STORAGE_MIN_BYTES",
    "UNACCOUNTED_FS",
    "WAIT_LOG",
    "PrefetchCounters",
    "Prefetcher",
    "ReadDepth",
    "ReadStall",
    "ReadWait",
    "StepRate",
    "UnitSpans",
    "coalesce",
    "counts_storage",
    "extra_steps",
    "judge_stall",
    "judgeable",
    "mount_types",
    "plan_prefetch",
    "read_stall",
    "reads_in_flight",
    "run_concurrently",
    "shared_threads",
    "storage_read_bytes",
    "submit_shared",
]

logger = logging.getLogger(__name__)

_THREADS = 32
"""Threads reading ahead in one worker process, shared by all its loaders (each bounded by its own `limit`)."""

LATENCY_MARGIN = 4.0
"""How many read durations ahead of its step a unit's read is issued (queueing behind `limit` reads in flight)."""

MAX_EXTRA_STEPS = 512
"""The most steps the latency adds to a cache's reach (the worker's byte budget bounds what is kept anyway)."""

FAST_STEPS_PER_S = 1000.0
"""The step rate a read-ahead of object URLs assumes until it has measured one: a fast rank, so the first reads
after warm-up are issued early enough (too far ahead costs only budget-bounded memory; too short, waits on storage).
Local files assume none (the horizon alone until a rate is measured): their read durations are decoding and waiting
for a CPU, not storage latency, and on a loaded worker (300 loaders' warm-up reads on 2 cores) a 0.1-0.5 s read at
this rate widened every loader's reach to the 512-step cap, and the reach is never narrowed: the loaders kept the
rows of every step to the plan's end (benchmarks/memory.py, 300 sources: 37 MiB a worker at step 14)."""

COALESCE_BYTES = 8 * 1024 * 1024
"""The most bytes one read ahead fetches when it joins neighbouring row groups of an object into one range GET."""

COALESCE_UNITS = 8
"""The most units one coalesced read ahead carries (each still counted and kept on its own)."""

COALESCE_GAP = 256 * 1024
"""The most bytes between two units' ranges that a coalesced GET fetches for nothing (other columns' chunks)."""

MAX_READS_IN_FLIGHT = 32
"""The most reads ahead one loader of object URLs keeps in flight (they run on the process's `_THREADS`)."""

READS_MARGIN = 2.0
"""Reads in flight per read Little's law asks for (units used a second x the store's latency): slack for a GET
slower than the median and for steps that start several units at once."""

STALL_SHARE = 0.2
"""A window of local reads stalls the steps (`ReadStall` turns the read-ahead on) when their wall time is at least this
share of the window's: the read wait a step is at least this share of the step interval."""

SLOW_READ_S = 0.005
"""...and their median read takes at least this long: a row group the page cache holds decodes in ~1-4 ms (this
machine, 2 MB decoded, loaded), a cold disk or NFS read takes 5-50 ms more. Reads ahead at half of it are fast."""

STORAGE_MIN_BYTES = 256 * 1024
"""...and their process read at least this many bytes from storage in the window (`storage_read_bytes`)."""

STALL_WINDOW_S = 0.5
"""The shortest window `ReadStall` judges (its reads' share is over this much wall time at least)."""

STALL_MIN_READS = 8
"""The fewest reads a window is judged on; a window that has not that many after `10 x STALL_WINDOW_S` is quiet."""

QUIET_WINDOWS = 4
"""Windows of fast reads in a row (median under `SLOW_READ_S / 2`, or wall time under a quarter of `STALL_SHARE`)
after which a read-ahead `ReadStall` turned on turns off again: on after one stalled window, off only after these."""

_NOTE_EVERY_S = 0.05  # object URLs: the units a step are re-measured this often while every read is in flight
_RATE_EVERY_S = 0.5  # how often the served-step rate is re-measured
_FIRST_RATE_S = 0.1  # the first measure, this soon after the first served step (the reach widens from it)
_UNIT_MEAN_OVER = 32  # units: a unit's decoded size is their mean, then a mean decaying by 1/32 a unit
_DECAY = 0.95  # per read: how fast the read-duration high-water mark forgets a slow read
_REREADS = 2  # times a unit read ahead is read again at most when newly planned rows were not kept
WAIT_LOG = 256
"""The most storage waits one loader's read-ahead remembers (`Prefetcher.waits`: the benchmarks' wait timeline)."""


def shared_threads() -> ThreadPoolExecutor:
    """This process's read-ahead threads (made on first use): hundreds of loaders must not own a pool each."""
    return process_threads("loom-prefetch", _THREADS)


def submit_shared(fn: Callable[[], None]) -> Future[None]:
    """Run `fn` on this process's planning threads (few; apart from the read-ahead threads its jobs wait on)."""
    return process_threads("loom-plan-ahead", 4).submit(fn)


def run_concurrently(jobs: Sequence[Callable[[], None]]) -> int:
    """Run `jobs` at once on this process's read-ahead threads and wait for all; how many raised.

    For opening a loader's objects (HEADs, footers, shard checks) in parallel rather than one after
    another: a failure is not raised here, the read that needs that object meets it again and reports it.
    """
    if not jobs:
        return 0
    if len(jobs) == 1:
        futs = [_run_one(jobs[0])]
    else:
        pool = shared_threads()
        futs = [pool.submit(job) for job in jobs]
    return sum(1 for f in futs if f.exception() is not None)


def _run_one(job: Callable[[], None]) -> Future[None]:
    fut: Future[None] = Future()
    try:
        job()
        fut.set_result(None)
    except Exception as e:  # reported by the read that needs it
        fut.set_exception(e)
    return fut


def extra_steps(read_s: float, steps_per_s: float, horizon: int) -> int:
    """Steps beyond `horizon` a read-ahead must reach to issue each read `LATENCY_MARGIN` read durations early."""
    if read_s <= 0 or steps_per_s <= 0:
        return 0
    need = math.ceil(LATENCY_MARGIN * read_s * steps_per_s)
    return int(min(max(need - horizon, 0), MAX_EXTRA_STEPS))


def reads_in_flight(units_per_s: float, latency_s: float, floor: int, cap: int) -> int:
    """Reads ahead to keep in flight so units land as fast as steps use them: `READS_MARGIN` x units a second x the
    store's latency (Little's law), at least `floor` (the configured `loader_prefetch`) and at most `cap`."""
    if units_per_s <= 0 or latency_s <= 0:
        return floor
    need = math.ceil(READS_MARGIN * units_per_s * latency_s)
    return int(max(floor, min(need, cap)))


def plan_prefetch(keys: np.ndarray, steps: np.ndarray, busy: np.ndarray, slots: int) -> np.ndarray:
    """The units to read ahead now: of `keys` (pending, in plan order, first use `steps`), not `busy`, `slots` at most.

    Pure: `busy` are the keys held or in flight. Plan order (earliest first use, then key) is kept.
    """
    if slots <= 0 or len(keys) == 0:
        return np.zeros(0, dtype=np.int64)
    free = ~np.isin(keys, busy)
    return np.asarray(keys, dtype=np.int64)[free][:slots]


Span = Callable[[int], "tuple[int, int] | None"]
"""A unit key's byte range in its object (None: not a range read)."""


def coalesce(
    keys: Sequence[int],
    free: set[int],
    span: Span,
    reads: int,
    max_bytes: int = COALESCE_BYTES,
    max_units: int = COALESCE_UNITS,
    max_gap: int = COALESCE_GAP,
) -> list[list[int]]:
    """`keys` (to read ahead, plan order) as at most `reads` reads, each joined by its object's neighbours in `free`.

    A read of key k takes the units k+1, k+2, ... and k-1, ... of the same shard that are `free` (pending, not held
    nor in flight) while their ranges stay within `max_gap` of the run's and the run within `max_bytes` and
    `max_units`: one GET instead of several. Pure; each run sorted, the runs in the plan order of their first key.
    """
    taken: set[int] = set()
    out: list[list[int]] = []
    for k in keys:
        if len(out) >= reads:
            break
        if k in taken:
            continue
        run = [k]
        taken.add(k)
        first = span(k)
        if first is not None:
            lo, hi = first
            shard = split_key(k)[0]
            for step in (1, -1):
                nxt = k + step
                while len(run) < max_units and nxt in free and nxt not in taken and split_key(nxt)[0] == shard:
                    got = span(nxt)
                    if got is None:
                        break
                    gap = got[0] - hi if step > 0 else lo - got[1]
                    new_lo, new_hi = min(lo, got[0]), max(hi, got[1])
                    if gap > max_gap or new_hi - new_lo > max_bytes:
                        break
                    run.append(nxt)
                    taken.add(nxt)
                    lo, hi = new_lo, new_hi
                    nxt += step
        out.append(sorted(run))
    return out


@dataclass
class StepRate:
    """Served steps per second, measured from the first step served, never over the idle time before it.

    A loader warms up (and reads ahead) well before the first request: measured from then, the first rate
    was diluted by the serve's start-up, so the reach widened only seconds into the run (session 6: waits
    early in every 100 ms run). The first measure comes `_FIRST_RATE_S` after the first served step.
    """

    steps_per_s: float = 0.0
    _mark: tuple[float, int, float] | None = None  # (time, newest step, `waited`) the next measure starts from

    def observe(self, newest: int, now: float, waited: float = 0.0) -> bool:
        """Note the newest served step (-1: none yet) at time `now`; True when the rate was re-measured.

        `waited`: seconds the loader has waited on storage so far (cumulative), left out of the measure: a rate
        measured while starved is the store's, not the rank's, and sizing the reads in flight from it kept
        them starved (object URLs pass it; at most 90% of an interval is left out)."""
        if newest < 0:
            return False
        if self._mark is None or newest < self._mark[1]:  # the first served step, or a resume further back
            self._mark = (now, newest, waited)
            return False
        t0, s0, w0 = self._mark
        if now - t0 < (_RATE_EVERY_S if self.steps_per_s > 0 else _FIRST_RATE_S) or newest <= s0:
            return False
        busy = max(now - t0 - (waited - w0), 0.1 * (now - t0))
        rate = (newest - s0) / busy
        self.steps_per_s = rate if self.steps_per_s <= 0 else 0.5 * (self.steps_per_s + rate)
        self._mark = (now, newest, waited)
        return True


@dataclass(frozen=True, slots=True)
class ReadWait:
    """One read that waited on a unit still being read ahead: when (wall clock), how long, and why.

    `issued_at`: when that unit's read ahead was issued (wall clock), `issued_front`: the newest step asked then,
    `newest`: the newest step served when the wait began, `in_flight`: reads ahead in flight then. A read issued
    long before the wait and still in flight is slow storage (or a starved CPU); one issued just before, late."""

    at: float
    seconds: float
    issued_at: float
    issued_front: int
    newest: int
    in_flight: int


@dataclass
class PrefetchCounters:
    """What a loader's read-ahead did: units kept, later used (hits), waited for, failed, not kept."""

    issued: int = 0
    prefetched: int = 0
    hits: int = 0
    waited: int = 0
    errors: int = 0
    dropped: int = 0  # read but not kept (no room, or no longer planned)
    misses: int = 0  # units the loader's own reader had to read (not held, not in flight, or held short of rows)
    reads: int = 0  # reads ahead issued: a coalesced one carries several units (`issued` counts units)
    reread: int = 0  # units read ahead again: chunks planned during the read wanted rows it did not keep


class UnitSpans:
    """Units' byte ranges in their objects, for coalescing reads ahead (`coalesce`): from the footers the loader's
    readers already hold, through one reader made on first use (never a request)."""

    def __init__(self, make_reader: Callable[[], FormatReader], paths: dict[int, Location]) -> None:
        self._make_reader, self._paths = make_reader, paths
        self._reader: FormatReader | None = None

    def span(self, key: int) -> tuple[int, int] | None:
        """Unit `key`'s byte range in its object, from the held footer (None: not held, or not a range read)."""
        shard, unit = split_key(key)
        path = self._paths.get(shard)
        if path is None or not is_url(path):
            return None
        if self._reader is None:
            self._reader = self._make_reader()
        return self._reader.unit_span(path, unit)


def judgeable(reads: int, window_s: float) -> bool:
    """Whether a window of `reads` reads over `window_s` seconds is long and full enough to judge (a window that has
    not `STALL_MIN_READS` reads after `10 x STALL_WINDOW_S` is judged too: quiet)."""
    return window_s >= STALL_WINDOW_S and (reads >= STALL_MIN_READS or window_s >= 10 * STALL_WINDOW_S)


def judge_stall(
    on: bool, reads: np.ndarray, window_s: float, quiet: int, storage_bytes: int | None
) -> tuple[bool, int, str] | None:
    """Whether a local loader reads ahead after a window of `window_s` seconds in which its reads took `reads` seconds
    each (inline while off, ahead while on) and its process read `storage_bytes` from storage (None: not known), and
    the quiet windows in a row since: (on, quiet, why); None: too few reads or too short a window to judge (keep
    measuring). Pure (`ReadStall` measures, this decides).

    Stalled (turn on): the reads' wall time is at least `STALL_SHARE` of the window's, their median at least
    `SLOW_READ_S`, and they came from storage (at least `STORAGE_MIN_BYTES`): reads that are slow while the page
    cache holds their bytes are waiting for a CPU (a loaded machine), which a read-ahead thread would wait for too.
    Quiet (on; `QUIET_WINDOWS` in a row turn it off): too few reads, a fast median, little wall time, or no storage."""
    if not judgeable(len(reads), window_s):
        return None
    share = float(np.sum(reads)) / window_s
    median = float(np.median(reads)) if len(reads) else 0.0
    stored = storage_bytes is None or storage_bytes >= STORAGE_MIN_BYTES
    why = f"{len(reads)} reads in {window_s:.2f} s, median {median * 1e3:.1f} ms, {share:.0%} of the time, " + (
        "storage not measured" if storage_bytes is None else f"{storage_bytes / 2**20:.1f} MiB from storage"
    )
    if not on:
        stalled = len(reads) >= STALL_MIN_READS and share >= STALL_SHARE and median >= SLOW_READ_S and stored
        return stalled, 0, why
    fast = len(reads) < STALL_MIN_READS or median < SLOW_READ_S / 2 or share < STALL_SHARE / 4 or not stored
    if not fast:
        return True, 0, why
    return (True, quiet + 1, why) if quiet + 1 < QUIET_WINDOWS else (False, 0, why)


def storage_read_bytes() -> int | None:
    """Bytes this process has read from storage, not from the page cache (`getrusage`'s block input: local disks
    that account their reads); None where not known (no `resource` module, or not Linux: macOS counts operations)."""
    if sys.platform != "linux":
        return None
    try:
        import resource
    except ImportError:  # pragma: no cover - Linux always has it
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_inblock) * 512


UNACCOUNTED_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "glusterfs", "9p", "virtiofs", "beegfs", "gpfs"}
)
"""Filesystem types whose reads the kernel's block input may not count (network filesystems; FUSE is `fuse.*`):
a loader of files there judges its reads by their times alone (`storage_read_bytes` would say 0)."""


def mount_types(paths: Sequence[str], mountinfo: str = "/proc/self/mountinfo") -> list[str | None]:
    """The filesystem type of the mount holding each of `paths` (the longest mount point above it), None where
    unknown (no /proc: not Linux)."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return [None] * len(paths)
    mounts: list[tuple[str, str]] = []
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if sep and len(fields) >= 5 and rest:
            mounts.append((fields[4].replace("\\040", " "), rest[0]))
    kinds: list[str | None] = []
    for path in paths:
        target, best, kind = os.path.realpath(path), -1, None
        for point, fs in mounts:
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) > best:
                best, kind = len(point), fs
        kinds.append(kind)
    return kinds


def counts_storage(paths: Sequence[str]) -> bool:
    """Whether the kernel's block input counts reads of every one of `paths` (local disks, not a network
    filesystem or FUSE, whose reads `storage_read_bytes` may not see)."""
    dirs = sorted({os.path.dirname(os.path.abspath(p)) for p in paths})
    kinds = mount_types(dirs)
    return all(k is not None and k not in UNACCOUNTED_FS and not k.startswith("fuse") for k in kinds)


class ReadStall:
    """Whether a loader of local files reads ahead now (`local_read_ahead`: "on", "off", or "auto": from its reads'
    times, `judge_stall`); `begin`/`end` time the reader's own reads of units it missed, `note` a read ahead."""

    def __init__(
        self,
        mode: str,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        stored: Callable[[], int | None] = storage_read_bytes,
    ) -> None:
        """`clock` and `stored` (the process's bytes read from storage so far) are what a window is measured with."""
        self.mode = mode
        self.on = mode == "on"
        self.turns: deque[tuple[bool, str]] = deque(maxlen=64)  # the latest turns (on?, its inputs), in order
        self._name = name
        self._clock = clock
        self._read_stored = stored
        self.timed = 0  # reads timed so far (auto)
        self._local = threading.local()  # the unit the reading thread missed and when its read began
        self._lock = threading.Lock()
        self._reads: list[float] = []
        self._since: float | None = None  # the window began (its first read)
        self._stored: int | None = None  # `storage_read_bytes` when it began
        self._quiet = 0

    def begin(self, key: int | None) -> None:
        """The reader missed unit `key` and reads it now."""
        if self.mode == "auto":
            self._local.read = (key, time.perf_counter())

    def end(self, key: int | None) -> None:
        """The reader read unit `key` (its rows are asked for): the read `begin` timed, if it is that one."""
        got = getattr(self._local, "read", None)
        if got is not None:
            self._local.read = None
            if got[0] == key:
                self.note(time.perf_counter() - got[1])

    def note(self, seconds: float) -> None:
        """A read of a unit took `seconds` (auto only)."""
        if self.mode == "auto":
            with self._lock:
                if self._since is None:
                    self._since, self._stored = self._clock() - seconds, self._read_stored()
                self.timed += 1
                self._reads.append(seconds)

    def ahead(self) -> bool:
        """Whether to read ahead now; auto: judges the window once it is long enough, logs a turn with its inputs."""
        since = self._since  # read once: another thread's judgement may close the window meanwhile
        if self.mode != "auto" or since is None or self._clock() - since < STALL_WINDOW_S:
            return self.on
        turned = None
        with self._lock:
            since, reads, now = self._since, self._reads, self._clock()
            if since is None or not judgeable(len(reads), now - since):
                return self.on  # closed by another thread, or not judged yet (no getrusage per pump)
            stored, began = self._read_stored(), self._stored
            read = None if stored is None or began is None else stored - began
            got = judge_stall(self.on, np.array(reads), now - since, self._quiet, read)
            if got is None:
                return self.on
            on, self._quiet, why = got
            self._reads, self._since = [], None
            if on != self.on:
                self.on, turned = on, (on, why)
                self.turns.append(turned)
        if turned is not None:  # logged outside the lock the reader threads' `note` takes
            logger.info(
                "local read-ahead %s: %s (%s; on at >= %.0f%% of the time, a median >= %.1f ms and >= %d KiB from "
                "storage; off after %d windows fast)",
                self._name,
                "on" if turned[0] else "off",
                turned[1],
                STALL_SHARE * 100,
                SLOW_READ_S * 1e3,
                STORAGE_MIN_BYTES // 1024,
                QUIET_WINDOWS,
            )
        return self.on


def read_stall(mode: str, name: str, paths: dict[int, Location]) -> ReadStall:
    """A loader's `ReadStall`; in auto over files whose reads the kernel's block input may not count (a network
    filesystem, FUSE, not Linux) the storage condition is left out: its reads' times alone decide."""
    if mode != "auto" or counts_storage([str(p) for p in paths.values()]):
        return ReadStall(mode, name)
    return ReadStall(mode, name, stored=lambda: None)


class ReadDepth:
    """How many reads ahead one loader keeps in flight: for object URLs (`sized`) `reads_in_flight` from what it
    measured (the units first used a step ahead, the decoded size of a unit read, the worker's free budget); for
    local files the configured `limit`."""

    def __init__(self, limit: int, sized: bool) -> None:
        self.limit = limit  # the configured floor (`loader_prefetch`)
        self.sized = sized
        self.reads = limit  # allowed in flight now
        self.units_per_step = 0.0  # units first used per step ahead (from the pending uses)
        self.unit_bytes = 0.0  # decoded bytes of a unit read ahead (a decaying mean): what a read in flight will hold
        self.noted_at = -math.inf  # when `units_per_step` was last measured
        self._units = 0
        self._reserved: dict[int, int] = {}  # bytes reserved in the worker's pool, by the first unit key of a read

    def full(self, requests: int, now: float) -> bool:
        """Whether no read can be issued now: `requests` in flight fill `limit` (local files) or the reads sized
        within the last `_NOTE_EVERY_S` (object URLs: not measured again at every pump while all are in flight)."""
        if not self.sized:
            return requests >= self.limit
        return now - self.noted_at < _NOTE_EVERY_S and requests >= self.reads

    def note_units(self, first: np.ndarray, newest: int, near: int, now: float) -> None:
        """Units first used per step: pending units (`first`: their first use) after the newest step served, up to
        the reach's edge `near`, over those steps."""
        lo = max(newest, 0)
        if self.sized and near > lo:
            self.units_per_step = int(np.count_nonzero(first > lo)) / (near - lo)
        self.noted_at = now

    def note_unit(self, nbytes: int) -> None:
        """A unit read ahead decoded to `nbytes`."""
        self._units = min(self._units + 1, _UNIT_MEAN_OVER)  # a mean of the first, then decaying (rows kept narrow)
        self.unit_bytes += (nbytes - self.unit_bytes) / self._units

    def reserve(self, pool: WorkerPool, key: int, units: int) -> None:
        """Reserve in `pool` what the read of `units` keyed `key` (its first unit) will hold, until `release`."""
        nbytes = int(self.unit_bytes * units) if self.sized else 0
        if nbytes > 0:
            pool.reserve(nbytes)
            self._reserved[key] = self._reserved.get(key, 0) + nbytes

    def release(self, pool: WorkerPool, key: int | None = None) -> None:
        """Release the reservation of the read keyed `key` (None: every one, at close); twice releases nothing."""
        for k in list(self._reserved) if key is None else [key]:
            nbytes = self._reserved.pop(k, 0)
            if nbytes:
                pool.reserve(-nbytes)

    def free(self, pool: WorkerPool) -> int:
        """`pool`'s free bytes less the other loaders' reads in flight (this loader's count as its own requests)."""
        return max(pool.free_bytes - (pool.reserved - sum(self._reserved.values())), 0)

    def size(self, steps_per_s: float, latency_s: float, counters: PrefetchCounters, free_bytes: int) -> int:
        """Reads allowed in flight: `limit` for local files or while no step rate is measured (warm-up: the first
        steps' units land first); else `reads_in_flight` at `steps_per_s` and the store's `latency_s` (GETs of
        `counters`' units a read), at most `MAX_READS_IN_FLIGHT`, above `limit` only as many as `free_bytes` holds."""
        want = self.limit
        if self.sized and steps_per_s > 0:
            per_read = max(counters.issued / counters.reads, 1.0) if counters.reads else 1.0
            cap = min(MAX_READS_IN_FLIGHT, _THREADS)
            want = reads_in_flight(self.units_per_step * steps_per_s / per_read, latency_s, self.limit, cap)
            # above the floor only what the free budget holds (no unit's size known yet: nothing tells, so none)
            fits = int(free_bytes // (self.unit_bytes * per_read)) if self.unit_bytes else 0
            want = max(self.limit, min(want, fits))
        self.reads = want
        return want


class Prefetcher:
    """One loader's read-ahead and its reader's view of the cache (`get`/`put` of `UnitCache`)."""

    def __init__(
        self,
        cache: PlanUnitCache,
        make_reader: Callable[[], FormatReader],
        paths: dict[int, Location],
        limit: int,
        name: str,
        assumed_steps_per_s: float | None = None,
    ) -> None:
        """`assumed_steps_per_s`: the step rate the reach is sized for until one is measured (None:
        `FAST_STEPS_PER_S` where a path is an object URL, 0 for local files; 0: none, the horizon alone)."""
        self.cache = cache
        self.limit = limit
        self.counters = PrefetchCounters()
        self.last_error: str | None = None
        self._make_reader = make_reader
        self._paths = paths
        self._shard_of = {str(p): s for s, p in paths.items()}
        self._pool = shared_threads()
        self.name = name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a finished read's follow-up pump is done
        self._pumping = 0  # finished reads whose follow-up pump (which may issue the next) still runs
        self._inflight: dict[int, Future[None]] = {}  # by unit key (a coalesced read's units share one future)
        self._issued: dict[int, tuple[float, int]] = {}  # by unit key in flight: (wall clock issued, front then)
        self.waits: deque[ReadWait] = deque(maxlen=WAIT_LOG)  # the latest reads that waited on a read ahead
        self._requests = 0  # reads ahead in flight (the `limit` bounds these)
        self._spans = UnitSpans(make_reader, paths)
        self._fresh: set[int] = set()  # read ahead and kept, not yet asked for
        self._hit = threading.local()  # per reading thread: the key its last `get` counted as a hit
        self._declined: set[int] = set()  # read ahead but not kept: not again until a step is served
        self._declined_at = -1  # the cache's newest step when they were declined
        self._stalled = False  # a unit was not kept for want of room: wait for the next served step
        self._front = -1  # the newest step asked for
        self._closed = False
        self.read_s = 0.0  # high-water mark of read-ahead durations (decaying)
        self.rate = StepRate()  # served steps per second, re-measured every _RATE_EVERY_S
        self._stores = sorted({store_of(str(p)) for p in paths.values() if is_url(p)})  # latency sizes the reach
        if assumed_steps_per_s is None:  # local files: no assumed rate (see FAST_STEPS_PER_S)
            assumed_steps_per_s = FAST_STEPS_PER_S if self._stores else 0.0
        self._assumed_rate = assumed_steps_per_s
        self._waited_s = 0.0  # seconds the reader waited on reads ahead (object URLs: not in the rate; see top)
        self.depth = ReadDepth(limit, sized=bool(self._stores))  # reads ahead allowed in flight now
        self.stall = read_stall("on" if self._stores else cache.policy.local_read_ahead, name, paths)  # local: when

    def get(self, key: UnitKey) -> Any | None:
        k = self._int_key(key)
        with self._lock:  # the read in flight and when it was issued, as one state
            fut = self._inflight.get(k) if k is not None else None
            issued, ahead = self._issued.get(k) if k is not None and fut is not None else None, self._requests
        if fut is not None:
            t0, at = time.monotonic(), time.time()
            issued = issued if issued is not None else (at, -1)
            newest = self.cache.newest
            wait_for([fut])
            with self._lock:
                self.counters.waited += 1
                took = time.monotonic() - t0
                self._waited_s += took
                self.waits.append(ReadWait(at, took, issued[0], issued[1], newest, ahead))
        value = self.cache.get(key)
        self._hit.key = None
        with self._lock:
            if value is None:
                self.counters.misses += 1
                self.stall.begin(k)
            elif k is not None and k in self._fresh:
                self._fresh.discard(k)
                self.counters.hits += 1
                self._hit.key = k
        return value

    def reading(self, keys: np.ndarray) -> bool:
        """Whether a read ahead of any of `keys` (unit keys) is queued or running (a `get` of it would wait)."""
        with self._lock:
            return any(k in self._inflight for k in np.unique(keys).tolist())

    def put(self, key: UnitKey, value: Any, nbytes: int) -> None:
        """The loader's own reader decoded `key`; if it was held, its kept rows fell short: a miss `get` missed."""
        if self.cache.get(key) is not None:
            with self._lock:
                self.counters.misses += 1
                if getattr(self._hit, "key", None) == self._int_key(key):  # `get` took it for a hit
                    self.counters.hits -= 1
            self._hit.key = None
        self.cache.put(key, value, nbytes)

    def wanted(self, key: UnitKey) -> np.ndarray | None:
        self.stall.end(self._int_key(key))  # a unit `get` missed was read: its rows are asked for now
        return self.cache.wanted(key)

    def pump(self, steps: np.ndarray | None = None) -> None:
        """Issue reads ahead for the pending uses up to the horizon of the newest step asked (or served)."""
        if self._closed or self.limit <= 0 or not self.stall.ahead():
            return
        if steps is not None and len(steps):
            self._front = max(self._front, int(np.max(steps)))
        c = self.cache
        self._measure_rate(c.newest)
        if c.pool.free_bytes <= 0:
            return
        front = max(self._front, c.newest, 0)
        with self._lock:  # what is held and what is in flight, seen together: a read finishing between
            if c.newest != self._declined_at:  # the two would otherwise be issued again
                self._declined.clear()
                self._declined_at = c.newest
                self._stalled = False
            if self._stalled or (d := self.depth).full(self._requests, now := time.monotonic()):
                return  # nothing can be issued now: skip the pending uses' bookkeeping
            keys, first = c.pending(front)
            d.note_units(first, c.newest, c.near(front), now)
            slots = d.size(self.rate.steps_per_s, self.latency(), self.counters, d.free(c.pool)) - self._requests
            if slots <= 0:
                return
            held = c.held_keys()
            busy = np.concatenate([held, np.fromiter([*self._inflight, *self._declined], dtype=np.int64)])
            free = plan_prefetch(keys, first, busy, len(keys))
            if self._stores and slots > 0 and len(free):
                runs = coalesce(free[: slots * COALESCE_UNITS].tolist(), set(free.tolist()), self._spans.span, slots)
            else:
                runs = [[k] for k in free[: max(slots, 0)].tolist()]
            for run in runs:
                shard = split_key(run[0])[0]
                path = self._paths.get(shard)
                if path is None:
                    continue
                units = [split_key(k)[1] for k in run]
                self.counters.issued += len(run)
                self.counters.reads += 1
                self._requests += 1
                fut = self._pool.submit(self._fetch, run, path, units, front, c.plans)
                d.reserve(c.pool, run[0], len(run))
                at = time.time()
                for k in run:
                    self._inflight[k] = fut
                    self._issued[k] = (at, front)

    def _measure_rate(self, newest: int) -> None:
        """Re-measure the served-step rate and widen the cache's reach to the latency it implies."""
        with self._lock:
            measured = self.rate.observe(newest, time.monotonic(), self._waited_s if self._stores else 0.0)
            if measured:  # a new rate: the reads in flight are sized again at the next pump, not up to 50 ms later
                self.depth.noted_at = -math.inf
            elif self.rate.steps_per_s > 0:
                return
            rate = self.rate.steps_per_s if self.rate.steps_per_s > 0 else self._assumed_rate  # not measured yet
            need = extra_steps(self.latency(), rate, self.cache.policy.horizon_steps)
            self.cache.extra_steps = max(self.cache.extra_steps, need)  # never narrowed: units read would be dropped

    def latency(self) -> float:
        """The latency the reach hides: the stores' GETs alone for object URLs, the whole read for local files."""
        return request_latency(self._stores) if self._stores else self.read_s

    def in_flight(self) -> int:
        """Reads ahead issued and not finished."""
        with self._lock:
            return len(self._inflight)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no read ahead is in flight (each finished one may issue the next); False on timeout."""
        while True:
            with self._lock:
                futs = list(self._inflight.values())
                if not futs:
                    if self._pumping == 0:
                        return True
                    if not self._idle.wait(timeout):
                        return False
                    continue
            done, _ = wait_for(futs, timeout)
            if not done:
                return False

    def _fetch(self, keys: list[int], path: Location, units: list[int], front: int, planned: int) -> None:
        reader: FormatReader | None = None
        try:
            reader = self._make_reader()
            t0 = time.perf_counter()
            wanted = [self.cache.wanted((str(path), u)) for u in units]
            if len(units) == 1:
                loaded = [reader.load_unit(path, units[0], wanted[0])]
            else:
                loaded = reader.load_units(path, units, wanted)
            took = time.perf_counter() - t0
            self.stall.note(took)
            with self._lock:
                self.read_s = max(took, self.read_s * _DECAY)
            for k, unit, got in zip(keys, units, loaded, strict=True):
                self._keep(k, path, unit, _cover(self, reader, path, unit, got, front, planned), front)
        except Exception as e:  # the read that needs the unit reads it again and reports the real error
            with self._lock:
                self.counters.errors += len(keys)
                self.last_error = f"{path}, units {units}: {type(e).__name__}: {e}"
                self._declined.update(keys)
        finally:
            if reader is not None:
                reader.close()
            with self._lock:
                self.depth.release(self.cache.pool, keys[0])  # before the follow-up pump sizes the next reads
                for k in keys:
                    self._inflight.pop(k, None)
                    self._issued.pop(k, None)
                self._requests -= 1
                self._pumping += 1
        try:
            self.pump()
        finally:
            with self._lock:
                self._pumping -= 1
                self._idle.notify_all()

    def _keep(self, k: int, path: Location, unit: int, got: tuple[Any, int] | None, front: int) -> None:
        """Offer a unit read ahead to the cache; not kept (no room, or not due: the reach narrowed, no longer planned),
        it is declined; only no room stalls the read-ahead until the next served step."""
        offered = Offered.NOT_DUE if got is None else self.cache.put_ahead((str(path), unit), got[0], got[1], front)
        with self._lock:
            if got is not None:
                self.depth.note_unit(got[1])
            if offered is Offered.KEPT:
                self.counters.prefetched += 1
                self._fresh.add(k)
            else:
                self.counters.dropped += 1
                self._declined.add(k)
                # no room: units needed later would not fit either; one no longer due stops nothing else
                self._stalled = self._stalled or offered is Offered.NO_ROOM

    def _int_key(self, key: UnitKey) -> int | None:
        shard = self._shard_of.get(str(key[0]))
        return None if shard is None else int_key(shard, key[1])

    def close(self) -> None:
        """Stop reading ahead: this loader's queued reads are cancelled, running ones finish and close their readers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.depth.release(self.cache.pool)  # queued reads never run; running ones no longer size anything
            for fut in self._inflight.values():
                fut.cancel()


def _cover(
    pf: Prefetcher,
    reader: FormatReader,
    path: Location,
    unit: int,
    got: tuple[Any, int] | None,
    front: int,
    planned: int,
) -> tuple[Any, int] | None:
    """`got`, or the unit read again if chunks planned during its read want rows it did not keep within the reach.

    A unit read ahead keeps the rows wanted when its read was issued; a chunk planned meanwhile may want
    more of it (the cache drops such units only among those it holds). Kept as it was, the read that needs a
    new row would find the unit held but short, and fetch it itself, on the read path (none planned since the
    read was issued, `planned`: none). A row wanted only past the reach does not make it read again now.
    """
    for _ in range(_REREADS):
        if got is None or not isinstance(got[0], KeptRows) or pf.cache.plans == planned:
            return got
        first = pf.cache.first_missing((str(path), unit), got[0].rows)
        if first < 0 or first > pf.cache.near(front):
            return got
        with pf._lock:
            pf.counters.reread += 1
        got = reader.load_unit(path, unit, pf.cache.wanted((str(path), unit)))
    return got
