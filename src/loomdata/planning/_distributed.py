"""Planning on a cluster: step ranges balanced and written on workers in parallel, stitched byte-identically.

Membership runs once, in the calling process (sequential by nature and cheap); then the steps are cut
into contiguous ranges at manifest partition bounds (`split_ranges`, about equal drawn segments each)
and every range is balanced on a worker *speculatively*, as if nothing were carried into its first step
(the first range gets the true incoming carry), writing its own partition files (planning._ranges).
Stitching, in step order: when the previous range's final carry (true, after its own fix-up) is empty
the speculation was exact; otherwise `fix_up` re-balances the range from its first step with the true
carry, step by step, until a step's outgoing carry equals the speculative one at that step (from there
on every step has the same inputs, so the same result), finishes that partition and rewrites the
partitions and report rows it touched. A step's result depends only on its drawn segments and its
incoming carry, so the stitched plan is byte-identical to the one-process plan. Most steps carry
nothing, so a fix-up is rare and short. A range refused (PlanError) with nothing carried in is planned
again here with its true carry; a refusal is final only with the true carry. A `Speculation` (planning._plan)
speculates on the look-ahead too: its first ranges go out on a look-ahead over a prefix of the steps, the whole
look-ahead is worked out here meanwhile, and they are kept only where the two assignments agree on their steps.
The whole look-ahead makes its assignment's arrays as maps of files in the shared folder (`_file_arrays`), so
sharing the whole work writes its pickle alone (at 50M samples it copied ~440 MB there: 0.15-0.3 CPU-s of the
driver's, between the whole look-ahead and the other ranges' sending).

`client` is anything with `submit(fn, *args) -> future` whose futures have `.result()`: a
distributed.Client or a concurrent.futures executor; planning itself imports no Dask. Workers write into the
plan's temporary folder, so they must see the workdir (a shared filesystem, as the embedded LocalCluster does),
and a Dask client's workers read the work from a shared folder too (`SharedWork`, in /dev/shm where every
worker sees it, else in the plan's folder): the driver writes it once (its large arrays as .npy files, the rest
pickled), every range is submitted at once, and each worker maps the files and cuts its own ranges' windows
(planning._ranges.window), so the driver neither cuts windows nor sends arrays (at 50M samples the 8 windows
took 0.8-2.4 CPU-s and their scatters 3-10 s of wall clock, the second worker idle meanwhile; writing the work
to /dev/shm 0.34 CPU-s). Another executor gets each range's window as its task's argument.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import itertools
import mmap
import os
import pickle
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlsplit

import numpy as np
import pyarrow.parquet as pq

from loomdata.planning._allocator import tune_allocator
from loomdata.planning._lookahead import Allocate, StepAssignment
from loomdata.planning._manifest import ManifestWriter
from loomdata.planning._ranges import PlanWork, RangePart, balanced_steps, plan_range, same_carry, window
from loomdata.planning._segments import Segments
from loomdata.planning._warm import mark_warm
from loomdata.schemas.errors import PlanError
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.spec import Spec

__all__ = [
    "CLUSTER_MIN_SAMPLES",
    "RANGES_PER_WORKER",
    "Executor",
    "SharedWork",
    "Speculation",
    "fix_up",
    "indexed_samples",
    "local_threads",
    "plan_ranges",
    "split_ranges",
    "wants_cluster",
    "worker_count",
]

RANGES_PER_WORKER = 4
"""Ranges per worker: several, so a slow worker does not hold the whole plan back."""

CLUSTER_MIN_SAMPLES = 20_000_000
"""`loom plan` starts an embedded cluster only for an index of at least this many samples. Measured (dp 64, 2
sources, benchmarks/plan_scale_cluster_ab.py, results/plan_scale_cluster_s5.json): the critical path on idle
cores (serial CPU + the driver's + the busiest worker's) over one process's CPU is 0.94x at 5M samples, 1.27x
at 20M and 1.39x at 50M with 2 workers, and starting the cluster takes 2-8 s: it pays from about 20M samples
on idle cores (on this loaded 2-core machine the wall clock did not pay at any size)."""


class Executor(Protocol):
    """What planning needs of a cluster: submit a function, get a future with `.result()`."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...


def indexed_samples(spec: Spec) -> int:
    """Samples in the spec's index on disk (from the tables' Parquet footers; 0 for a source not indexed)."""
    total = 0
    for name in spec.source_names:
        path = IndexFiles.of(spec.workdir, name).samples
        if path.exists():
            total += pq.ParquetFile(path).metadata.num_rows
    return total


def wants_cluster(spec: Spec, workers: int) -> bool:
    """Whether planning `spec` on an embedded cluster of `workers` processes pays (CLUSTER_MIN_SAMPLES)."""
    return workers >= 2 and indexed_samples(spec) >= CLUSTER_MIN_SAMPLES


def worker_count(client: Executor) -> int:
    """Workers of a distributed.Client (scheduler_info) or a concurrent.futures pool (_max_workers); 1 if unknown."""
    info = getattr(client, "scheduler_info", None)
    if callable(info):
        return max(1, len(info()["workers"]))
    return max(1, int(getattr(client, "_max_workers", 1)))


def local_threads(client: Executor) -> int:
    """Worker threads of a distributed.Client's workers on this host, or a concurrent.futures pool's (_max_workers;
    0 if unknown). A worker is on this host where it reports this host's identity (_host_identity: whatever address
    it listens on, in-process `inproc://` workers and workers under a remote scheduler too); one that cannot be
    asked is judged by its address (an `inproc://` one, loopback, or this host's name or addresses)."""
    info = getattr(client, "scheduler_info", None)
    if not callable(info):
        return int(getattr(client, "_max_workers", 0))
    workers = info()["workers"]
    try:
        ids = client.run(_host_identity, on_error="return")  # type: ignore[attr-defined]
    except Exception:  # any failure to ask: the addresses alone tell
        ids = {}
    me = _host_identity()
    here = _this_hosts_names()
    total = 0
    for a, w in workers.items():
        who = ids.get(a)
        local = who == me if isinstance(who, str) else _is_local_address(a, here)
        total += int(w.get("nthreads", 1)) if local else 0
    return total


def _host_identity() -> str:
    """This host's identity: its kernel's boot id (the same in every container on the host), else its name."""
    try:
        return "boot:" + Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "name:" + socket.gethostname()


def _this_hosts_names() -> set[str]:
    """Loopback, this host's name and the addresses it resolves to and listens on (where psutil is there)."""
    here = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
    with contextlib.suppress(OSError):
        here.add(socket.gethostbyname(socket.gethostname()))
    with contextlib.suppress(Exception):
        import psutil  # a dependency of distributed's

        here.update(a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs)
    return here


def _is_local_address(address: str, here: set[str]) -> bool:
    """Whether a worker's address is on this host: an in-process one, or its host among `here`."""
    parts = urlsplit(address)
    return parts.scheme == "inproc" or parts.hostname in here


def _addresses(client: Executor) -> list[str]:
    """The addresses of a distributed.Client's workers, sorted (none known: [])."""
    info = getattr(client, "scheduler_info", None)
    return sorted(info()["workers"]) if callable(info) else []


def split_ranges(work: PlanWork, n: int, first: int, lead: tuple[int, float] = (0, 1.0)) -> list[tuple[int, int]]:
    """At most `n` contiguous ranges [a, b) of steps first..steps-1 (`first` a manifest partition bound), cut at
    partition bounds, of about equal drawn segments each; with `lead` (k, size) the first k of them each `size`
    times the others' (a speculating plan's first ranges, balanced beside the whole look-ahead)."""
    if n < 1:
        raise ValueError(f"ranges must be >= 1, got {n}")
    if first not in work.bounds:
        raise ValueError(f"step {first} is not the first step of a manifest partition")
    bounds = work.bounds[work.bounds >= first]
    cum = np.concatenate([[0], np.cumsum(np.diff(work.ptr.totals()))])  # segments before step t
    at = cum[bounds]
    k, size = min(max(lead[0], 0), n), lead[1]
    ends = np.cumsum(np.where(np.arange(n) < k, size, 1.0))  # each range's end in units of a later range
    goals = at[0] + (at[-1] - at[0]) * ends[:-1] / ends[-1]
    cuts = np.unique(np.concatenate([[0], np.searchsorted(at, goals, side="left"), [len(bounds) - 1]]))
    return [(int(bounds[a]), int(bounds[b])) for a, b in itertools.pairwise(cuts) if b > a]


@dataclass(frozen=True)
class Speculation:
    """The look-ahead worked out over a prefix of the steps first (planning._plan): the ranges ending by `through`
    are balanced on it while `finish` works out the whole work here, and each is kept only where the prefix's
    assignment agrees with the whole's before `through` (StepAssignment.agrees; else it is balanced again on the
    whole work): the look-ahead, serial, overlaps the first ranges' balancing instead of preceding it."""

    work: PlanWork  # the plan's work with the prefix's look-ahead assignment (exact for steps < through if agreed)
    through: int  # a range bound: the ranges ending by it are balanced on `work`
    # the whole work (its assignment over every step), worked out once; its assignment's arrays made by the
    # allocator given (the shared folder's files: _file_arrays), else np.empty
    finish: Callable[[Allocate | None], PlanWork]


def plan_ranges(
    client: Executor,
    work: PlanWork | Speculation,
    out: Path,
    carry: Segments | None,
    ranges: list[tuple[int, int]],
    on_part: Callable[[RangePart], None],
) -> Segments | None:
    """Balance `ranges` on the cluster (`carry` into the first), fix each up in order and hand it to `on_part`
    (in step order, exact); return what the last step carries out. With a Speculation, its first ranges go out
    on the prefix's work before the whole work is worked out here (see Speculation)."""
    workers = _addresses(client) if callable(getattr(client, "scatter", None)) else []
    futures: list[Any] = [None] * len(ranges)
    true = carry
    spec = work if isinstance(work, Speculation) else None
    first_work: PlanWork = work.work if isinstance(work, Speculation) else work
    whole = first_work  # the work every range but the speculative ones is balanced on
    early = sum(1 for _, b in ranges if b <= spec.through) if spec is not None else len(ranges)
    with contextlib.ExitStack() as stack:
        saved: dict[int, tuple[str, np.ndarray]] = {}  # arrays already in the shared folder (by id)
        shared = _share(stack, client, first_work, out, saved) if workers else None
        first_shared = shared  # (where the early ranges read theirs, whatever the whole work's fate)
        if shared is not None and spec is not None and first_work.assignment is not None:
            _map_written(first_work.assignment, shared.folder, saved)

        def submit(i: int, w: PlanWork, sh: SharedWork | None) -> None:
            first, stop = ranges[i]
            c = carry if i == 0 else None
            if sh is not None:  # a Dask client: ranges dealt to the workers in turn, movable if one is busy
                where = [workers[i % len(workers)]]
                extra = {"pure": False, "workers": where, "allow_other_workers": True}
                futures[i] = client.submit(_shared_range, sh, out, first, stop, c, **extra)
            else:
                futures[i] = client.submit(_worker_range, window(w, first, stop), out, first, stop, c)

        try:
            for i in range(early):
                submit(i, first_work, shared)
            if spec is not None:
                # the look-ahead over every step, while the first ranges are balanced: its assignment made in the
                # shared folder's files where that is memory (/dev/shm), so sharing the whole work below writes its
                # pickle alone (not in a workdir's folder: a map of a disk or network file is written back as the
                # pass writes it over and over)
                in_memory = shared is not None and shared.folder.parent == _MEMORY_FS
                whole = spec.finish(_file_arrays(shared.folder, saved) if shared is not None and in_memory else None)
                if shared is not None:
                    shared = _share_more(shared, whole, saved)
                if not (
                    first_work.assignment is not None
                    and whole.assignment is not None
                    and first_work.assignment.agrees(whole.assignment, spec.through)
                ):
                    for i in range(early):  # (let them end first: they write the same partition files)
                        try:
                            futures[i].result()
                        except Exception:
                            if not _ended(futures[i]):  # lost or cancelled here: it may still be writing
                                raise
                        submit(i, whole, shared)
            for i in range(early, len(ranges)):
                submit(i, whole, shared)
            del first_work, spec
            for i, fut in enumerate(futures):
                try:
                    part: RangePart = fut.result()
                except UnsharedWorkdirError:
                    # a worker that cannot see the shared work's memory folder (one that joined after the check):
                    # that range is planned here, with its true carry; a workdir not shared is still an error
                    sh = shared if shared is not None else first_shared
                    if sh is None or sh.folder.parent != _MEMORY_FS:
                        raise
                    part = plan_range(whole, out, *ranges[i], true)
                except PlanError:  # refused with nothing carried in: only the true carry can tell
                    if i == 0 or true is None:
                        raise
                    part = plan_range(whole, out, *ranges[i], true)
                else:
                    if i > 0 and true is not None:
                        part = fix_up(whole, out, part, true)
                _check_written(out, part)
                on_part(part)
                true = part.final_carry
        except BaseException:
            _drain(futures, _DRAIN_S)
            raise
    return true


_DRAIN_S = 60.0
"""After a failure, how long the ranges already submitted are given to end before the error is raised: they
write into the plan's temporary folder, which the caller then removes (and a retry of the plan reuses)."""


def _ended(fut: Any) -> bool:
    """Whether the task behind `fut` ran to its end (a result or its own error), not only lost or cancelled in this
    process while it may still run: a Dask future's status, a concurrent.futures one's done() but not cancelled."""
    status = getattr(fut, "status", None)
    if isinstance(status, str):
        return status in ("finished", "error")
    return bool(fut.done()) and not fut.cancelled()


def _drain(futures: list[Any], timeout: float) -> None:
    """Cancel the submitted ranges that have not started (a concurrent.futures pool's; cancelling a Dask task
    that runs does not stop it), wait up to `timeout` seconds in all for the others to end, then cancel them all."""
    live = [f for f in futures if f is not None]
    for f in live:
        if not isinstance(getattr(f, "status", None), str):
            f.cancel()
    deadline = time.monotonic() + timeout
    for f in live:
        with contextlib.suppress(Exception):
            f.result(timeout=max(0.0, deadline - time.monotonic()))
    for f in live:
        f.cancel()


def _share(
    stack: contextlib.ExitStack,
    client: Executor,
    work: PlanWork,
    out: Path,
    saved: dict[int, tuple[str, np.ndarray]] | None = None,
) -> SharedWork:
    """`work` written where every worker of `client` reads it (see _shared_folder); the folder is removed, and
    the workers let go of their maps, when `stack` closes, whatever happens meanwhile (a failed write too).
    `saved` is filled with the arrays written (for _share_more)."""
    folder = _shared_folder(stack, client, out, work)
    saved = {} if saved is None else saved
    try:
        return SharedWork.write(work, folder, saved=saved)
    except OSError:  # the memory filesystem filled up since its free space was read: the plan's folder instead
        if folder.parent != _MEMORY_FS:
            raise
        shutil.rmtree(folder, ignore_errors=True)
        saved.clear()
        return SharedWork.write(work, _in_plan_folder(stack, client, out), saved=saved)


def _map_written(asg: StepAssignment, folder: Path, saved: dict[int, tuple[str, np.ndarray]]) -> None:
    """Swap each array of `asg` written as a file into `folder` for a read-only map of that file, and forget it in
    `saved` (no later work shares it): a speculation's prefix assignment is then not held in this process's memory
    as well while the whole look-ahead runs (50M samples: about 220 MB of its peak)."""
    for arrays in (asg.pos, asg.step):
        for k, a in enumerate(arrays):
            hit = saved.pop(id(a), None)
            if hit is not None:
                arrays[k] = np.load(folder / hit[0], mmap_mode="r")


def _share_more(shared: SharedWork, work: PlanWork, saved: dict[int, tuple[str, np.ndarray]]) -> SharedWork | None:
    """`work` written beside the work in `shared`'s folder, sharing the arrays already there (`saved`: the index
    columns and streams; only its own, e.g. a look-ahead assignment, are new); None where it does not fit (the
    caller sends windows instead)."""
    before = set(os.listdir(shared.folder))
    try:
        return SharedWork.write(work, shared.folder, name="whole.pkl", saved=saved)
    except OSError:  # what it wrote before it failed goes (it would hold memory until the plan ends)
        for name in set(os.listdir(shared.folder)) - before:
            with contextlib.suppress(OSError):
                (shared.folder / name).unlink()
        for key in [k for k, (name, _) in saved.items() if name not in before]:
            del saved[key]
        return None


def _cleanup(client: Executor, folder: Path) -> None:
    """Remove `folder`, then have the workers drop their maps of it (removed files live on while mapped; a worker
    gone or a client closed: nothing more to do, and never an error in place of the plan's own)."""
    shutil.rmtree(folder, ignore_errors=True)
    run = getattr(client, "run", None)
    if callable(run):
        with contextlib.suppress(Exception):
            run(_forget, folder, on_error="ignore")


_SHARED = ".work"
"""The folder (in the plan's temporary folder) the driver writes the shared work into where the workers do not
see this host's memory filesystem; removed when the ranges are done."""

_MEMORY_FS = Path("/dev/shm")
"""Where the shared work goes when every worker sees it (the embedded cluster: the workers on this host). Writing
the 850 MB of a 50M-sample plan's work took 0.34 CPU-s there, 0.4-1.8 into the workdir on this machine's disk
(the page cache's reclaim), against 0.8 for cutting the 8 windows the driver sent before, their sending aside."""

_MEMORY_PREFIX = "loom-plan-"
_SWEEP_AGE_S = 60.0
"""A folder in _MEMORY_FS younger than this is never swept (its process may be between making it and locking it)."""
_LOCK_FILE = "lock"
"""Held (flock) by the planning process for as long as its folder in _MEMORY_FS is in use: a folder whose lock
can be taken belongs to a process that is gone (the kernel drops a killed process's locks), so it is removed."""


def _shared_folder(stack: contextlib.ExitStack, client: Executor, out: Path, work: PlanWork) -> Path:
    """A folder of this process's own (0700, a fresh name) for the shared work: in _MEMORY_FS where it has room
    for the work twice over, so does the memory available, and every worker sees it (a marker written there,
    looked for on each); else in the plan's temporary folder. Removed when `stack` closes."""
    need = 2 * _work_bytes(work)
    try:
        _sweep_memory_fs()
        if shutil.disk_usage(_MEMORY_FS).free < need or _available_memory() < need:
            return _in_plan_folder(stack, client, out)
        folder = Path(tempfile.mkdtemp(prefix=_MEMORY_PREFIX, dir=_MEMORY_FS))
    except OSError:
        return _in_plan_folder(stack, client, out)
    stack.callback(_cleanup, client, folder)
    try:
        lock = stack.enter_context((folder / _LOCK_FILE).open("wb"))
        fcntl.flock(lock, fcntl.LOCK_EX)
        (folder / "marker").touch()
        seen = client.run(_exists, folder / "marker", on_error="return")  # type: ignore[attr-defined]
    except Exception:  # any failure to check: the workers are not known to see it
        seen = {}
    if seen and all(v is True for v in seen.values()):
        return folder
    return _in_plan_folder(stack, client, out)


def _in_plan_folder(stack: contextlib.ExitStack, client: Executor, out: Path) -> Path:
    """The shared work's folder in the plan's temporary folder (which every worker must see), removed with `stack`."""
    folder = out / _SHARED
    stack.callback(_cleanup, client, folder)
    return folder


def _sweep_memory_fs() -> None:
    """Remove this user's shared-work folders in _MEMORY_FS left by planning processes that are gone (killed:
    nothing else removes them, and they hold memory until the host restarts)."""
    for folder in _MEMORY_FS.glob(f"{_MEMORY_PREFIX}*"):
        try:
            st = folder.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or time.time() - st.st_mtime < _SWEEP_AGE_S:
                continue  # not ours, or just made (its lock may not be taken yet)
            with (folder / _LOCK_FILE).open("rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: its process is gone
        except FileNotFoundError:  # no lock after a minute: its process died before making it (or it is going)
            pass
        except OSError:  # in use (the lock is held), not ours, or being removed
            continue
        shutil.rmtree(folder, ignore_errors=True)


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (no such file: no limit known)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def _exists(path: Path) -> bool:
    return path.exists()


def _work_bytes(work: PlanWork) -> int:
    """The bytes of the work's per-position arrays (what the shared work writes, about)."""
    total = sum(a.nbytes for a in work.num_tokens) + sum(st.doc.nbytes for st in work.streams)
    total += sum(a.nbytes for a in work.samples if isinstance(a, np.ndarray))
    total += sum(a.nbytes for a in work.num_image_tokens if 0 not in a.strides)
    if work.assignment is not None:
        total += sum(a.nbytes for a in (*work.assignment.pos, *work.assignment.step))
    return total


_FILE_MIN = 1 << 16
"""Arrays of at least this many bytes go to the shared work as .npy files (smaller ones are pickled inline)."""


def _file_arrays(folder: Path, saved: dict[int, tuple[str, np.ndarray]]) -> Allocate:
    """An allocator (planning._lookahead.Allocate) whose arrays of _FILE_MIN bytes or more are maps of new .npy
    files in `folder` (`a<n>.npy`, their room reserved first), added to `saved`: a work holding them (or slices of
    them) is then shared without copying them (_ArrayPickler). Where the room cannot be had, np.empty."""
    names = (f"a{i}.npy" for i in itertools.count())

    def alloc(n: int, dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        if n * dt.itemsize < _FILE_MIN:
            return np.empty(n, dtype=dt)
        path = folder / next(names)
        try:
            arr = _mapped_file(path, n, dt)
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()
            return np.empty(n, dtype=dt)
        saved[id(arr)] = (path.name, arr)
        return arr

    return alloc


def _mapped_file(path: Path, n: int, dt: np.dtype) -> np.ndarray:
    """A writable array of `n` items of `dt` mapped from a new .npy file at `path` (what np.load reads), its room
    reserved up front (posix_fallocate: a full memory filesystem fails here, with OSError, never later as SIGBUS
    when a page of the map is first written) and its pages mapped in at once (MAP_POPULATE where there is one)."""
    header = {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False, "shape": (n,)}
    with path.open("x+b") as f:
        np.lib.format.write_array_header_1_0(f, header)
        offset = f.tell()
        size = offset + n * dt.itemsize
        os.posix_fallocate(f.fileno(), 0, size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        buf = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(buf, dtype=dt, count=n, offset=offset)


class UnsharedWorkdirError(PlanError):
    """A worker cannot see the plan's temporary folder: the workdir is not on a filesystem every worker shares."""


def _unshared(where: Path) -> UnsharedWorkdirError:
    return UnsharedWorkdirError(
        f"a worker cannot read {where} that this process wrote: planning on a cluster needs the workdir on a "
        "filesystem every worker shares; plan without --scheduler (or with --workers 1) otherwise"
    )


class _ArrayPickler(pickle.Pickler):
    """Pickles with every large plain ndarray written beside the pickle as `<n>.npy` (once per array object)."""

    def __init__(self, file: IO[bytes], folder: Path, saved: dict[int, tuple[str, np.ndarray]] | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.folder = folder
        # id -> (file name, the array, kept alive): an array another pickle in the folder wrote is not written again
        self.saved: dict[int, tuple[str, np.ndarray]] = {} if saved is None else saved
        # the next file's number: past every one there (names never repeat, whatever gaps removals left)
        self.files = 1 + max((int(p.stem) for p in folder.glob("*.npy") if p.stem.isdigit()), default=-1)
        self._spans: list[tuple[int, str, np.ndarray]] | None = None  # saved 1-D arrays by address (_within)
        self._starts: list[int] = []

    def persistent_id(self, obj: Any) -> str | None:
        if type(obj) is not np.ndarray or obj.nbytes < _FILE_MIN or obj.dtype.hasobject or 0 in obj.strides:
            return None
        hit = self.saved.get(id(obj))
        if hit is None:
            within = self._within(obj)
            if within is not None:
                return within
            hit = (f"{self.files}.npy", obj)
            self.files += 1
            np.save(self.folder / hit[0], obj, allow_pickle=False)
            self.saved[id(obj)] = hit
        return hit[0]

    def _within(self, obj: np.ndarray) -> str | None:
        """`<file>#<a>:<b>` where `obj` is items a..b-1 of a 1-D array already written in the folder (`saved`, as
        it was when this pickler began: e.g. a look-ahead's steps of one source, a slice of all sources' steps
        made in the folder by _file_arrays), else None."""
        if obj.ndim != 1 or not obj.flags.c_contiguous or obj.base is None:
            return None
        if self._spans is None:
            spans = [(a.__array_interface__["data"][0], name, a) for name, a in self.saved.values()]
            self._spans = sorted((s for s in spans if s[2].ndim == 1 and s[2].flags.c_contiguous), key=lambda s: s[0])
            self._starts = [s[0] for s in self._spans]
        at = obj.__array_interface__["data"][0]
        i = bisect.bisect_right(self._starts, at) - 1
        if i < 0:
            return None
        start, name, arr = self._spans[i]
        size = obj.dtype.itemsize
        if arr.dtype != obj.dtype or at + obj.nbytes > start + arr.nbytes or (at - start) % size:
            return None
        a = (at - start) // size
        return f"{name}#{a}:{a + len(obj)}"


class _ArrayUnpickler(pickle.Unpickler):
    """Reads what _ArrayPickler wrote, its arrays mapped from their files (copy on write: never written back)."""

    def __init__(self, file: IO[bytes], folder: Path) -> None:
        super().__init__(file)
        self.folder = folder
        self.maps: dict[str, np.ndarray] = {}  # each file mapped once (slices of one share its map)

    def persistent_load(self, pid: Any) -> np.ndarray:
        name, _, part = str(pid).partition("#")
        arr = self.maps.get(name)
        if arr is None:
            arr = self.maps[name] = np.load(self.folder / name, mmap_mode="c").view(np.ndarray)
        if not part:
            return arr
        a, b = (int(x) for x in part.split(":"))
        return arr[a:b]


class SharedWork:
    """A PlanWork written once into a folder every worker sees: large arrays as .npy files a worker maps (pages
    come from the page cache, each read once per worker), the rest pickled. Small on the wire (its path)."""

    def __init__(self, folder: Path, name: str = "work.pkl") -> None:
        self.folder = folder
        self.name = name

    @classmethod
    def write(
        cls,
        work: PlanWork,
        folder: Path,
        name: str = "work.pkl",
        saved: dict[int, tuple[str, np.ndarray]] | None = None,
    ) -> SharedWork:
        """`work` written into `folder` (created, or made this user's alone: workers refuse any other) as `name`;
        its large arrays already in `saved` (another work written there before) are not written again, and those
        it writes are added to it."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)
        with (folder / name).open("wb") as f:
            _ArrayPickler(f, folder, saved).dump(work)
        return cls(folder, name)

    def load(self) -> PlanWork:
        """The work, once per process, folder and name (a worker's later ranges reuse its maps); a folder this
        process cannot read, or one that is not this user's own (anyone else could have written the pickle),
        refused."""
        key = str(self.folder)
        with _LOCK:
            works = _LOADED.get(key)
            work = None if works is None else works.get(self.name)
            if work is None:
                if key in _FORGOTTEN:  # a cancelled range started after its plan ended
                    raise _unshared(self.folder)
                if works is None:
                    _LOADED.clear()  # another plan's work: let go of its maps
                    works = _LOADED[key] = {}
                try:
                    _check_owned(self.folder)
                    with (self.folder / self.name).open("rb") as f:
                        work = _ArrayUnpickler(f, self.folder).load()
                except OSError:
                    raise _unshared(self.folder) from None
                works[self.name] = work
            return work


def _check_owned(folder: Path) -> None:
    """PlanError unless `folder` is a real folder of this user's that no one else may write into."""
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PlanError(
            f"the shared planning work in {folder} is not a folder of this user's that only it can write: "
            "refusing to read it; plan again (a fresh folder is made for each plan)"
        )


_LOADED: dict[str, dict[str, PlanWork]] = {}
"""The shared works this process has mapped, by folder (one plan at a time) and name."""
_FORGOTTEN: set[str] = set()
"""Folders whose plan has ended (`_forget`): never mapped again in this process."""
_LOCK = threading.Lock()


def _forget(folder: Path) -> None:
    """Drop this process's maps of the shared work in `folder` (run on every worker when the ranges are done)."""
    with _LOCK:
        _LOADED.pop(str(folder), None)
        _FORGOTTEN.add(str(folder))


def _shared_range(shared: SharedWork, out: Path, first: int, stop: int, carry: Segments | None) -> RangePart:
    """plan_range on a worker over its window of the shared work (cut there: its documents' columns gathered
    in stream order, which balancing then reads in order), its allocator tuned first; its CPU time includes
    reading the work and cutting the window."""
    tune_allocator()
    mark_warm()  # (a warming task still queued here has nothing left to do)
    cpu = time.thread_time()
    part = plan_range(window(shared.load(), first, stop), out, first, stop, carry)
    return replace(part, cpu_seconds=time.thread_time() - cpu)


def _check_written(out: Path, part: RangePart) -> None:
    """PlanError when a worker's partition file is not where this process looks (no shared workdir)."""
    missing = [f.path for f in part.files if not (out / f.path).is_file()]
    if missing:
        raise PlanError(
            f"a worker wrote manifest partition {missing[0]} (and {len(missing) - 1} more) where this process "
            f"cannot see it under {out}: planning on a cluster needs the workdir on a filesystem every worker "
            "shares; plan without --scheduler (or with --workers 1) otherwise"
        )


def _worker_range(work: PlanWork, out: Path, first: int, stop: int, carry: Segments | None) -> RangePart:
    """plan_range on a worker, its allocator tuned first (tune_allocator)."""
    tune_allocator()
    mark_warm()
    return plan_range(work, out, first, stop, carry)


def fix_up(work: PlanWork, out: Path, part: RangePart, carry: Segments) -> RangePart:
    """`part` (balanced with nothing carried in) re-balanced from its first step with the true `carry` until a
    step carries out what it carried out speculatively, through the end of that step's partition; the
    partitions and report rows of those steps are rewritten, the rest kept."""
    cpu = time.thread_time()
    writer = ManifestWriter(out, work.plan_id, work.bounds, first_step=part.first)
    sink = work.sink(writer, part.report, report_from=part.first)
    carries = dict(part.carries)
    stop = part.stop
    converged = False
    for t, b in balanced_steps(work, part.first, part.stop, carry):
        sink.add(t, b)
        if b.carry is None:
            carries.pop(t, None)
        else:
            carries[t] = b.carry
        if not converged and same_carry(b.carry, part.carries.get(t)):
            converged, stop = True, work.bound_after(t)
        if t + 1 == stop:
            break
    files = writer.close(stop - 1)
    kept = [f for f in part.files if f.first_step >= stop]
    cpu = part.cpu_seconds + time.thread_time() - cpu
    return RangePart(
        first=part.first,
        stop=part.stop,
        files=[*files, *kept],
        report=part.report,
        carries=carries,
        cpu_seconds=cpu,
        worker=part.worker,
        span=part.span,
    )
