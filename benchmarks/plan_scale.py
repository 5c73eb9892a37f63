"""How fast and how lean is planning at scale? Samples/s, peak RSS per indexed sample and time's slope in steps.

Two parts, every run its own subprocess (so `ru_maxrss` is that run's peak):

- sweep: for dp in --dps and sources in --sources, plan one epoch of several index sizes (--sweep,
  samples; steps = index tokens / step capacity, dp x 4 micro-batches x 4,096 tokens) and fit the slope
  of log(seconds) over log(steps): 1.0 is linear in steps, 2.0 quadratic. Sources are synthetic
  (log-normal lengths: "web" mu 6.2 sigma 1.1 for 80% of the samples, "code" mu 6.8 sigma 1.2 for 20%;
  with many sources, alternating web and code sources share those samples).
- memory: dp 1024, 2 sources, --sizes samples, side by side with the naive planner a user writes today
  (one shuffle of all samples, concatenated and cut into sequences, dealt round-robin, one manifest file).
- cluster (--workers 1 2): --dist-sizes samples at --dist-dp, 2 sources, planned in one process and on an
  embedded LocalCluster of N workers (its start not timed): the serial part (index reading, membership),
  the balancing part, the scatter of the work to the workers, the speedup, and a projection to 1B
  samples on N workers from the measured per-sample rates (writes results/plan_scale_cluster.json alone).

Index tables are written to a workdir first (samples.parquet + shards.parquet, as `loom index` leaves
them) and the planning process reads them itself, so peak RSS above the post-import baseline is what
planning costs per indexed sample (the interpreter and libraries take ~115 MB, printed as raw B/s).
Goals: >= 2M samples/s on one core, slope ~1.0, <= 32 bytes of peak RSS per sample at 10M+ samples.
Writes benchmarks/results/plan_scale.json (--quick: plan_scale_quick.json).

    .venv/bin/python benchmarks/plan_scale.py                 # sweep dp {4,8,64,1024} x {1,300} sources + 1M/10M
    .venv/bin/python benchmarks/plan_scale.py --quick         # smaller sweep, 1M only (about a minute)
    .venv/bin/python benchmarks/plan_scale.py --sweep 0 --sizes 1e6 1e7 5e7   # memory only
    .venv/bin/python benchmarks/plan_scale.py --workers 1 2 --dist-sizes 5e6  # 1 vs 2 workers (cluster part)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from _synthetic import index_table

RESULTS = Path(__file__).resolve().parent / "results" / "plan_scale.json"
MICRO_BATCHES, SEQ_LEN = 4, 4096
KINDS = [(0.8, 6.2, 1.1), (0.2, 6.8, 1.2)]  # web, code: share of samples, log-normal mu, sigma
GOAL_RATE = 2_000_000
GOAL_BYTES = 32


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def source_sizes(samples: int, n_sources: int) -> list[tuple[str, int, float, float]]:
    """(name, samples, mu, sigma) of each source: web and code kinds alternating, sharing 80% / 20%."""
    if n_sources == 1:
        return [("web", samples, KINDS[0][1], KINDS[0][2])]
    out = []
    per_kind = [(n_sources + 1) // 2, n_sources // 2]
    for k in range(n_sources):
        share, mu, sigma = KINDS[k % 2]
        out.append(
            (f"{'web' if k % 2 == 0 else 'code'}{k:03d}", max(1, int(samples * share / per_kind[k % 2])), mu, sigma)
        )
    return out


def write_index(samples: int, n_sources: int, workdir: Path, seed: int = 0) -> dict[str, Any]:
    """Write synthetic index tables under workdir/index/<source>/; return names, steps per dp, weights."""
    from loomdata.schemas.layout import IndexFiles
    from loomdata.schemas.tables import TableKind, synthetic_shards, write_table

    tokens = {}
    for k, (name, n, mu, sigma) in enumerate(source_sizes(samples, n_sources)):
        rng = np.random.default_rng([seed, k])
        lengths = np.empty(n, dtype=np.uint32)
        for a in range(0, n, 1 << 20):
            b = min(n, a + (1 << 20))
            lengths[a:b] = np.clip(rng.lognormal(mu, sigma, b - a), 16, 100_000)
        files = IndexFiles.of(workdir, name)
        files.root.mkdir(parents=True, exist_ok=True)
        write_table(index_table(lengths), files.samples, TableKind.INDEX, {"fingerprint": f"syn-{samples}-{name}"})
        shards = synthetic_shards(n)
        write_table(shards, files.shards, TableKind.SHARDS)
        tokens[name] = int(lengths.sum(dtype=np.int64))
    total = sum(tokens.values())
    return {"tokens": total, "weights": {n: v / total for n, v in tokens.items()}}


def _steps(tokens: int, dp: int) -> int:
    return max(1, tokens // (dp * MICRO_BATCHES * SEQ_LEN) - 1)


def thread_chain(cpu: list[float], threads: int) -> float:
    """When the last of `cpu`'s calls ends when they run in order on `threads` threads of idle cores (each call
    taken by the first thread free, as a ThreadPoolExecutor's map hands them out)."""
    free = [0.0] * max(1, min(threads, len(cpu)))
    for c in cpu:
        i = free.index(min(free))
        free[i] += c
    return max(free, default=0.0)


def child_loom(workdir: Path, dp: int, workers: int = 1) -> dict[str, Any]:
    """Plan the index in workdir at dp; with workers > 1 on an embedded LocalCluster of that many processes
    (its start not timed), timing the serial part (index reading and membership) and the balancing apart."""
    from loomdata.planning import _distributed, _plan, _threads, make_plan
    from loomdata.schemas import parse_spec

    base = _rss_mb()
    marks: dict[str, float] = {}
    if os.environ.get("LOOM_BENCH_SPECULATE") == "1" and hasattr(_plan, "SPECULATE"):
        _plan.SPECULATE = True  # speculate even where the workers fill this host's cores (the idle-core model)

    part_cpu: list[float] = []  # CPU seconds of each range on its worker (RangePart.cpu_seconds)
    part_worker: list[str] = []  # where each ran (RangePart.worker; "" before it was recorded)
    part_span: list[tuple[float, float, float]] = []  # each range's (began, ended) on its worker, stitched here
    part_stop: list[int] = []  # each range's stop step
    early: dict[str, float] = {}  # a Speculation's `through` and its finish's CPU (the whole look-ahead, here)

    def timed(fn: Any, name: str) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            marks.setdefault(f"{name}_start", time.perf_counter())
            marks.setdefault(f"{name}_start_cpu", time.process_time())
            marks.setdefault(f"{name}_start_wall", time.time())
            if name == "ranges":  # collect each range's CPU time as it is stitched
                take = a[5]
                a = (
                    *a[:5],
                    lambda part: (
                        part_cpu.append(part.cpu_seconds),
                        part_worker.append(getattr(part, "worker", "")),
                        part_span.append((*getattr(part, "span", (0.0, 0.0)), time.time())),
                        part_stop.append(part.stop),
                        take(part),
                    ),
                )
                spec = a[1]
                if type(spec).__name__ == "Speculation":  # the whole look-ahead, worked out while ranges run
                    finish = spec.finish

                    def timed_finish(*args: Any, spec: Any = spec, **kwargs: Any) -> Any:
                        c = time.process_time()
                        whole = None
                        try:
                            whole = finish(*args, **kwargs)  # (an allocator, from a planner that passes one)
                            return whole
                        finally:
                            early["finish_cpu_seconds"] = time.process_time() - c
                            early["finished_wall"] = time.time()
                            if whole is not None:  # (after the timing) whether plan_ranges keeps the first ranges
                                mine, full = spec.work.assignment, whole.assignment
                                agreed = mine is not None and full is not None and mine.agrees(full, spec.through)
                                early["agreed"] = float(agreed)

                    early["through"] = spec.through
                    a = (a[0], dataclasses.replace(spec, finish=timed_finish), *a[2:])
            out = fn(*a, **kw)
            marks[f"{name}_end"] = time.perf_counter()
            marks[f"{name}_end_cpu"] = time.process_time()
            return out

        return run

    phases: dict[str, dict[str, float]] = {}  # wall and CPU seconds summed over each phase's calls
    calls: dict[str, list[float]] = {}  # each call's CPU seconds, by phase (the per-source phases' threads)
    on_threads: set[str] = set()  # the phases whose calls ran on planning's threads (large sources only)

    # a call's own parts on threads (planning._threads.parallel: one large source's stream in parts): per calling
    # thread, the parts' summed CPU and, summed over each batch of parts, the longest part's (on idle cores a batch
    # takes its longest part)
    parts_cpu: dict[int, list[float]] = {}
    beyond: dict[str, float] = {}  # by phase: the parts' CPU beyond their batches' longest (overlapped on idle cores)
    if hasattr(_threads, "parallel"):
        parallel = _threads.parallel

        def timed_parallel(tasks: list[Any]) -> list[Any]:
            cpu = [0.0] * len(tasks)

            def timed_task(i: int, task: Any) -> Any:
                c = time.thread_time()
                try:
                    return task()
                finally:
                    cpu[i] = time.thread_time() - c

            out = parallel([functools.partial(timed_task, i, t) for i, t in enumerate(tasks)])
            acc = parts_cpu.setdefault(threading.get_ident(), [0.0, 0.0])
            acc[0] += sum(cpu)
            acc[1] += max(cpu, default=0.0)
            return out

        _threads.parallel = timed_parallel

    def summed(mod: Any, attr: str, name: str, clock: Any = time.process_time) -> None:
        """Sum wall and CPU seconds of every call of mod.attr under `name` (calls on several threads: pass
        time.thread_time, the calling thread's own CPU, to which a call's own parts on threads add their longest
        per batch; their wall seconds add up beyond the phase's)."""
        fn = getattr(mod, attr)

        def run(*a: Any, **kw: Any) -> Any:
            t, c = time.perf_counter(), clock()
            parts_cpu.pop(threading.get_ident(), None)
            try:
                return fn(*a, **kw)
            finally:
                own = clock() - c
                if clock is time.thread_time:
                    part_sum, part_max = parts_cpu.pop(threading.get_ident(), [0.0, 0.0])
                    own += part_max
                    beyond[name] = beyond.get(name, 0.0) + part_sum - part_max
                ph = phases.setdefault(name, {"seconds": 0.0, "cpu_seconds": 0.0, "calls": 0})
                ph["seconds"] += time.perf_counter() - t
                ph["cpu_seconds"] += own
                ph["calls"] += 1
                calls.setdefault(name, []).append(own)
                if threading.current_thread() is not threading.main_thread():
                    on_threads.add(name)  # planning._threads.per_source put this phase's calls on threads

        setattr(mod, attr, run)

    summed(_plan, "build_stream", "streams", time.thread_time)  # one call a source, on planning's threads
    summed(_plan, "_read_source", "index_reads", time.thread_time)  # one call a source, on planning's threads
    for attr, name in (
        ("_load_index", "index"),
        ("membership", "membership"),
        ("_shuffle_figures", "shuffle_figures"),
        ("assign_steps", "lookahead"),
        ("window_membership", "membership"),  # planning.draw_window (LOOM_BENCH_DRAW_WINDOW)
    ):
        if hasattr(_plan, attr):
            summed(_plan, attr, name)
    summed(_distributed, "window", "windows")  # cutting each range's window (driver)
    summed(_distributed, "fix_up", "fix_ups")  # re-balancing a range's head with the true carry (driver)
    summed(_distributed, "plan_range", "driver_ranges")  # a range refused speculatively, planned here
    _plan._balance_into = timed(_plan._balance_into, "balance")  # type: ignore[attr-defined]
    _plan.plan_ranges = timed(_distributed.plan_ranges, "ranges")  # type: ignore[attr-defined]
    info = json.loads((workdir / "index-info.json").read_text())
    steps = _steps(info["tokens"], dp)
    spec = parse_spec(
        {
            "name": "scale",
            "workdir": str(workdir),
            "sources": [{"name": n, "format": "parquet", "paths": ["x"], "tokens_field": "t"} for n in info["weights"]],
            "mixture": {"weights": info["weights"]},
            "training": {"seq_len": SEQ_LEN, "steps": steps, "dp_size": dp, "micro_batches": MICRO_BATCHES},
            **({"planning": {"draw_window": int(os.environ["LOOM_BENCH_DRAW_WINDOW"])}} if _window() else {}),
        },
        workdir,
        check_paths=False,
    )
    shutil.rmtree(spec.plans_dir, ignore_errors=True)  # an earlier run's plan of the same id would be reused
    started = 0.0
    with contextlib.ExitStack() as stack:
        client = None
        if workers > 1:
            from loomdata.execution import open_cluster

            t_start = time.perf_counter()
            client = stack.enter_context(open_cluster(n_workers=workers))
            client.run(importlib.import_module, "loomdata.planning._ranges")  # warm: imports done once per worker
            started = time.perf_counter() - t_start
            sent: list[float] = []
            scatter = client.scatter

            def timed_scatter(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                out = scatter(*a, **kw)
                sent.append(time.perf_counter() - t)
                return out

            client.scatter = timed_scatter  # type: ignore[method-assign]
        load_before = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        res = make_plan(spec, client=client)
        secs, plan_cpu = time.perf_counter() - t0, time.process_time() - c0
        load_after = os.getloadavg()[0]
        warmed: dict[str, float | None] = {}  # each worker's warming CPU (planning._warm; none from a tree without)
        if client is not None and importlib.util.find_spec("loomdata.planning._warm") is not None:
            from loomdata.planning import _warm

            warmed = client.run(_warm.warm_seconds)
    imb = res.meta.summary["imbalance"]
    first = min(marks.get("balance_start", math.inf), marks.get("ranges_start", math.inf))
    first_cpu = min(marks.get("balance_start_cpu", math.inf), marks.get("ranges_start_cpu", math.inf))
    if workers > 1 and "ranges_start" in marks:
        # on a cluster the serial part runs until the ranges are sent: the head's balancing here (a fresh plan: no
        # steps) comes before the range cuts and a Speculation's prefix look-ahead, which are serial too (until
        # session 32 they were counted nowhere: 0.4-1.4 CPU-s missing from the critical path at 50M)
        first, first_cpu = marks["ranges_start"], marks["ranges_start_cpu"]
    parallel = max(marks.get("balance_end", 0.0), marks.get("ranges_end", 0.0)) - first
    threads = _threads.plan_threads()
    serial_chain = first_cpu - c0
    for name in ("index_reads", "streams"):  # (a call's parts on threads: the longest of each batch, the rest out)
        serial_chain += (
            thread_chain(calls.get(name, []), threads if name in on_threads else 1)
            - sum(calls.get(name, []))
            - beyond.get(name, 0.0)
        )
    per_worker: dict[str, float] = {}
    per_worker_early: dict[str, float] = {}  # each worker's CPU on the ranges balanced on a prefix's look-ahead
    t_ranges = marks.get("ranges_start_wall", 0.0)
    driver_cpu = 0.0
    if workers > 1:  # the ranges' CPU on the workers (the driver waits), plus the driver's own (fix-ups, merging)
        driver_cpu = marks["ranges_end_cpu"] - marks["ranges_start_cpu"]  # cutting and sending windows, stitching
        balance_cpu = sum(part_cpu) + driver_cpu
        for w, c, stop in zip(part_worker, part_cpu, part_stop, strict=True):
            per_worker[w or "?"] = per_worker.get(w or "?", 0.0) + c
            if stop <= early.get("through", -1):
                per_worker_early[w or "?"] = per_worker_early.get(w or "?", 0.0) + c
    else:
        balance_cpu = marks["balance_end_cpu"] - marks["balance_start_cpu"]
    # the critical path of the ranges on idle cores: each worker balances its first ranges (those on a prefix's
    # look-ahead, if any) while the driver works out the whole look-ahead (finish), then the rest; the driver's
    # other range work (sharing, stitching, fix-ups) counted as if it overlapped nothing. Without a Speculation:
    # the driver's range work plus the busiest worker's ranges, as before.
    # Where the two look-aheads disagree, the first ranges are balanced again after the whole look-ahead (their
    # first runs overlapped it, wasted): each worker's path is then finish + its ranges (the reruns included).
    finish_cpu = early.get("finish_cpu_seconds", 0.0)
    agreed = bool(early.get("agreed", 1.0))
    ranges_path = (driver_cpu - finish_cpu) + max(
        (
            (max(per_worker_early.get(w, 0.0), finish_cpu) + c - per_worker_early.get(w, 0.0))
            if agreed
            else finish_cpu + c
            for w, c in per_worker.items()
        ),
        default=balance_cpu,
    )
    return {
        "steps": steps,
        "workers": workers,
        "seconds": secs,
        "serial_seconds": first - t0,  # index reading, membership, shuffle figures
        "balance_seconds": parallel,  # balancing and writing (on the workers when workers > 1)
        "plan_cpu_seconds": plan_cpu,  # all of make_plan in this process (its last partition, report, summary too)
        "serial_cpu_seconds": first_cpu - c0,
        "balance_cpu_seconds": balance_cpu,  # summed over the workers
        "ranges": len(part_cpu),
        "scatter_seconds": sum(sent) if workers > 1 else 0.0,  # all scatters (one per range's window)
        "scatters": len(sent) if workers > 1 else 0,
        "driver_cpu_seconds": driver_cpu,  # the driver's CPU while the ranges ran (windows, sending, stitching)
        "worker_cpu_seconds": per_worker,  # each worker's summed range CPU
        # CPU on the critical path on idle cores: serial part, the driver's range work (as if it overlapped
        # nothing), the busiest worker's ranges
        "critical_cpu_seconds": first_cpu - c0 + ranges_path,
        # the serial part with its per-source phases (index reads, streams; planning._threads) on their threads as
        # on idle cores: the process's CPU less those calls' summed thread CPU plus each phase's longest thread
        "serial_chain_cpu_seconds": serial_chain,
        "prefix_in_serial": True,  # the serial part includes a Speculation's prefix look-ahead (session 32 on)
        "critical_chain_cpu_seconds": serial_chain + ranges_path,
        "early_through": early.get("through"),  # the first ranges' last step + 1 (a Speculation; else None)
        "early_agreed": agreed if "through" in early else None,  # the first ranges kept (else balanced again)
        "early_finish_cpu_seconds": finish_cpu,  # the whole look-ahead's CPU, worked out while the first ranges ran
        "early_finished_after_s": early.get("finished_wall", t_ranges) - t_ranges if early else None,
        "worker_early_cpu_seconds": per_worker_early,
        # each worker's CPU warming itself while the serial part ran (not in its ranges' CPU; None: not warmed)
        "worker_warm_cpu_seconds": warmed,
        "per_source_call_cpu_seconds": calls,
        "cluster_start_seconds": started,  # LocalCluster start and imports, not timed
        "phases": phases,  # the driver's phases (serial ones, then windows/fix-ups while the ranges run)
        # per range in step order: worker, began and ended balancing there, stitched here (seconds from the
        # first range's submission; zeros from a planner that does not record them)
        "range_timeline": [
            {"worker": w, "began": b - t_ranges, "ended": e - t_ranges, "stitched": s - t_ranges}
            for w, (b, e, s) in zip(part_worker, part_span, strict=True)
        ]
        if part_span
        else [],
        "load_1min": [load_before, load_after],  # the machine's 1-minute load average as the plan began and ended
        "rss_base_mb": base,
        "rss_peak_mb": _rss_mb(),
        "manifest_rows": sum(f.rows for f in res.meta.manifest),
        "files": len(res.meta.manifest),
        "imbalance_mean": imb["loomdata"]["mean"],
        "baseline_imbalance_mean": imb["baseline"]["mean"],
    }


def child_naive(workdir: Path, dp: int) -> dict[str, Any]:
    from loomdata.schemas.layout import read_index
    from loomdata.schemas.tables import MANIFEST_SCHEMA, TableKind, write_table

    base = _rss_mb()
    info = json.loads((workdir / "index-info.json").read_text())
    steps = _steps(info["tokens"], dp)
    t0 = time.perf_counter()
    index = {n: read_index(workdir, n, columns=["sample", "num_tokens"])[0] for n in info["weights"]}
    src = np.concatenate([np.full(t.num_rows, k, dtype=np.uint16) for k, t in enumerate(index.values())])
    sample = np.concatenate([t["sample"].to_numpy() for t in index.values()])
    length = np.concatenate([t["num_tokens"].to_numpy() for t in index.values()])
    del index
    perm = np.random.default_rng(0).permutation(len(src))
    src, sample, length = src[perm], sample[perm], length[perm]
    del perm
    start = np.cumsum(length, dtype=np.int64) - length
    seq = start // SEQ_LEN
    del start
    slots = dp * MICRO_BATCHES
    step = seq // slots
    keep = step < steps
    slot = seq[keep] % slots
    table = pa.Table.from_arrays(
        [
            pa.array(step[keep].astype(np.uint32)),
            pa.array((slot % dp).astype(np.uint32)),
            pa.array((slot // dp).astype(np.uint32)),
            pa.array(src[keep]),
            pa.array(sample[keep]),
            pa.array(np.zeros(int(keep.sum()), dtype=np.uint32)),
            pa.array(length[keep]),
            pa.array(np.zeros(int(keep.sum()), dtype=np.uint8)),
        ],
        schema=MANIFEST_SCHEMA,
    )
    write_table(table, workdir / "naive-manifest.parquet", TableKind.MANIFEST, row_group_size=1 << 17)
    secs = time.perf_counter() - t0
    return {
        "steps": steps,
        "seconds": secs,
        "rss_base_mb": base,
        "rss_peak_mb": _rss_mb(),
        "manifest_rows": table.num_rows,
    }


def _call(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True)
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return r


def _window() -> int:
    """planning.draw_window of the plans (environment LOOM_BENCH_DRAW_WINDOW; unset or 0: the default)."""
    return int(os.environ.get("LOOM_BENCH_DRAW_WINDOW", "0") or 0)


def run(kind: str, samples: int, n_sources: int, dp: int, workdir: Path, workers: int = 1) -> dict[str, Any]:
    """Plan (loom or naive) the index in workdir (written first if missing); figures per indexed sample."""
    if not (workdir / "index-info.json").exists():
        _call("--child", "index", "--samples", str(samples), "--n-sources", str(n_sources), "--workdir", str(workdir))
    r = _call("--child", kind, "--dp", str(dp), "--workdir", str(workdir), "--workers", str(workers))
    r.update(samples=samples, sources=n_sources, dp=dp)
    r["samples_per_s"] = samples / r["seconds"]
    r["bytes_per_sample_raw"] = r["rss_peak_mb"] * 2**20 / samples
    r["bytes_per_sample"] = (r["rss_peak_mb"] - r["rss_base_mb"]) * 2**20 / samples
    return r


def slope(runs: list[dict[str, Any]]) -> float:
    """Least-squares slope of log(seconds) over log(steps)."""
    if len(runs) < 2:
        return math.nan
    x = np.log([r["steps"] for r in runs])
    y = np.log([r["seconds"] for r in runs])
    return float(np.polyfit(x, y, 1)[0])


def _row(r: dict[str, Any], name: str = "loomdata", extra: str = "") -> str:
    return (
        f"{r['dp']:>6}{r['sources']:>5}{r['samples']:>12,}{r['steps']:>8}{name:>9}{r['seconds']:>9.2f}"
        f"{r['samples_per_s']:>12,.0f}{r['rss_peak_mb']:>9.0f}{r['bytes_per_sample']:>9.1f}"
        f"{r['bytes_per_sample_raw']:>8.1f}  {extra}"
    )


def cluster_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Plan each --dist-sizes index (2 sources, --dist-dp) on each of --workers workers; speedup over 1.

    Wall-clock speedups need idle cores; on a loaded machine the CPU figures say more: `cpu_bound_seconds` is
    serial CPU + scatter + the workers' summed balancing CPU / workers (what an idle machine with a core per
    worker would take), `cpu_bound_speedup` the one-process CPU total over it; `critical_cpu_seconds` is the
    serial CPU + the driver's CPU during the ranges + the busiest worker's range CPU (per worker, measured),
    `critical_speedup` the one-process CPU total over it."""
    out = []
    print(f"cluster part: dp {args.dist_dp}, 2 sources, workers {args.workers}", flush=True)
    for n in [int(s) for s in args.dist_sizes]:
        with tempfile.TemporaryDirectory(prefix="loom-scale-") as d:
            runs = [run("loom", n, 2, args.dist_dp, Path(d), w) for w in args.workers]
        one = next((r for r in runs if r["workers"] == 1), runs[0])
        one_cpu = one["serial_cpu_seconds"] + one["balance_cpu_seconds"]
        for r in runs:
            w = r["workers"]
            r["speedup"] = one["seconds"] / r["seconds"]
            r["cpu_bound_seconds"] = r["serial_cpu_seconds"] + r["scatter_seconds"] + r["balance_cpu_seconds"] / w
            r["cpu_bound_speedup"] = one_cpu / r["cpu_bound_seconds"]
            r["critical_speedup"] = one_cpu / r["critical_cpu_seconds"]
            per_worker = sorted(round(c, 1) for c in r["worker_cpu_seconds"].values())
            extra = (
                f"{w} worker(s), {r['ranges']} ranges: wall {r['seconds']:.1f}s = serial {r['serial_seconds']:.1f}s"
                f" + balancing {r['balance_seconds']:.1f}s (scatter {r['scatter_seconds']:.2f}s; cluster start"
                f" {r['cluster_start_seconds']:.1f}s not counted), speedup {r['speedup']:.2f}x; CPU: serial"
                f" {r['serial_cpu_seconds']:.1f}s, balancing {r['balance_cpu_seconds']:.1f}s summed, CPU-bound"
                f" {r['cpu_bound_seconds']:.1f}s, speedup {r['cpu_bound_speedup']:.2f}x; critical path: driver"
                f" {r['driver_cpu_seconds']:.1f}s, workers {per_worker}"
                f" -> {r['critical_cpu_seconds']:.1f}s CPU, {r['critical_speedup']:.2f}x on idle cores"
            )
            print(_row(r, extra=extra), flush=True)
        multi = [r for r in runs if r["workers"] > 1]
        out.append({"samples": n, "runs": runs, "projection_1b": project(one, multi[0] if multi else one)})
        print(f"  projection to 1B samples: {json.dumps(out[-1]['projection_1b'])}", flush=True)
    return out


def project(one: dict[str, Any], multi: dict[str, Any], samples: float = 1e9) -> dict[str, float]:
    """CPU-bound seconds to plan `samples` on N workers (a core each) from the measured per-sample rates: the
    serial part (one process); the driver's range work (cutting each range's window and sending it: every
    position goes to one worker once, so it does not grow with N; with a broadcast of the whole work, runs
    without per-worker figures, it is counted as 1 + ceil(log2 N) copy rounds); and the workers' balancing CPU
    (which includes its overhead over one process: `work_efficiency`) shared by N workers."""
    scale = samples / one["samples"]
    per = samples / multi["samples"]
    serial = one["serial_cpu_seconds"] * scale
    windows = bool(multi.get("worker_cpu_seconds"))
    driver = max(multi.get("driver_cpu_seconds", 0.0), multi["scatter_seconds"]) * per
    rounds = 1 + math.ceil(math.log2(max(multi["workers"], 1)))
    per_round = multi["scatter_seconds"] / rounds * per
    balance = (multi["balance_cpu_seconds"] - multi.get("driver_cpu_seconds", 0.0)) * per
    out = {
        "serial_s": serial,
        "driver_s": driver if windows else per_round,
        "balance_1_process_s": one["balance_cpu_seconds"] * scale,
        "work_efficiency": one["balance_cpu_seconds"] / max(multi["balance_cpu_seconds"], 1e-9),
        "workers_1_s": serial + one["balance_cpu_seconds"] * scale,
    }
    for w in (2, 8, 32, 128):
        send = driver if windows else per_round * (1 + math.ceil(math.log2(w)))
        out[f"workers_{w}_s"] = serial + send + balance / w
    return out


def profile(samples: int, n_sources: int, dp: int, top: int = 30) -> int:
    """Plan one index in this process under cProfile and print the top functions by own and cumulative time."""
    import cProfile
    import pstats

    with tempfile.TemporaryDirectory(prefix="loom-scale-") as d:
        _call("--child", "index", "--samples", str(samples), "--n-sources", str(n_sources), "--workdir", d)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(child_loom, Path(d), dp)
        secs = time.perf_counter() - t0
    print(f"{samples:,} samples, {n_sources} source(s), dp {dp}: {secs:.2f} s under the profiler")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sweep and 1M samples only")
    ap.add_argument("--sweep", nargs="+", type=float, help="index sizes (samples) of the sweep; 0: no sweep")
    ap.add_argument("--dps", nargs="+", type=int, default=[4, 8, 64, 1024])
    ap.add_argument("--sources", nargs="+", type=int, default=[1, 300])
    ap.add_argument("--sizes", nargs="+", type=float, help="sizes (samples) of the memory part, dp 1024, 2 sources")
    ap.add_argument("--workers", nargs="+", type=int, default=[], help="cluster part: plan on 1 and N workers")
    ap.add_argument("--dist-sizes", nargs="+", type=float, default=[5e6], help="samples of the cluster part")
    ap.add_argument("--dist-dp", type=int, default=64, help="dp of the cluster part (2 sources)")
    ap.add_argument(
        "--profile", type=float, metavar="SAMPLES", help="cProfile one plan of SAMPLES samples (--dps[0], --sources[0])"
    )
    ap.add_argument("--out", type=Path, help="results JSON (default: results/plan_scale*.json by part)")
    ap.add_argument("--child", choices=["index", "loom", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--n-sources", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dp", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "index":
        info = write_index(args.samples, args.n_sources, args.workdir)
        (args.workdir / "index-info.json").write_text(json.dumps(info))
        print(json.dumps({"tokens": info["tokens"]}))
        return 0
    if args.child:
        r = (
            child_loom(args.workdir, args.dp, (args.workers or [1])[0])
            if args.child == "loom"
            else child_naive(args.workdir, args.dp)
        )
        print(json.dumps(r))
        return 0
    if args.profile:
        return profile(int(args.profile), args.sources[0], args.dps[0])
    only_cluster = bool(args.workers) and args.sweep is None and args.sizes is None  # --workers alone: that part
    sweep = [0.0] if only_cluster else args.sweep or ([1e5, 2e5, 4e5] if args.quick else [2.5e5, 5e5, 1e6])
    sweep = [int(s) for s in sweep if s > 0]
    sizes = [] if only_cluster else [int(s) for s in (args.sizes or ([1e6] if args.quick else [1e6, 1e7]))]
    head = f"{'dp':>6}{'src':>5}{'samples':>12}{'steps':>8}{'planner':>9}{'seconds':>9}{'samples/s':>12}"
    print(f"{head}{'peak MB':>9}{'B/sample':>9}{'raw B/s':>8}", flush=True)
    out: dict[str, Any] = {"goal": {"samples_per_s": GOAL_RATE, "bytes_per_sample": GOAL_BYTES, "slope": 1.0}}
    out["sweep"] = []
    for n_src in args.sources if sweep else []:
        with tempfile.TemporaryDirectory(prefix="loom-scale-") as d:
            dirs = {n: Path(d) / f"n{n}" for n in sweep}
            for dp in args.dps:
                runs = []
                for n in sweep:
                    dirs[n].mkdir(exist_ok=True)
                    runs.append(run("loom", n, n_src, dp, dirs[n]))
                    print(_row(runs[-1]), flush=True)
                s = slope(runs)
                print(f"{'':>6}{'':>5}  slope of log(time) over log(steps): {s:.2f}", flush=True)
                out["sweep"].append({"dp": dp, "sources": n_src, "slope": s, "runs": runs})
    out["memory"] = []
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="loom-scale-") as d:
            loom = run("loom", n, 2, 1024, Path(d))
            naive = run("naive", n, 2, 1024, Path(d))
        print(_row(loom, extra=f"{loom['seconds'] / naive['seconds']:.2f}x naive's time"), flush=True)
        print(_row(naive, "naive"), flush=True)
        out["memory"].append({"loomdata": loom, "naive": naive, "time_ratio": loom["seconds"] / naive["seconds"]})
    out["cluster"] = cluster_part(args) if args.workers else []
    results = RESULTS.with_name("plan_scale_quick.json") if args.quick else RESULTS
    if only_cluster:
        results = RESULTS.with_name("plan_scale_cluster.json")
    results = args.out or results
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
