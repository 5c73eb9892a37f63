"""Loader CPU memory, side by side: R replicated per-rank DataLoaders vs one loomdata executor.

Sum of PSS (`/proc/PID/smaps_rollup`) over every process involved, for N Parquet sources x 4 shards x
2,000 short documents each and R ranks, at first coverage (every source read once) and warm (every
source has had many documents read):

- baseline: each of R spawned rank processes (torch imported) runs `DataLoader(num_workers=2)` over an
  IterableDataset whose forked workers open every source's files with `pyarrow.parquet.ParquetFile`
  (kept open, as a replicated loader does) and read row groups source by source; once with pyarrow's
  defaults (`pre_buffer=True`), once with `pre_buffer=False`, and once with `pre_buffer=False` and
  Arrow's jemalloc allocator (as loomdata's embedded workers use it). Counted: rank + its 2 workers.
  Beside them, the same pattern at its least memory (`baseline_no_prebuffer_w0`): `pre_buffer=False` and
  `num_workers=0`, each rank reading every source itself (one process a rank, not three).
- loomdata: one serving process (embedded LocalCluster scheduler + `Executor` with default
  autoscaling, as `loom serve` runs it) with its nannies and 2 worker processes (and, where the workers were forked
  from a fork server, that server, counted with them: `fork_server_mib`), plus each of R rank
  processes iterating `LoomDataset(plan_dir, rank)`, counted as its PSS above an idle torch process
  (one that imported torch and did nothing, running beside the ranks), as the issue defines it. The
  plan is `make_plan` over the index `build_index` built on an embedded cluster.

Ratios are printed both as the issue defines them (baseline total / loomdata with rank excess) and
like for like (every process of both sides counted whole). A rank's excess is its private memory
(Private_Clean + Private_Dirty) above that of an idle torch process running beside the ranks: with R
ranks mapping torch's libraries, PSS gives each rank 1/R of those pages (so a rank's PSS can fall
below an idle process's), and an idle process measured alone holds all of them privately. Results go to
benchmarks/results/memory.json with a per-process breakdown of loomdata's side: for the serving process
and each worker, smaps by kind, glibc's heap, the heavy modules imported, and for workers what one more
`malloc_trim` returns (with `LOOM_BENCH_TRACE_WORKERS=1` in the environment, the workers and the serving process
trace Python allocations and report their largest owners). `--data DIR` keeps data, index and plans between runs;
`--workers N` sizes the embedded cluster (another layout).

    .venv/bin/python benchmarks/memory.py --quick     # N 10, 100; R 4 (a few minutes on 2 cores)
    .venv/bin/python benchmarks/memory.py             # N 10, 100, 300; R 4, 8, 16 (long)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "memory.json"
MIB = 1 << 20
ROW_GROUP = 128


# ---- PSS ------------------------------------------------------------------------------------------


def pss(pid: int) -> int:
    """Proportional set size of one process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return 0


def uss(pid: int) -> int:
    """Private (unshared) bytes of one process: what it costs beyond pages other processes map too."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return total


def tree(pid: int) -> list[tuple[int, int, str]]:
    """(pid, depth, name) of a process and all its descendants."""
    import psutil

    root = psutil.Process(pid)
    out = [(pid, 0, "root")]
    for child in root.children(recursive=True):
        try:
            depth, p = 1, child.ppid()
            while p != pid and p > 1:
                depth, p = depth + 1, psutil.Process(p).ppid()
            cmd = " ".join(child.cmdline())
            name = (
                "resource_tracker"
                if "resource_tracker" in cmd
                else "fork_server"
                if "multiprocessing.forkserver" in cmd
                else "child"
            )
            out.append((child.pid, depth, name))
        except psutil.NoSuchProcess:
            continue
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has spent (0 if it is gone)."""
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def tree_pss(pid: int) -> int:
    return sum(pss(p) for p, _, _ in tree(pid))


# ---- data -----------------------------------------------------------------------------------------


def write_data(root: Path, n_sources: int, shards: int, docs: int, mean_len: float, seed: int) -> list[list[str]]:
    """N sources of `shards` Parquet files of `docs` pre-tokenized short documents (128-row row groups)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = root / f"written-{n_sources}x{shards}x{docs}-{mean_len:g}-{seed}"
    if done.exists():  # `--data`: written by an earlier run with the same parameters
        return [[str(root / f"s{s:03d}" / f"part-{k}.parquet") for k in range(shards)] for s in range(n_sources)]
    rng = np.random.default_rng(seed)
    files: list[list[str]] = []
    for s in range(n_sources):
        d = root / f"s{s:03d}"
        d.mkdir(parents=True, exist_ok=True)
        files.append([])
        for k in range(shards):
            lens = np.clip(rng.lognormal(np.log(mean_len), 0.6, size=docs), 8, 4000).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            values = rng.integers(1, 50_000, size=int(offsets[-1]), dtype=np.int32)
            arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            path = d / f"part-{k}.parquet"
            pq.write_table(pa.table({"tokens": arr}), path, row_group_size=ROW_GROUP)
            files[-1].append(str(path))
    done.touch()
    return files


def make_spec(root: Path, n_sources: int, ranks: int, steps: int, seq_len: int) -> Any:
    from loomdata.schemas import parse_spec

    names = [f"s{s:03d}" for s in range(n_sources)]
    return parse_spec(
        {
            "name": f"bench-memory-{n_sources}-{ranks}",
            "workdir": str(root / "work"),
            "seed": 0,
            "sources": [
                {"name": n, "format": "parquet", "paths": [f"{n}/*.parquet"], "tokens_field": "tokens"} for n in names
            ],
            "mixture": {"weights": {n: 1.0 / n_sources for n in names}},
            "training": {"seq_len": seq_len, "steps": steps, "dp_size": ranks, "micro_batches": 1},
        },
        root,
    )


# ---- processes (each spawned) ---------------------------------------------------------------------


def idle_torch(ready: Any, stop: Any) -> None:
    """An idle rank: torch imported, nothing else."""
    import torch  # noqa: F401

    ready.put(("idle", os.getpid()))
    stop.wait()


def _replicated(files: list[list[str]], passes: int, pre_buffer: bool) -> Any:
    """A replicated per-rank loader: every worker opens every source's files and reads row groups.

    Pass 0 reads one row group of every source (first coverage); each later pass reads the next
    file's next row group of every source, so after `passes` passes each worker has opened
    min(passes, shards) files per source and read `passes` x 128 documents of each. Defined here, not
    at module level, so that the serving process never imports torch.
    """
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import IterableDataset, get_worker_info

    class Replicated(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[Any]:
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            info = get_worker_info()
            wid = info.id if info else 0
            handles: dict[str, Any] = {}  # kept open, as a replicated loader over all sources does
            for p in range(passes):
                for src in files:
                    path = src[(p + wid) % len(src)]
                    f = handles.get(path)
                    if f is None:
                        f = handles[path] = pq.ParquetFile(path, pre_buffer=pre_buffer)
                    g = (p // len(src) * 2 + wid) % f.metadata.num_row_groups
                    col = f.read_row_group(g, columns=["tokens"]).column(0).combine_chunks()
                    yield p, torch.from_numpy(col.values.to_numpy(zero_copy_only=False))
            while True:  # stay alive with every file open: the rank measures after its last real item
                time.sleep(0.05)
                yield -1, torch.empty(0, dtype=torch.int32)

    return Replicated()


def baseline_rank(
    files: list[list[str]], passes: int, pre_buffer: bool, workers: int, ready: Any, go: Any, stop: Any
) -> None:
    """A rank with `DataLoader(num_workers=workers)` (2 as the issue defines it; 0: the rank reads itself);
    reports at first coverage and after `passes` passes."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    extra: dict[str, Any] = {"prefetch_factor": 2, "multiprocessing_context": "fork"} if workers else {}
    loader = DataLoader(_replicated(files, passes, pre_buffer), batch_size=None, num_workers=workers, **extra)
    n = len(files)
    readers = max(workers, 1)
    it = iter(loader)
    for i in range(readers * n * passes):  # the workers alternate: 2n items = both have read every source once
        next(it)
        if i + 1 == readers * n:
            ready.put(("cover", os.getpid()))
            go.wait()
    ready.put(("warm", os.getpid()))
    stop.wait()
    del it


def loom_rank(plan_dir: str, rank: int, cover: int, warm: int, ready: Any, go: Any, stop: Any) -> None:
    """A rank iterating `LoomDataset`; reports after step `cover` and after step `warm`."""
    import torch

    from loomdata.torch import LoomDataset

    torch.set_num_threads(1)
    ds = LoomDataset(plan_dir, rank)
    for step, _ in enumerate(ds):
        if step == cover:
            ready.put(("cover", os.getpid()))
            go.wait()
        if step == warm:
            break
    ready.put(("warm", os.getpid()))
    stop.wait()
    ds.close()


def _glibc_heap() -> dict[str, float]:
    """glibc malloc's heap (all arenas, `mallinfo2`): bytes in use and free-but-kept (C++ objects, NumPy arrays)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return {}
    fn.restype = MallInfo2
    m = fn()
    return {"used_mib": round(m.uordblks / MIB, 1), "free_kept_mib": round(m.fordblks / MIB, 1)}


HEAVY_MODULES = (
    "torch",
    "numba",
    "polars",
    "pandas",
    "pydantic",
    "pyarrow",
    "pyarrow.dataset",
    "pyarrow.compute",
    "loomdata.planning",
    "loomdata.sources",
    "loomdata.execution._loader",
    "loomdata.execution._constructor",
    "bokeh",
    "cryptography",
    "fsspec",
)
"""Modules whose presence in a process says what it loaded that it may not need (reported per process)."""


def _smaps_rollup() -> dict[str, float]:
    """This process's memory by kind (MiB), from /proc/self/smaps_rollup."""
    roll = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Anonymous", "AnonHugePages", "Pss_File", "LazyFree"):
                roll[k] = round(int(v.split()[0]) / 1024, 1)
    return roll


def _anon_by_mapping(pid: int | str = "self") -> dict[str, float]:
    """Anonymous resident MiB of a process (default this one) by kind of mapping (/proc/PID/smaps): glibc's main
    heap (`[heap]`), glibc's thread arenas (64 MiB-aligned reservations), thread stacks (8 MiB mappings), and
    everything else (Arrow's jemalloc extents, Python's object arenas, large NumPy buffers mapped on their own)."""
    out = {"glibc_main_heap": 0.0, "glibc_thread_arenas": 0.0, "thread_stacks": 0.0, "other": 0.0}
    heap_max = 64 << 20
    with open(f"/proc/{pid}/smaps") as f:
        lines = f.read().splitlines()
    start = size = 0
    name = ""
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            start, size, name = lo, hi - lo, (head[5] if len(head) > 5 else "")
        elif line.startswith("Anonymous:"):
            kib = int(head[1])
            if not kib:
                continue
            if name == "[heap]":
                kind = "glibc_main_heap"
            elif name:
                kind = "other"
            elif start % heap_max == 0 and size <= heap_max:
                kind = "glibc_thread_arenas"
            elif size in (8 << 20, (8 << 20) - 4096, (8 << 20) + 4096):
                kind = "thread_stacks"
            else:
                kind = "other"
            out[kind] += kib / 1024
    return {k: round(v, 1) for k, v in out.items()}


def _python_arenas_mib() -> dict[str, float] | None:
    """MiB Python's small-object allocator holds in arenas and MiB of its blocks in use (`sys._debugmallocstats`)."""
    import sys
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    used = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text)
    arenas = re.search(r"(\d+) arenas \* (\d+) bytes/arena\s*=\s*([\d,]+)", text)
    if arenas is None or used is None:
        return None
    return {
        "arenas_mib": round(int(arenas.group(3).replace(",", "")) / MIB, 1),
        "in_use_mib": round(int(used.group(1).replace(",", "")) / MIB, 1),
    }


def _jemalloc_mib() -> dict[str, float] | None:
    """Arrow's jemalloc totals (allocated, active, resident, metadata, retained; MiB) from its own statistics
    (`arrow::jemalloc_stats_print` as JSON, called through ctypes); None where this pyarrow has no jemalloc."""
    import ctypes
    import json as _json
    import tempfile

    import pyarrow as pa

    try:
        lib = ctypes.CDLL(str(Path(pa.__file__).parent / f"libarrow.so.{pa.__version__.split('.')[0]}00"))
        fn = lib._ZN5arrow20jemalloc_stats_printEPKc  # arrow::jemalloc_stats_print(const char*) -> Status
    except (OSError, AttributeError):
        return None
    fn.restype = None
    status = ctypes.create_string_buffer(64)  # the returned Status (its state pointer: null when OK)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            fn(status, b"Jgmdablxeh")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    try:
        st = _json.loads(text)["jemalloc"]["stats"]
    except (ValueError, KeyError):
        return None
    keys = ("allocated", "active", "resident", "metadata", "mapped", "retained")
    return {k: round(st[k] / MIB, 1) for k in keys if k in st}


def _tracemalloc_top(n: int = 25) -> list[str] | None:
    """The `n` largest owners of Python-traced memory by file and line (when tracing: PYTHONTRACEMALLOC)."""
    import tracemalloc

    if not tracemalloc.is_tracing():
        return None
    snap = tracemalloc.take_snapshot()
    stats = snap.statistics("lineno")
    total = sum(s.size for s in stats)
    top = [f"{s.size / MIB:.2f} MiB {s.traceback[0].filename}:{s.traceback[0].lineno}" for s in stats[:n]]
    if tracemalloc.get_traceback_limit() > 1:  # LOOM_BENCH_TRACE_WORKERS=N > 1: also by the newest loomdata frame
        by: dict[str, int] = {}
        for s in snap.statistics("traceback"):
            ours = [f for f in s.traceback if "loomdata" in f.filename]
            where = ours[-1] if ours else s.traceback[-1]
            key = f"{where.filename}:{where.lineno}"
            by[key] = by.get(key, 0) + s.size
        top += ["by the newest loomdata frame:"] + [
            f"{size / MIB:.2f} MiB {key}" for key, size in sorted(by.items(), key=lambda kv: -kv[1])[:n]
        ]
    return [f"total {total / MIB:.1f} MiB", *top]


def process_inside() -> dict[str, Any]:
    """This process's memory by kind (smaps), glibc's heap, threads, Python objects and heavy modules imported."""
    import gc
    import sys
    import threading

    roll = _smaps_rollup()
    return {
        "smaps_mib": roll,
        "glibc_heap_mib": _glibc_heap(),
        "threads": threading.active_count(),
        "python_objects": len(gc.get_objects()),
        "modules": len(sys.modules),
        "heavy_modules": [m for m in HEAVY_MODULES if m in sys.modules],
        "anon_by_mapping_mib": _anon_by_mapping(),
        "python_arenas_mib": _python_arenas_mib(),
        "tracemalloc_top": _tracemalloc_top(),
    }


_INSIDE_EXTRA = ("heavy_modules", "anon_by_mapping_mib", "python_arenas_mib", "tracemalloc_top")


def worker_inside() -> dict[str, Any]:
    """Run on a worker: where its memory is (anonymous, of it huge pages; Arrow's pool; glibc's heap; threads;
    open Parquet files)."""
    import gc
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    roll = _smaps_rollup()
    from loomdata.execution._loader_cache import _POOLS

    held = [e for p in list(_POOLS.values()) for d in list(p._owned.values()) for e in list(d.values())]
    # each loader's reach (steps read ahead and kept for) and rows' keep past it
    caches = [o for o in gc.get_objects() if type(o).__name__ == "PlanUnitCache"]

    def spread(vals: list[int]) -> list[int]:
        """min / median / max"""
        v = sorted(vals)
        return [v[0], v[len(v) // 2], v[-1]] if v else []

    return {
        "loader_cache_mib": round(sum(p.nbytes for p in list(_POOLS.values())) / MIB, 1),
        # the units held and the step each is next used at (diagnosis: rows kept for steps already built?)
        "loader_cache_units": len(held),
        "loader_cache_next_use": spread([e.next_use for e in held]),
        "loader_horizon_steps": spread([c.policy.horizon_steps for c in caches]),
        "loader_reach_steps": spread([c.reach for c in caches]),
        "loader_keep_now_steps": spread([getattr(c, "keep_now", c.policy.keep_steps) for c in caches]),
        "loader_checksums": _checksums_held(),
        "smaps_mib": roll,
        "arrow_pool_mib": round(pa.total_allocated_bytes() / MIB, 1),
        "arrow_pool_peak_mib": round(pa.default_memory_pool().max_memory() / MIB, 1),
        "jemalloc_mib": _jemalloc_mib() if pa.default_memory_pool().backend_name == "jemalloc" else None,
        "glibc_heap_mib": _glibc_heap(),
        "threads": threading.active_count(),
        "thread_names": _thread_names(),
        "open_parquet_files": sum(1 for o in gc.get_objects() if isinstance(o, pq.ParquetFile)),
        **{k: v for k, v in process_inside().items() if k in _INSIDE_EXTRA},
        "trim_now_returns_mib": _trim_now(roll["Anonymous"]),
    }


def _checksums_held() -> dict[str, int]:
    """The sample checksums this worker's loaders hold (`verify: sample`): bytes, samples, and their reads again
    from samples.parquet (planning a span; `rereads`: by a read, a sample outside the steps held)."""
    from loomdata.execution._loader import _LIVE  # this worker's open loaders

    sums = [s for s in (lo._index.checksums for lo in list(_LIVE)) if s is not None]
    return {
        "loaders": len(sums),
        "bytes": sum(int(s.nbytes) for s in sums),
        "held": sum(int(getattr(s, "held", len(s))) for s in sums),
        "samples": sum(len(s) for s in sums),
        "loads": sum(int(getattr(s, "loads", 0)) for s in sums),
        "rereads": sum(int(getattr(s, "rereads", 0)) for s in sums),
    }


def _thread_names() -> dict[str, int]:
    """Python threads by name with trailing digits dropped (which pools a worker runs: each thread may own a
    glibc arena)."""
    import collections
    import threading

    return dict(collections.Counter(re.sub(r"[-_ ]?\d+$", "", t.name) for t in threading.enumerate()).most_common())


def _trim_now(anon_before_mib: float) -> float | None:
    """Anonymous MiB a `malloc_trim(0)` now gives back (what the workers' periodic trim left resident)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return round(anon_before_mib - int(line.split()[1]) / 1024, 1)
    return None


def _serve_config(config: Any, autoscaling: Any) -> Any:
    """`loom serve`'s defaults; the loader cache budget of `--loader-memory` (as LOOM_BENCH_LOADER_MIB)."""
    mib = os.environ.get("LOOM_BENCH_LOADER_MIB")
    extra = {} if mib is None else {"loader_memory": int(float(mib) * MIB)}
    return config(autoscale=autoscaling(), **extra)


def _loader_reads(m: Any) -> dict[str, int]:
    """The loaders' read-ahead counters summed (units read ahead, then used, waited for, read on the request path):
    what a shorter horizon costs in reads the read-ahead did not cover."""
    keys = ("calls", "prefetched", "prefetch_hits", "prefetch_waits", "unit_misses")
    return {k: sum(int(getattr(lo.metrics, k, 0) or 0) for lo in m.loaders) for k in keys}


def loom_serve(plan_dir: str, local_dir: str, ready: Any, cmds: Any, answers: Any) -> None:
    """What `loom serve` runs: an embedded cluster (scheduler here, 2 workers) and an autoscaling Executor, with
    the Arrow allocator `loom serve` chooses for this process before pyarrow loads (`execution._arrow_pool`)."""
    n_workers = int(os.environ.get("LOOM_BENCH_WORKERS", "2"))
    if os.environ.get("LOOM_BENCH_TRACE_WORKERS"):  # diagnosis: this process traces its Python allocations too
        import tracemalloc

        tracemalloc.start(max(1, int(os.environ["LOOM_BENCH_TRACE_WORKERS"])))
    try:
        from loomdata.execution._arrow_pool import choose_before_import, serving_pool
    except ImportError:  # a tree from before session 12 (`PYTHONPATH=.../src`, for a before/after): it chose none
        pass
    else:
        choose_before_import(serving_pool(n_workers, None))
    from loomdata.execution import Autoscaling, Executor, ServeConfig, open_cluster

    if os.environ.get("LOOM_BENCH_TRACE_WORKERS"):  # diagnosis: the workers trace Python allocations (tracemalloc_top)
        os.environ["PYTHONTRACEMALLOC"] = str(max(1, int(os.environ["LOOM_BENCH_TRACE_WORKERS"])))

    with (
        open_cluster(n_workers=n_workers, local_directory=local_dir) as client,
        Executor(plan_dir, client, _serve_config(ServeConfig, Autoscaling)) as ex,
    ):
        ready.put(("serving", os.getpid()))
        while (cmd := cmds.get()) != "stop":
            if cmd == "metrics":
                m = ex.metrics()
                pids = client.run(os.getpid)  # the scheduler's worker info carries no pid (None)
                workers = {w: (v.get("id"), pids.get(w)) for w, v in client.scheduler_info()["workers"].items()}
                answers.put(
                    {
                        "loaders": sum(v.loaders for v in m.sources.values()),
                        "loader_memory_bytes": m.to_dict()["loader_memory_bytes"],
                        "loader_rss_bytes": m.to_dict()["loader_rss_bytes"],
                        "loader_reads": _loader_reads(m),
                        "autoscale_rounds": m.autoscale.rounds,
                        "autoscale_decisions": len(m.autoscale.decisions),
                        "worker_pids": [pid for _, pid in workers.values()],
                        "workers_inside": list(client.run(worker_inside).values()),
                        "serving_inside": process_inside(),
                    }
                )


# ---- orchestration --------------------------------------------------------------------------------


def _wait(q: Any, n: int, what: str, procs: list[Any], timeout_s: float = 1800.0) -> list[Any]:
    """`n` messages `what` from `q`, failing fast when a process died."""
    got: list[Any] = []
    end = time.monotonic() + timeout_s
    while len(got) < n:
        try:
            msg = q.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > end:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"waiting for {what}: a process failed (exit codes {dead}) or timed out") from None
            continue
        if msg[0] != what:
            raise RuntimeError(f"expected {what!r}, got {msg!r}")
        got.append(msg)
    return got


def measure_baseline(
    files: list[list[str]],
    ranks: int,
    passes: int,
    pre_buffer: bool,
    arrow_pool: str | None = None,
    workers: int = 2,
) -> dict[str, Any]:
    """Sum of PSS over R ranks and their DataLoader workers (`workers` a rank), at first coverage and warm.

    `arrow_pool`: Arrow's allocator in every baseline process (ARROW_DEFAULT_MEMORY_POOL), as loomdata's
    workers set it; None: pyarrow's default.
    """
    saved = os.environ.get("ARROW_DEFAULT_MEMORY_POOL")
    if arrow_pool is not None:
        os.environ["ARROW_DEFAULT_MEMORY_POOL"] = arrow_pool  # inherited by the spawned ranks and workers
    try:
        return _measure_baseline(files, ranks, passes, pre_buffer, workers)
    finally:
        os.environ.pop("ARROW_DEFAULT_MEMORY_POOL", None)
        if saved is not None:
            os.environ["ARROW_DEFAULT_MEMORY_POOL"] = saved


def _measure_baseline(
    files: list[list[str]], ranks: int, passes: int, pre_buffer: bool, workers: int
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=baseline_rank, args=(files, passes, pre_buffer, workers, ready, go, stop))
        for _ in range(ranks)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    out: dict[str, Any] = {}
    for phase, release in (("cover", go), ("warm", stop)):
        pids = [m[1] for m in _wait(ready, ranks, phase, procs)]
        per_rank = [tree_pss(pid) for pid in pids]
        out[phase] = {"total_mib": sum(per_rank) / MIB, "per_rank_mib": sum(per_rank) / ranks / MIB}
        release.set()
    for p in procs:
        p.join(timeout=60)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def measure_loom(plan_dir: Path, local_dir: Path, ranks: int, cover: int, warm: int) -> dict[str, Any]:
    """Sum of PSS over the serving process tree plus each rank's excess over an idle torch process."""
    ctx = mp.get_context("spawn")
    ready, cmds, answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    t0 = time.perf_counter()
    server = ctx.Process(target=loom_serve, args=(str(plan_dir), str(local_dir), ready, cmds, answers))
    server.start()
    serve_pid = _wait(ready, 1, "serving", [server], timeout_s=600)[0][1]
    procs = [ctx.Process(target=loom_rank, args=(str(plan_dir), r, cover, warm, ready, go, stop)) for r in range(ranks)]
    idle_ready = ctx.Queue()  # an idle torch process beside the ranks: it shares torch's pages with them as they do
    companion = ctx.Process(target=idle_torch, args=(idle_ready, stop))
    for p in [*procs, companion]:
        p.start()
    companion_pid = _wait(idle_ready, 1, "idle", [companion])[0][1]
    out: dict[str, Any] = {}
    try:
        for phase, release in (("cover", go), ("warm", stop)):
            pids = [m[1] for m in _wait(ready, ranks, phase, [server, *procs])]
            cmds.put("metrics")
            m = answers.get(timeout=120)
            rank_pss = [pss(pid) for pid in pids]
            rank_uss = [uss(pid) for pid in pids]
            parts: dict[str, float] = {"serving process (scheduler + executor)": 0.0, "dask workers": 0.0}
            parts["helpers (resource tracker)"] = 0.0
            fork_server: dict[str, float] = {}
            for pid, depth, name in tree(serve_pid):  # LocalCluster's nannies live in the serving process
                v = pss(pid) / MIB
                if name == "fork_server" and pid not in m["worker_pids"]:  # workers forked from it keep its command
                    # the workers' parent (counted with them): its PSS and private MiB
                    fork_server = {"pss_mib": round(v, 1), "private_mib": round(uss(pid) / MIB, 1)}
                key = (
                    "serving process (scheduler + executor)"
                    if depth == 0
                    else "dask workers"
                    if pid in m["worker_pids"] or name != "resource_tracker"
                    else "helpers (resource tracker)"
                )
                parts[key] += v
            # A rank's excess is its private memory above that of an idle torch process running beside the
            # ranks (measured at the same moment): torch's library pages are shared by all of them, so
            # neither counts them as private. (Against an idle process measured alone, whose torch pages
            # are all private, every rank's excess came out 0: sessions 2-3 under-counted the ranks.)
            idle_now = uss(companion_pid)
            parts["ranks above idle torch"] = sum(max(0, r - idle_now) for r in rank_uss) / MIB
            cluster = sum(v for k, v in parts.items() if k != "ranks above idle torch")
            out[phase] = {
                "total_mib": cluster + parts["ranks above idle torch"],
                "all_processes_mib": cluster + sum(rank_pss) / MIB,
                "per_rank_excess_mib": parts["ranks above idle torch"] / ranks,
                "idle_companion_private_mib": round(idle_now / MIB, 1),
                "rank_private_mib": [round(r / MIB, 1) for r in rank_uss],
                # where the first rank's and the idle process's anonymous memory is (the excess is mostly there)
                "rank0_anon_by_mapping_mib": _anon_by_mapping(pids[0]),
                "idle_anon_by_mapping_mib": _anon_by_mapping(companion_pid),
                "breakdown_mib": {k: round(v, 1) for k, v in parts.items()},
                "fork_server_mib": fork_server,  # empty: the workers were spawned
                "loader_memory_mib": round(m["loader_memory_bytes"] / MIB, 1),
                "loader_rss_mib": round(m["loader_rss_bytes"] / MIB, 1),
                "loaders": m["loaders"],
                "loader_reads": m["loader_reads"],
                # CPU seconds the workers (loaders, constructors) and the serving process spent up to now: what a
                # cache that holds less pays in decoding again, in the run whose memory is measured
                "workers_cpu_s": round(sum(_cpu_s(pid) for pid in m["worker_pids"]), 2),
                "serving_cpu_s": round(_cpu_s(serve_pid), 2),
                "autoscale_rounds": m["autoscale_rounds"],
                "autoscale_decisions": m["autoscale_decisions"],
                "workers_inside": m["workers_inside"],
                "serving_inside": m["serving_inside"],
            }
            release.set()
        for p in [*procs, companion]:
            p.join(timeout=60)
    finally:
        cmds.put("stop")
        server.join(timeout=120)
        for p in [*procs, companion, server]:
            if p.is_alive():
                p.kill()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def measure_idle() -> tuple[int, int]:
    """(PSS, private bytes) of an idle rank process (torch imported, nothing else)."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=idle_torch, args=(ready, stop))
    p.start()
    pid = _wait(ready, 1, "idle", [p])[0][1]
    time.sleep(0.5)
    v = pss(pid), uss(pid)
    stop.set()
    p.join(timeout=30)
    return v


def coverage_steps(plan_dir: Path, warm_docs: int) -> tuple[int, int, int]:
    """(first step by which every source was read once, first step by which each had `warm_docs`, steps)."""
    import numpy as np

    from loomdata.schemas import read_manifest, read_plan

    meta = read_plan(plan_dir)
    t = read_manifest(plan_dir, meta)
    src = t.column("source").to_numpy().astype(np.int64)
    step = t.column("step").to_numpy().astype(np.int64)
    n = len(meta.sources)
    counts = np.zeros((meta.steps, n), dtype=np.int64)
    np.add.at(counts, (step, src), 1)
    cum = np.cumsum(counts, axis=0)
    covered = np.flatnonzero((cum > 0).all(axis=1))
    warmed = np.flatnonzero((cum >= warm_docs).all(axis=1))
    cover = int(covered[0]) if len(covered) else meta.steps - 1
    warm = int(warmed[0]) if len(warmed) else meta.steps - 1
    return cover, max(warm, cover + 1), meta.steps


def ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b > 0 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=int, nargs="+", default=[10, 100, 300])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--docs", type=int, default=2000, help="documents per shard")
    ap.add_argument("--mean-len", type=float, default=200.0, help="mean tokens per document (lognormal)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--passes", type=int, default=8, help="baseline: row groups read per source per worker (warm)")
    ap.add_argument("--warm-docs", type=int, default=128, help="loomdata: documents per source read before warm")
    ap.add_argument("--quick", action="store_true", help="N 10, 100 and R 4")
    ap.add_argument("--loom-only", action="store_true", help="diagnosis: measure loomdata alone (no ratios)")
    ap.add_argument("--loader-memory", type=float, default=None, help="loomdata: loader cache MiB per worker")
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="loomdata: worker processes of the embedded cluster (0: one in the serving process)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--data", type=Path, default=None, help="keep data, index and plans in this folder, reused (default: temporary)"
    )
    args = ap.parse_args()
    if args.quick:
        args.sources, args.ranks = [10, 100], [4]
    os.environ["LOOM_BENCH_WORKERS"] = str(args.workers)  # inherited by the serving process
    if args.loader_memory is not None:
        os.environ["LOOM_BENCH_LOADER_MIB"] = str(args.loader_memory)  # inherited by the serving process

    from loomdata.execution import open_cluster
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan

    rows: list[dict[str, Any]] = []
    idle_pss, idle = measure_idle()
    print(f"idle torch process: {idle_pss / MIB:.0f} MiB PSS, {idle / MIB:.0f} MiB private", flush=True)
    header = (
        f"{'N':>4} {'R':>3} {'phase':>5} | {'pyarrow':>8} {'pre_buf=F':>9} | {'loomdata':>8} {'(ranks)':>8} | "
        f"{'x pyarrow':>9} {'x pb=F':>7} | like-for-like x pyarrow, x pb=F"
    )
    t_all = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.data is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="loom-bench-memory-"))
        else:
            args.data.mkdir(parents=True, exist_ok=True)
            tmp = str(args.data.resolve())
        os.environ["TMPDIR"] = tmp
        for n in args.sources:
            root = Path(tmp) / f"n{n}"
            t = time.perf_counter()
            files = write_data(root, n, args.shards, args.docs, args.mean_len, seed=n)
            per_step_docs = args.seq_len / (args.mean_len * math.exp(0.18))
            for r in args.ranks:
                steps = math.ceil(1.6 * n * args.warm_docs / (r * per_step_docs)) + 8
                spec = make_spec(root, n, r, steps, args.seq_len)
                if r == args.ranks[0]:  # one index per N: the ranks change only the plan
                    with open_cluster(n_workers=2, local_directory=root / "dask-index") as client:
                        build_index(spec, client)
                plan_dir = make_plan(spec).plan_dir
                cover, warm, total = coverage_steps(plan_dir, args.warm_docs)
                print(
                    f"N={n} R={r}: data, index and plan in {time.perf_counter() - t:.1f}s; {total} steps, "
                    f"first coverage at step {cover}, warm at step {warm}",
                    flush=True,
                )
                row: dict[str, Any] = {"sources": n, "ranks": r, "cover_step": cover, "warm_step": warm}
                if args.loom_only:
                    nan = {"total_mib": float("nan"), "per_rank_mib": float("nan")}
                    for k in (
                        "baseline_default",
                        "baseline_no_prebuffer",
                        "baseline_no_prebuffer_jemalloc",
                        "baseline_no_prebuffer_w0",
                    ):
                        row[k] = {"cover": nan, "warm": nan}
                else:
                    row["baseline_default"] = measure_baseline(files, r, args.passes, pre_buffer=True)
                    row["baseline_no_prebuffer"] = measure_baseline(files, r, args.passes, pre_buffer=False)
                    row["baseline_no_prebuffer_jemalloc"] = measure_baseline(
                        files, r, args.passes, pre_buffer=False, arrow_pool="jemalloc"
                    )
                    # the replicated pattern at its least memory: no DataLoader workers, the rank reads itself
                    row["baseline_no_prebuffer_w0"] = measure_baseline(
                        files, r, args.passes, pre_buffer=False, workers=0
                    )
                row["loomdata"] = measure_loom(plan_dir, root / f"dask-serve-{r}", r, cover, warm)
                for phase in ("cover", "warm"):
                    lo = row["loomdata"][phase]
                    bd, bn = (
                        row["baseline_default"][phase]["total_mib"],
                        row["baseline_no_prebuffer"][phase]["total_mib"],
                    )
                    lo["ratio_default"] = ratio(bd, lo["total_mib"])
                    lo["ratio_no_prebuffer"] = ratio(bn, lo["total_mib"])
                    bj = row["baseline_no_prebuffer_jemalloc"][phase]["total_mib"]
                    lo["ratio_no_prebuffer_jemalloc"] = ratio(bj, lo["total_mib"])
                    b0 = row["baseline_no_prebuffer_w0"][phase]["total_mib"]
                    lo["ratio_no_prebuffer_w0"] = ratio(b0, lo["total_mib"])
                    # like for like: every process of both sides counted whole (loomdata's ranks included)
                    lo["like_for_like_ratio_default"] = ratio(bd, lo["all_processes_mib"])
                    lo["like_for_like_ratio_no_prebuffer"] = ratio(bn, lo["all_processes_mib"])
                rows.append(row)
                print(header)
                for phase in ("cover", "warm"):
                    lo = row["loomdata"][phase]
                    print(
                        f"{n:>4} {r:>3} {phase:>5} | {row['baseline_default'][phase]['total_mib']:>8,.0f} "
                        f"{row['baseline_no_prebuffer'][phase]['total_mib']:>9,.0f} | {lo['total_mib']:>8,.0f} "
                        f"{lo['breakdown_mib']['ranks above idle torch']:>8,.0f} | {lo['ratio_default']:>9.2f} "
                        f"{lo['ratio_no_prebuffer']:>7.2f} | {lo['like_for_like_ratio_default']:.2f}, "
                        f"{lo['like_for_like_ratio_no_prebuffer']:.2f}"
                    )
                    print(
                        f"{'':>15} loomdata breakdown MiB {lo['breakdown_mib']}; loader index arrays "
                        f"{lo['loader_memory_mib']} MiB in {lo['loaders']} loaders; "
                        f"autoscale {lo['autoscale_decisions']} resizes in {lo['autoscale_rounds']} rounds",
                        flush=True,
                    )
                    print(
                        f"{'':>15} baseline pre_buffer=False with jemalloc: "
                        f"{row['baseline_no_prebuffer_jemalloc'][phase]['total_mib']:,.0f} MiB "
                        f"(x {lo['ratio_no_prebuffer_jemalloc']:.2f}); pre_buffer=False, num_workers=0: "
                        f"{row['baseline_no_prebuffer_w0'][phase]['total_mib']:,.0f} MiB "
                        f"(x {lo['ratio_no_prebuffer_w0']:.2f}); inside the workers: {lo['workers_inside']}",
                        flush=True,
                    )
    result = {
        "benchmark": "memory",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "parameters": {
            "shards": args.shards,
            "docs_per_shard": args.docs,
            "mean_len": args.mean_len,
            "row_group_rows": ROW_GROUP,
            "seq_len": args.seq_len,
            "baseline_passes": args.passes,
            "warm_docs_per_source": args.warm_docs,
            "dask_workers": args.workers,
            "baseline_num_workers": 2,
            "baseline_no_prebuffer_w0_num_workers": 0,
            "quick": args.quick,
            "loader_memory_mib": args.loader_memory,
        },
        "idle_torch_pss_mib": round(idle_pss / MIB, 1),
        "idle_torch_private_mib": round(idle / MIB, 1),
        "seconds": round(time.perf_counter() - t_all, 1),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {result['seconds']:.0f}s")


if __name__ == "__main__":
    main()
