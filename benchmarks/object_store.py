"""Delivery from object storage: the same corpus on local disk and on an S3-protocol server, with latency.

One pre-tokenized Parquet source (row groups of 256 documents) is written locally and uploaded to
moto's S3 server on loopback (`moto[server]`, a test dependency), in a process of its own (`--store-in-process`:
beside the scheduler, as until session 17). A loopback proxy (`_latency_proxy.py`)
in front of the server adds 0, 20 or 100 ms to every request and counts requests and bytes. For the
shuffles `global` and `block` (blocks of one row group or `--block-size` documents, `--block-window` of them shuffled
together),
loomdata indexes and plans once (local and S3), then a fresh embedded cluster serves each plan (local
disk; S3 at each latency; with prefetch off at 100 ms too) to `--consumers` rank processes that read
every step:

- delivered tokens/s per consumer, consumer wait per step (time blocked in the iterator / steps; with
  `--step-ms`, each consumer also spends that long per batch, as a training step would, so the wait is
  what the serving window did not hide), the spread of the waits (p50/p99/max, seconds in waits > 50 ms),
- requests per step and bytes fetched per byte delivered (the proxy's counts over the run),
- side by side, Mosaic Streaming reading the same documents converted to MDS from the same server
  through the same proxy (a DataLoader(num_workers=2) per consumer; its shuffle on). Mosaic runs in the
  peers' own venv (`make peers-venv`, never a loomdata dependency); without it the Mosaic rows are skipped.

Goal (issue 9): at 100 ms, consumer wait per step within 10% of the local-disk run with `block` shuffle,
and at least 2x Mosaic's delivered tokens/s per consumer. The two halves need different consumers:

- the latency goal is about a rank that trains ("a rank never waits on storage latency when the window covers
  it"): `--step-ms 1.5 50` adds passes whose consumers spend that long per batch. 1.5 ms uses about half of local
  serving capacity on this machine (flat out, a consumer takes 5.3M tokens/s, 1,300 steps of 4,096 tokens a second,
  0.77 ms a step; session 7), so serving still has to keep up; 50 ms is a small model's step (about 100M parameters,
  4,096 tokens per rank, on one accelerator). Read flat out (`0`), a rank's wait is bound by serving throughput, which
  is CPU on this 2-core machine shared with the S3 server, not storage latency. The goal per round is
  `WAIT_REL` or `WAIT_FLOOR_MS` (within 10% of the local run's wait per step after the first, or within 0.05 ms:
  where both waits are near zero their ratio is noise), reported as `wait_excess_ms_vs_local` and `wait_goal_met`;
- the throughput goal compares flat-out consumers (Mosaic's rows always read flat out). Besides the raw tokens/s,
  each run records the CPU of the serving workers and the consumers (`workers_cpu_s`, `consumers_cpu_s`; Mosaic's
  ranks with their DataLoader workers) and `tokens_per_serving_cpu_s`, which leaves out the benchmark process
  (the scheduler, and for S3 the moto server and the proxy: `bench_process_cpu_s`), a CPU a real store does not
  take from the training machine. A CPU-corrected comparison, stated as such, next to the raw one.

Each run writes its own file, benchmarks/results/object_store_run-<UTC time>.json (`--out` names another; an
existing file is never overwritten), with every run's rows under `runs` and the summary keyed by side and
latency: per round the S3 run's ratio to the local run of the same round and shuffle (and to Mosaic's), then
the median and the range of those paired ratios, for the mean wait per step and its p50/p90/p99.

Where a round's wait goes: each run records the wait percentiles per step, the share of the wait in its 5
longest waits and in its first 5% of steps, the loaders' storage waits (units awaited or fetched on the
read path), the 1-minute load and the machine's CPU busy fraction over the run (other processes included).
`--fsspec-at 100` also runs the S3 sides at that latency with `LOOMDATA_S3_TRANSPORT=fsspec` (row groups
through s3fs instead of pyarrow's S3 client).

    .venv/bin/python benchmarks/object_store.py                      # about 5-10 minutes
    .venv/bin/python benchmarks/object_store.py --latencies 0 100 --docs 4000
    .venv/bin/python benchmarks/object_store.py --shuffles block --step-ms 1.5 50 --no-mosaic   # the latency goal
    .venv/bin/python benchmarks/object_store.py --read-paths 7     # CPU per row group read, per S3 path
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from _latency_proxy import LatencyProxy

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
PEERS_PYTHON = HERE / ".venv-peers" / "bin" / "python"
BUCKET = "loom-bench"
ROW_GROUP = 256  # documents per Parquet row group (the loaders' read unit)
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def _write_docs(root: Path, docs: int, seed: int, per_file: int = 2000) -> tuple[list[Path], Path]:
    """Pre-tokenized Parquet files (row groups of 256 documents) and the same documents as one .npz."""
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(np.log(700.0), 0.9, size=docs), 16, 16_000).astype(np.int64)
    values = rng.integers(1, 50_000, size=int(lens.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    (root / "parquet").mkdir(parents=True)
    files = []
    for k, a in enumerate(range(0, docs, per_file)):
        b = min(docs, a + per_file)
        off = (offsets[a : b + 1] - offsets[a]).astype(np.int32)
        arr = pa.ListArray.from_arrays(pa.array(off), pa.array(values[offsets[a] : offsets[b]]))
        path = root / "parquet" / f"part-{k:03d}.parquet"
        pq.write_table(pa.table({"tokens": arr}), path, row_group_size=ROW_GROUP)
        files.append(path)
    npz = root / "docs.npz"
    np.savez(npz, tokens=values, offsets=offsets)
    return files, npz


def _upload(s3: Any, local: Path, prefix: str) -> int:
    n = 0
    for p in sorted(local.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(local)}")
            n += 1
    return n


def _spec(
    root: Path,
    paths: str,
    shuffle: str,
    seq_len: int,
    steps: int,
    dp: int,
    tag: str,
    window: int = 4,
    block_size: int = ROW_GROUP,
) -> Any:
    """One Parquet source; `block`: blocks of `block_size` documents (default one row group), `window` of them
    shuffled together.

    The default block shuffle (1024 documents x a window of 16) spans more documents than the benchmark's
    corpus, which would make it a global shuffle here; blocks aligned with row groups are what `block` is for.
    """
    from loomdata.schemas import parse_spec

    source: dict[str, Any] = {"name": "web", "format": "parquet", "paths": [paths], "tokens_field": "tokens"}
    if shuffle != "global":
        source.update(shuffle=shuffle, block_size=block_size, window=window)
    return parse_spec(
        {
            "name": f"bench-objstore-{tag}",
            "workdir": str(root / f"work-{tag}"),
            "seed": 0,
            "sources": [source],
            "mixture": {"weights": {"web": 1.0}},
            "training": {"seq_len": seq_len, "steps": steps, "dp_size": dp, "micro_batches": 1},
        },
        root,
        check_paths=False,
    )


def _consumer(plan_dir: str, rank: int, ready: Any, start: Any, out: Any, step_s: float = 0.0) -> None:
    from loomdata.client import StreamClient

    c = StreamClient(plan_dir, rank)
    ready.put(rank)
    start.wait()
    t0, cpu0 = time.time(), time.process_time()
    tokens = n = first_tokens = 0
    first = None
    gaps = []  # seconds each batch took to arrive
    long_gaps = []  # (wall-clock end, seconds, batch index) of waits over LONG_WAIT_S: lined up with --trace's events
    t = time.perf_counter()
    for b in c:
        now = time.perf_counter()
        gaps.append(now - t)
        if now - t > LONG_WAIT_S:
            long_gaps.append((time.time(), now - t, n))
        tokens += int(b.cu_seqlens[-1])
        n += 1
        if first is None:
            first = time.time() - t0
            first_tokens = tokens
        if step_s > 0:
            time.sleep(step_s)  # the rank's training step: the serving window has this long to stay ahead
        t = time.perf_counter()
    t1, cpu = time.time(), time.process_time() - cpu0
    wait, steps = c.wait_s, c.meta.steps
    c.close()
    out.put(
        {
            "rank": rank,
            "tokens": tokens,
            "batches": n,
            "t0": t0,
            "t1": t1,
            "wait_s": wait,
            "steps": steps,
            "first_s": first,
            "first_tokens": first_tokens,
            "gaps": gaps,
            "long_gaps": long_gaps,
            "cpu_s": cpu,  # the rank's own CPU (its training step is a sleep: this is the client's share)
        }
    )


STORE_PID: int | None = None  # the S3 server's own process (None: moto runs in this process, `--store-in-process`)


def _store_cpu_s() -> float:
    """CPU seconds the S3 server's own process has used so far (0 when it runs in this process)."""
    if STORE_PID is None:
        return 0.0
    try:
        with open(f"/proc/{STORE_PID}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _start_store(in_process: bool) -> tuple[Any, int]:
    """moto's S3 server on loopback, in a process of its own (as a real store is not in the scheduler's process, its
    request threads do not compete for the scheduler's GIL), or in this one (`--store-in-process`, sessions <= 17).
    Returns (a handle to stop it, its port)."""
    global STORE_PID
    if in_process:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        server.start()
        return server, int(server.get_host_and_port()[1])
    port = _free_port()
    code = (
        "import logging; logging.getLogger('werkzeug').setLevel(logging.ERROR); "
        "from moto.server import ThreadedMotoServer as T; import time; "
        f"T(ip_address='127.0.0.1', port={port}).start(); time.sleep(1e6)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    STORE_PID = proc.pid
    atexit.register(proc.kill)  # a run that fails midway leaves no server behind
    return proc, port


def _stop_store(handle: Any) -> None:
    global STORE_PID
    if isinstance(handle, subprocess.Popen):
        handle.kill()
        handle.wait()
        STORE_PID = None
    else:
        handle.stop()


TRACE = False  # --trace: loop lags, GC pauses and serving calls per worker, long waits per consumer
PY_SPY: Path | None = None  # --py-spy: a py-spy binary (in a venv of its own) sampling the processes of each run
PROFILES: list[Path] = []  # the profiles written so far (collapsed stacks, one file per process and run)


def _profile_start(client: Any, label: str) -> list[subprocess.Popen[bytes]]:
    """py-spy over each worker and this process (the scheduler; for S3 the moto server and the proxy) until stopped."""
    if PY_SPY is None:
        return []
    pids = {f"worker{k}": pid for k, pid in enumerate(sorted(client.run(os.getpid).values()))}
    pids["bench"] = os.getpid()
    if STORE_PID is not None:
        pids["store"] = STORE_PID
    procs = []
    for who, pid in pids.items():
        out = Path(tempfile.gettempdir()) / "loom-object-store-profiles" / f"{label}-{who}.txt"  # large: not results
        out.parent.mkdir(parents=True, exist_ok=True)
        PROFILES.append(out)
        cmd = [str(PY_SPY), "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--nonblocking"]
        procs.append(subprocess.Popen([*cmd, "--threads", "--output", str(out)], stdout=subprocess.DEVNULL))
    time.sleep(0.5)  # attached before the consumers start
    return procs


def _profile_stop(procs: list[subprocess.Popen[bytes]]) -> None:
    import signal

    for p in procs:
        p.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
    for p in procs:
        p.wait(timeout=60)


# Where a process's busy samples go (`--py-spy`): each stack is put in the category of its frame nearest the leaf that
# matches one (so a GET made inside a row-group decode counts as storage, the decode's own C++ time as decode).
_SPLIT = (
    ("storage (GETs: s3fs, botocore, pyarrow S3, RangeFile)", ("loomdata/storage/", "s3fs/", "aiobotocore/",
        "botocore/", "aiohttp/", "urllib3/", "pyarrow/fs.py", "fsspec/")),
    ("checks and checksums", ("sources/_integrity.py", "execution/_verify.py", "xxhash")),
    ("decode (Parquet row groups, readers)", ("pyarrow/parquet/", "loomdata/sources/", "execution/_reads.py")),
    ("read-ahead and loader bookkeeping", ("execution/_prefetch.py", "execution/_shard_opens.py",
        "execution/_plan_ahead.py", "execution/_loader", "execution/_manifest.py", "execution/_sample_index.py")),
    ("packing and the serving path", ("execution/_pack", "execution/_constructor.py", "execution/_window.py",
        "execution/_gateway.py", "execution/_wire.py", "execution/_strand.py", "execution/_arrow_pool.py",
        "execution/_publish.py", "execution/_loop.py")),
    ("moto (the S3 server)", ("moto/", "werkzeug/", "flask/", "xmltodict", "jinja2/", "responses/")),
    ("latency proxy", ("_latency_proxy.py",)),
    ("dask, comms, event loop", ("distributed/", "tornado/", "asyncio/", "msgpack", "cloudpickle", "selectors.py",
        "ssl.py", "socket.py", "threading.py", "concurrent/")),
)  # fmt: skip


_IDLE_LEAVES = (
    "Selector.select (", "Condition.wait (", "Event.wait (", "_worker (concurrent/futures/thread.py", "Queue.get (",
    "sleep (", "accept (", "_wait_for_tstate_lock", "poll (", "recv_into (", "Connection.recv", "_recv (",
    "SocketIO.readinto (socket.py",
)  # fmt: skip


def _profile_split(path: Path) -> dict[str, Any]:
    """A py-spy raw profile's busy samples (threads waiting in a select, a lock or a queue left out) by category
    (`_SPLIT`, else `other`): their count and each category's share."""
    counts: dict[str, int] = {}
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        k = int(n)
        frames = stack.split(";")
        leaf = frames[-1]
        if len(frames) < 2 or any(idle in leaf for idle in _IDLE_LEAVES):  # a thread waiting, not working
            continue
        total += k
        cat = "other"
        for frame in reversed(frames):
            hit = next((name for name, keys in _SPLIT if any(key in frame for key in keys)), None)
            if hit is not None:
                cat = hit
                break
        counts[cat] = counts.get(cat, 0) + k
    if not total:
        return {}
    shares = {c: round(v / total, 3) for c, v in sorted(counts.items(), key=lambda kv: -kv[1])}
    return {"samples": total, "shares": shares}


def _run_consumers(plan_dir: Path, n: int, step_s: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    ready, out, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_consumer, args=(str(plan_dir), r, ready, start, out, step_s)) for r in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    start.set()
    rows = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return rows


plans_of: dict[str, Path] = {}  # spec name -> its plan dir


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine (/proc/stat; zeros where there is none)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


def _machine(t0: tuple[int, int], t1: tuple[int, int]) -> dict[str, Any]:
    busy, total = t1[0] - t0[0], t1[1] - t0[1]
    return {"load_1m": round(os.getloadavg()[0], 2), "cpu_busy": round(busy / total, 3) if total > 0 else None}


def _loom_run(
    spec: Any,
    consumers: int,
    proxy: LatencyProxy | None,
    root: Path,
    prefetch: int,
    transport: str | None = None,
    step_s: float = 0.0,
) -> dict[str, Any]:
    """Serve an indexed and planned spec on a fresh embedded cluster (its workers see the proxy's endpoint).

    `transport`: `LOOMDATA_S3_TRANSPORT` for the workers (None: the default, pyarrow for row groups); `step_s`:
    each consumer's simulated training step per batch.
    """
    from loomdata.execution import Executor, open_cluster
    from loomdata.storage import request_stats
    from loomdata.storage._arrow import TRANSPORT_ENV

    plan_dir = plans_of[spec.name]
    from loomdata.planning import plan_report

    shuffle_figures = plan_report(plan_dir).get("shuffle")
    if proxy is not None:
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
    os.environ.pop(TRANSPORT_ENV, None)
    if transport is not None:
        os.environ[TRANSPORT_ENV] = transport  # the workers started below inherit it
    with open_cluster(n_workers=2, local_directory=root / "dask") as client:
        # serving CPU from the executor's start: a loader reads ahead before the consumers start (local disk: most of
        # a run's reads), so CPU counted from the consumers' start alone would flatter the faster store
        serve0, store0 = client.run(time.process_time), time.process_time() + _store_cpu_s()
        t_serve = time.time()
        with Executor(plan_dir, client, loader_prefetch=prefetch) as ex:
            t_ready = time.time()
            if proxy is not None:
                proxy.reset()
            if TRACE:
                import _stall_trace

                client.run(_stall_trace.start, patch=True)
            label = f"{spec.name}-{proxy.delay_s * 1000 if proxy else 0:g}ms-{time.time_ns()}"
            spies = _profile_start(client, label)
            ticks, wcpu0 = _cpu_ticks(), client.run(time.process_time)
            cpu0, s3cpu0 = time.process_time(), _store_cpu_s()
            rows = _run_consumers(plan_dir, consumers, step_s)
            _profile_stop(spies)
            done = PROFILES[-len(spies) :] if spies else []
            split = {p.name.rsplit("-", 1)[1][: -len(".txt")]: _profile_split(p) for p in done}
            machine = _machine(ticks, _cpu_ticks())
            # this process (the scheduler, for S3 the proxy) and the S3 server's (CPU a real store would not take)
            machine["store_process_cpu_s"] = round(_store_cpu_s() - s3cpu0, 3)
            machine["bench_process_cpu_s"] = round(time.process_time() - cpu0 + machine["store_process_cpu_s"], 3)
            wcpu1 = client.run(time.process_time)
            # the serving workers' CPU over the consumers' run (loaders, constructors, their storage clients)
            machine["workers_cpu_s"] = round(sum(wcpu1[w] - wcpu0[w] for w in wcpu1 if w in wcpu0), 3)
            # each worker's share, largest first (one worker runs the constructor, the other most loaders)
            machine["each_worker_cpu_s"] = sorted(
                (round(wcpu1[w] - wcpu0[w], 3) for w in wcpu1 if w in wcpu0), reverse=True
            )
            # the same from the executor's start (its warm-up and reads ahead before the consumers start included)
            machine["serve_workers_cpu_s"] = round(sum(wcpu1[w] - serve0[w] for w in wcpu1 if w in serve0), 3)
            machine["serve_bench_process_cpu_s"] = round(time.process_time() + _store_cpu_s() - store0, 3)
            trace = client.run(_stall_trace.stop) if TRACE else None
            read_waits = _read_waits(client)
            wall = max(r["t1"] for r in rows) - min(r["t0"] for r in rows)  # from the consumers' common start
            counts = proxy.reset() if proxy is not None else None
            loaders = [lo.metrics for lo in ex.metrics().loaders]
            worker_stats: dict[str, int] = {}  # the workers' own counts: requests, bytes, retries (loomdata.storage)
            for one in client.run(request_stats).values():
                for k, v in one.items():
                    worker_stats[k] = worker_stats.get(k, 0) + int(v)
    os.environ.pop(TRANSPORT_ENV, None)
    tokens = sum(r["tokens"] for r in rows)
    steps = rows[0]["steps"]
    out: dict[str, Any] = {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s_per_consumer": round(tokens / wall / consumers),
        "steady_tokens_per_s_per_consumer": _steady(rows),
        "wait_per_step_ms": round(1000 * max(r["wait_s"] for r in rows) / steps, 3),
        # the goal's figure: steady state, without the first step (serve start, the same once per run)
        "wait_per_step_after_first_ms": round(1000 * max(sum(r["gaps"][1:]) for r in rows) / max(steps - 1, 1), 3),
        "first_wait_s": round(max(r["gaps"][0] if r["gaps"] else 0.0 for r in rows), 3),
        "first_batch_s": round(max(r["first_s"] or 0.0 for r in rows), 3),
        "steps": steps,
        **_gap_stats([r["gaps"][1:] for r in rows]),  # after the first batch
        **machine,
        "transport": transport or "default",
        "worker_requests": worker_stats,
        "loader_prefetch": prefetch,
        "prefetched_units": sum(m.prefetched for m in loaders),
        "prefetch_hits": sum(m.prefetch_hits for m in loaders),
        "prefetch_errors": sum(m.prefetch_errors for m in loaders),
        # storage waits on the loaders' read path: a unit awaited while being read ahead, or fetched by the read
        # (None from a loomdata whose loaders do not count them)
        "prefetch_waits": _total(loaders, "prefetch_waits"),
        "unit_misses": _total(loaders, "unit_misses"),
        # the loaders' worker processes at the end of the run (the read-ahead's reach is what holds units there)
        "loader_rss_mib_max": round(max((getattr(m, "rss_bytes", 0) for m in loaders), default=0) / 2**20, 1),
        # what the loaders used: the store's GET latency they measured and the read-ahead's reach in steps (None from
        # a loomdata whose metrics do not have them)
        "get_latency_ms": _largest(loaders, "get_latency_s", 1000),
        "prefetch_reach_steps": _largest(loaders, "prefetch_reach_steps", 1),
        "step_ms": round(1000 * step_s, 3),
        "consumers_cpu_s": round(sum(r.get("cpu_s", 0.0) for r in rows), 3),
        # the plan's shuffle quality (spearman, storage jumps, a block reader's read amplification; plan report)
        "plan_shuffle": shuffle_figures,
    }
    # tokens per serving CPU-second: the workers and the consumers, not the benchmark process (scheduler, and for S3 the
    # moto server and the proxy, which a real store would not run on these cores). Two windows, neither exact: from the
    # consumers' start (leaves out what loaders read ahead before it: most of a local run's reads) and from the
    # executor's start (adds one-time start-up: actor imports, for S3 the storage clients' first session)
    run_cpu, serve_cpu = (
        out["workers_cpu_s"] + out["consumers_cpu_s"],
        out["serve_workers_cpu_s"] + out["consumers_cpu_s"],
    )
    out["tokens_per_serving_cpu_s"] = round(tokens / run_cpu) if run_cpu > 0 else None
    out["tokens_per_serve_start_cpu_s"] = round(tokens / serve_cpu) if serve_cpu > 0 else None
    out["wait_timeline"] = _wait_timeline(rows, read_waits, out)
    t0 = min(r["t0"] for r in rows)  # the serve's start and readiness, from the consumers' common start
    out["wait_timeline"].update(serve_start_s=round(t_serve - t0, 3), serve_ready_s=round(t_ready - t0, 3))
    if spies:
        out["profile_split"] = split  # busy samples at 200 Hz per process: worker0/1, bench (scheduler, proxy), store
    if trace is not None:
        out["trace"] = {"consumers": [r["long_gaps"] for r in rows], "workers": trace}
    if counts is not None:
        out.update(
            requests=counts.requests,
            requests_per_step=round(counts.requests / steps, 2),
            fetched_per_delivered=round(counts.bytes_down / max(4 * tokens, 1), 3),
        )
    return out


def _read_waits(client: Any) -> list[dict[str, Any]] | None:
    """The loaders' waits on units still being read ahead, every worker's (None from a loomdata without the log)."""
    try:
        from loomdata.execution._loader import read_waits
    except ImportError:
        return None
    return sorted((w for ws in client.run(read_waits).values() for w in ws), key=lambda w: w["at"])


TIMELINE_BINS = 10  # the consumer's wait per tenth of the run's steps
LONG_WAIT_S = 0.05  # a wait over this long is listed with its step and time


def _wait_timeline(rows: list[dict[str, Any]], read_waits: list[dict[str, Any]] | None, run: dict[str, Any]) -> dict:
    """Where a run's consumer wait is (issue 9's "which steps wait and why"), for the consumer that waited longest:

    - `first_s` (serve start, once a run) and the wait after it per tenth of the steps (`by_tenth_ms`);
    - `long`: each wait over `LONG_WAIT_S` after the first batch: [step, ms, seconds from the consumers' start to the
      wait's end (when its batch arrived)];
    - `loader_waits`: the loaders' waits on units being read ahead (`read_waits`; all workers): how many and their
      seconds, in the first second after the consumers' start (cold start: opens and first GETs) and later, and how
      many waited on a read issued more than two store latencies earlier (`issued_early`: storage or CPU too slow,
      not a read issued late);
    - `machine_share`: the run's processes' CPU (workers, consumers, the benchmark process with moto and the proxy)
      over the wall time of the machine's cores: near 1, the run is CPU-bound and waits are the serving rate's.
    """
    worst = max(rows, key=lambda r: sum(r["gaps"][1:]))
    gaps = np.asarray(worst["gaps"][1:], dtype=np.float64)
    t0 = min(r["t0"] for r in rows)
    tenth = [round(1000 * float(b.sum()), 1) for b in np.array_split(gaps, TIMELINE_BINS)] if len(gaps) else []
    long = [[int(n), round(1000 * s, 1), round(at - t0, 3)] for at, s, n in worst["long_gaps"] if n > 0]
    out: dict[str, Any] = {
        "first_s": round(float(worst["gaps"][0]), 3) if worst["gaps"] else None,
        "after_first_s": round(float(gaps.sum()), 3),
        "by_tenth_ms": tenth,
        "long": long,
        "long_s": round(sum(x[1] for x in long) / 1000, 3),
    }
    cpu = sum(run.get(k) or 0.0 for k in ("workers_cpu_s", "consumers_cpu_s", "bench_process_cpu_s"))
    wall = run.get("wall_s") or 0.0
    out["machine_share"] = round(cpu / (wall * (os.cpu_count() or 1)), 3) if wall > 0 else None
    if read_waits is not None:
        lat = (run.get("get_latency_ms") or 0.0) / 1000
        cold = [w for w in read_waits if w["at"] - t0 < 1.0]
        later = [w for w in read_waits if w["at"] - t0 >= 1.0]
        out["loader_waits"] = {
            "count": len(read_waits),
            "seconds": round(sum(w["seconds"] for w in read_waits), 3),
            "first_second": [len(cold), round(sum(w["seconds"] for w in cold), 3)],
            "later": [len(later), round(sum(w["seconds"] for w in later), 3)],
            "issued_early": sum(1 for w in read_waits if w["at"] - w["issued_at"] > 2 * lat),
            "each": [
                [
                    round(w["at"] - t0, 3),
                    round(1000 * w["seconds"], 1),
                    round(1000 * (w["at"] - w["issued_at"]), 1),
                    w["newest"],
                    w["issued_front"],
                    w["in_flight"],
                ]
                for w in read_waits
            ],  # [seconds since start, ms waited, ms since issued, newest served, front at issue, in flight]
        }
    return out


def _steady(rows: list[dict[str, Any]]) -> int:
    """Tokens/s per consumer after each consumer's first batch (its start-up left out: serve start, Mosaic's index)."""
    rates = []
    for r in rows:
        span = r["seconds"] - r["first_s"] if "seconds" in r else r["t1"] - r["t0"] - r["first_s"]
        if r.get("first_s") is not None and span > 0:
            rates.append((r["tokens"] - r["first_tokens"]) / span)
    return round(float(np.mean(rates))) if rates else 0


def _largest(loaders: list[Any], field: str, scale: float) -> float | None:
    """The largest of the loaders' `field` (times `scale`), None where they do not report it."""
    vals = [getattr(m, field, None) for m in loaders]
    vals = [v for v in vals if v is not None]
    return round(scale * max(vals), 3) if vals else None


def _total(loaders: list[Any], field: str) -> int | None:
    vals = [getattr(m, field, None) for m in loaders]
    return None if any(v is None for v in vals) else sum(vals)


def _gap_stats(per_consumer: list[list[float]]) -> dict[str, Any]:
    """How the waits for the batches after the first spread: percentiles per step, max, where the wait sits.

    `wait_p*_ms` pool every consumer's steps; `top5_share`: the part of a consumer's wait in its 5 longest waits,
    `early_share`: in its first 5% of steps (the worst consumer of each); `stall_s`: seconds in waits over 50 ms.
    """
    g = np.concatenate([np.asarray(c, dtype=np.float64) for c in per_consumer] or [np.zeros(1)])
    g = g if len(g) else np.zeros(1)
    top, early = [], []
    for c in per_consumer:
        a = np.asarray(c, dtype=np.float64)
        total = float(a.sum())
        if total <= 0:
            continue
        top.append(float(np.sort(a)[-5:].sum()) / total)
        early.append(float(a[: max(1, len(a) // 20)].sum()) / total)
    p50, p90, p99 = (1000 * float(np.quantile(g, q)) for q in (0.5, 0.9, 0.99))
    return {
        "wait_p50_ms": round(p50, 3),
        "wait_p90_ms": round(p90, 3),
        "wait_p99_ms": round(p99, 2),
        "gap_max_ms": round(1000 * float(g.max()), 1),
        "stall_s": round(float(g[g > 0.05].sum()), 3),
        "top5_share": round(max(top), 3) if top else None,
        # the step (after the first) of each consumer's longest wait: alike across consumers and runs = a plan boundary
        "gap_max_steps": [int(np.argmax(c)) + 1 if len(c) else None for c in per_consumer],
        "early_share": round(max(early), 3) if early else None,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class MosaicSetting:
    """One Mosaic Streaming configuration: MDS shard size, DataLoader workers per rank, samples each worker
    downloads ahead (None: Mosaic's default, 8 x batch). Written `SHARD_MIB:WORKERS:PREDOWNLOAD`, `d` for a default."""

    shard_mib: float = 32.0
    workers: int = 2
    predownload: int | None = None

    @classmethod
    def parse(cls, text: str) -> MosaicSetting:
        parts = [*text.split(":"), "d", "d"][:3]
        try:
            mib, workers, pd = (None if x == "d" else float(x) for x in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected SHARD_MIB:WORKERS:PREDOWNLOAD, e.g. 8:2:d") from None
        d = cls()
        return cls(
            d.shard_mib if mib is None else mib,
            d.workers if workers is None else int(workers),
            None if pd is None else int(pd),
        )

    @property
    def label(self) -> str:
        return f"{self.shard_mib:g}MiB w{self.workers} pd{'d' if self.predownload is None else self.predownload}"

    @property
    def prefix(self) -> str:
        """Where this shard size's MDS copy lives in the bucket."""
        return f"mds-{self.shard_mib:g}"


def _mosaic_run(
    remote: str, consumers: int, samples: int, proxy: LatencyProxy, root: Path, setting: MosaicSetting
) -> dict[str, Any]:
    """Each consumer a rank process of the peers' venv streaming its partition of the documents (fresh cache)."""
    env = {**os.environ, **CREDS, "S3_ENDPOINT_URL": proxy.url, "PYTHONPATH": str(HERE / "_peer_stubs")}
    proxy.reset()
    cpu0 = time.process_time() + _store_cpu_s()
    procs = []
    cache = root / f"mosaic-cache-{time.time_ns()}"  # shared by the consumers of one node, as Mosaic wants
    port = _free_port()
    for r in range(consumers):  # one node, `consumers` ranks (as torchrun starts them): each its own partition
        dist = {
            "WORLD_SIZE": str(consumers),
            "RANK": str(r),
            "LOCAL_WORLD_SIZE": str(consumers),
            "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        args = [str(PEERS_PYTHON), str(HERE / "_mosaic_child.py"), "read", remote, str(cache), str(samples), "8"]
        args += [str(setting.workers)] + [str(setting.predownload)] * (setting.predownload is not None)
        procs.append(subprocess.Popen(args, env=env | dist, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"Mosaic consumer failed (exit {p.returncode}): {err[-2000:]}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    wall = max(r["seconds"] for r in rows)  # from each consumer's dataset construction (imports excluded)
    counts = proxy.reset()
    tokens = sum(r["tokens"] for r in rows)
    batches = sum(len(r["waits"]) for r in rows)
    cpu = sum(r.get("cpu_s", 0.0) for r in rows)  # the ranks (from their dataset construction) and DataLoader workers
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s_per_consumer": round(tokens / wall / consumers),
        "steady_tokens_per_s_per_consumer": _steady(
            [{**r, "first_s": r["first_batch_s"], "first_tokens": r.get("first_tokens", 0)} for r in rows]
        ),
        "wait_per_batch_ms": round(1000 * sum(sum(r["waits"]) for r in rows) / max(batches, 1), 3),
        "first_batch_s": round(max(r["first_batch_s"] for r in rows), 3),
        "requests": counts.requests,
        "fetched_per_delivered": round(counts.bytes_down / max(4 * tokens, 1), 3),
        "consumers_cpu_s": round(cpu, 3),
        "tokens_per_serving_cpu_s": round(tokens / cpu) if cpu > 0 else None,
        "bench_process_cpu_s": round(time.process_time() + _store_cpu_s() - cpu0, 3),  # moto and the proxy
    }


def _print_row(side: str, ms: float, row: dict[str, Any]) -> None:
    extra = (
        f"{row['requests_per_step']:>10.2f}{row['fetched_per_delivered']:>12.3f}" if "requests_per_step" in row else ""
    )
    wait = row.get("wait_per_step_ms", row.get("wait_per_batch_ms", 0.0))
    after = f"{row['wait_per_step_after_first_ms']:>11.2f}" if "wait_per_step_after_first_ms" in row else f"{'':>11}"
    waits = [row.get("prefetch_waits"), row.get("unit_misses")]
    misses = ""
    if None not in waits and ms > 0:  # object URLs: a unit awaited in flight or fetched by the read path
        misses = f"  storage waits {waits[0] + waits[1]}"
    elif None not in waits:  # local files: a miss is a read inline (auto read-ahead off), not a wait on storage
        misses = f"  read-ahead waits {waits[0]} inline reads {waits[1]}"
    pct = (
        f"  p50/90/99 {row['wait_p50_ms']:.2f}/{row['wait_p90_ms']:.2f}/{row['wait_p99_ms']:.1f}"
        if "wait_p50_ms" in row
        else ""
    )
    load = f"  load {row.get('load_1m')} cpu {row.get('cpu_busy')}"
    steady = row.get("steady_tokens_per_s_per_consumer") or 0
    print(
        f"{side:<40}{ms:>5.0f}{row['tokens_per_s_per_consumer']:>16,}{steady:>14,}{wait:>14.2f}{after}{extra}{misses}"
        f"{pct}{load}"
    )


def _stepped(side: str, step_ms: float) -> str:
    """A side's name with its simulated training step (`... step50ms`; none for consumers reading flat out)."""
    return side if step_ms <= 0 else f"{side} step{step_ms:g}ms"


def _one_round(
    args: Any,
    rnd: int,
    locals_: dict[str, Any],
    plans: dict[str, Any],
    proxies: dict[float, LatencyProxy],
    root: Path,
    mosaic: bool,
    results: dict[str, Any],
) -> None:
    """Per training step of `--step-ms`: every side once, local disk (and local without prefetch for `block`), then
    S3 at each latency; Mosaic (which reads flat out) once per latency, in the first step's pass."""
    for k, step_ms in enumerate(args.step_ms):
        step_s, flat = step_ms / 1000, step_ms <= 0
        for sh, local in locals_.items():
            runs = [(f"loomdata local {sh}", args.prefetch)]
            runs += [(f"loomdata local {sh} no-pf", 0)] * (sh == "block" and flat)
            for side, pf in runs:
                row = _loom_run(local, args.consumers, None, root, pf, step_s=step_s)
                results["runs"].append({"side": _stepped(side, step_ms), "latency_ms": 0, "round": rnd, **row})
                _print_row(_stepped(side, step_ms), 0, row)
        for ms, proxy in proxies.items():
            for sh, spec in plans.items():
                runs = [(f"loomdata s3 {sh}", args.prefetch)]
                if flat and ms in args.no_prefetch_at and args.prefetch > 0:
                    runs.append((f"loomdata s3 {sh} no-pf", 0))
                if flat and ms in args.fsspec_at:
                    runs.append((f"loomdata s3 {sh} fsspec", args.prefetch))
                for side, pf in runs:
                    transport = "fsspec" if side.endswith(" fsspec") else None
                    row = _loom_run(spec, args.consumers, proxy, root, pf, transport, step_s)
                    results["runs"].append({"side": _stepped(side, step_ms), "latency_ms": ms, "round": rnd, **row})
                    _print_row(_stepped(side, step_ms), ms, row)
            for setting in args.mosaic_settings if mosaic and k == 0 else []:
                ticks = _cpu_ticks()
                remote = f"s3://{BUCKET}/{setting.prefix}"
                row = _mosaic_run(remote, args.consumers, args.docs, proxy, root, setting)
                row.update(_machine(ticks, _cpu_ticks()))
                side = f"mosaic s3 {setting.label}"
                results["runs"].append({"side": side, "latency_ms": ms, "round": rnd, "setting": setting.label, **row})
                _print_row(side, ms, row)


WAIT_REL, WAIT_FLOOR_MS = 0.10, 0.05
"""The latency goal, per round (fixed before the session-8 S3 runs were looked at): the S3 run's wait per step after
the first is within 10% of the local run's of the same round, shuffle and training step, or within 0.05 ms of it.
Where both waits are near zero (a training step the window covers), a ratio of two such waits is noise; 0.05 ms per
step is 0.1% of a 50 ms step and below what this machine's scheduling adds between runs of the same code."""


def _goal_excess(runs: list[dict[str, Any]], side: str, ms: float, local: str) -> list[float]:
    """Per round: the S3 side's wait per step after the first minus the local run's, in ms (the goal's margin)."""
    key = "wait_per_step_after_first_ms"
    mine = {r["round"]: r.get(key) for r in runs if r["side"] == side and r["latency_ms"] == ms}
    theirs = {r["round"]: r.get(key) for r in runs if r["side"] == local and r["latency_ms"] == 0}
    return [round(float(mine[k]) - float(theirs[k]), 3) for k in sorted(mine) if theirs.get(k) is not None]


def _goal_met(runs: list[dict[str, Any]], side: str, ms: float, local: str) -> list[bool]:
    """Per round: whether the S3 side's wait per step meets `WAIT_REL` or `WAIT_FLOOR_MS` against local."""
    key = "wait_per_step_after_first_ms"
    theirs = {r["round"]: r.get(key) for r in runs if r["side"] == local and r["latency_ms"] == 0}
    out = []
    for r in runs:
        if r["side"] == side and r["latency_ms"] == ms and theirs.get(r["round"]) is not None:
            base = float(theirs[r["round"]])
            out.append(float(r[key]) - base <= max(WAIT_REL * base, WAIT_FLOOR_MS))
    return out


_RATIO_KEYS = ("wait_per_step_ms", "wait_per_step_after_first_ms", "wait_p50_ms", "wait_p90_ms", "wait_p99_ms")


def _paired(runs: list[dict[str, Any]], side: str, ms: float, ref: str, ref_ms: float, key: str) -> list[float]:
    """Per round: `side` at `ms` over `ref` at `ref_ms` of the same round (rounds where both ran and ref > 0)."""
    mine = {r["round"]: r.get(key) for r in runs if r["side"] == side and r["latency_ms"] == ms}
    theirs = {r["round"]: r.get(key) for r in runs if r["side"] == ref and r["latency_ms"] == ref_ms}
    return [
        float(mine[k]) / float(theirs[k])
        for k in sorted(mine)
        if mine[k] is not None and theirs.get(k) is not None and float(theirs[k]) > 0
    ]


def _spread(vals: list[float]) -> dict[str, Any] | None:
    if not vals:
        return None
    return {"median": round(float(np.median(vals)), 3), "min": round(min(vals), 3), "max": round(max(vals), 3)}


def _with_best_mosaic(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs plus, per latency and round, a `mosaic s3 best` row (that round's Mosaic setting with the most
    tokens/s per consumer over the run) and a `mosaic s3 best steady` row (the most tokens/s after each consumer's
    first batch, which may be another setting): the peer at its best settings is the one loomdata is compared with."""
    best: dict[str, dict[tuple[float, int], dict[str, Any]]] = {"best": {}, "best steady": {}}
    keys = {"best": "tokens_per_s_per_consumer", "best steady": "steady_tokens_per_s_per_consumer"}
    for r in runs:
        if r["side"].startswith("mosaic s3 ") and not r["side"].startswith("mosaic s3 best"):
            k = (r["latency_ms"], r["round"])
            for name, key in keys.items():
                if k not in best[name] or (r.get(key) or 0) > (best[name][k].get(key) or 0):
                    best[name][k] = r
    return runs + [{**r, "side": f"mosaic s3 {name}"} for name, rows in best.items() for r in rows.values()]


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per S3 side and latency: the medians over rounds, and per round paired ratios to local disk and to Mosaic.

    A paired ratio divides a run by the local run (same shuffle) or Mosaic's best setting (same latency) of the same
    round, so load that drifts between rounds cancels; the summary gives their median, min and max.
    """
    runs = _with_best_mosaic(runs)
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["side"], r["latency_ms"]), []).append(r)

    def med(side: str, ms: float, key: str) -> float | None:
        vals = [r[key] for r in by.get((side, ms), []) if r.get(key) is not None]
        return round(float(np.median(vals)), 3) if vals else None

    summary = {}
    for side, ms in sorted(by, key=lambda k: (k[1], k[0])):
        if not side.startswith("loomdata s3") or side.endswith("no-pf"):
            continue
        words = side.split()
        shuffle, step = words[2], next((w for w in words[3:] if w.startswith("step")), None)
        local = f"loomdata local {shuffle}" + (f" {step}" if step else "")
        rows = by[(side, ms)]
        out: dict[str, Any] = {"rounds": len(rows), "shuffle": shuffle, "latency_ms": ms}
        out["step_ms"] = rows[0].get("step_ms", 0.0)
        out["wait_excess_ms_vs_local"] = _goal_excess(runs, side, ms, local)
        out["wait_goal_met"] = _goal_met(runs, side, ms, local)
        for key in _RATIO_KEYS:
            out[key] = med(side, ms, key)
            out[f"local_{key}"] = med(local, 0, key)
            out[f"{key}_vs_local"] = _spread(_paired(runs, side, ms, local, 0, key))
        out["tokens_per_s_per_consumer"] = med(side, ms, "tokens_per_s_per_consumer")
        out["mosaic_tokens_per_s_per_consumer"] = med("mosaic s3 best", ms, "tokens_per_s_per_consumer")
        # the steady rate (after each consumer's first batch): what a long training run gets
        out["steady_tokens_per_s_per_consumer"] = med(side, ms, "steady_tokens_per_s_per_consumer")
        out["local_steady_tokens_per_s_per_consumer"] = med(local, 0, "steady_tokens_per_s_per_consumer")
        out["mosaic_steady_tokens_per_s_per_consumer"] = med(
            "mosaic s3 best steady", ms, "steady_tokens_per_s_per_consumer"
        )
        out["mosaic_best_settings"] = [r["setting"] for r in by.get(("mosaic s3 best", ms), [])]
        out["mosaic_best_steady_settings"] = [r["setting"] for r in by.get(("mosaic s3 best steady", ms), [])]
        settings = [r for r in by if r[1] == ms and r[0].startswith("mosaic s3 ") and "best" not in r[0].split()]
        out["mosaic_settings_tokens_per_s"] = {
            r[0][len("mosaic s3 ") :]: med(*r, "tokens_per_s_per_consumer") for r in settings
        }
        out["mosaic_settings_steady_tokens_per_s"] = {
            r[0][len("mosaic s3 ") :]: med(*r, "steady_tokens_per_s_per_consumer") for r in settings
        }
        mosaic = "mosaic s3 best" if step is None else "-"  # Mosaic reads flat out: only flat-out sides compare
        out["tokens_per_s_vs_mosaic"] = _spread(_paired(runs, side, ms, mosaic, ms, "tokens_per_s_per_consumer"))
        # issue 9's throughput goal on a long run's basis: the steady rate against Mosaic's best steady setting
        steady_mosaic = "mosaic s3 best steady" if step is None else "-"
        out["steady_tokens_per_s_vs_mosaic"] = _spread(
            _paired(runs, side, ms, steady_mosaic, ms, "steady_tokens_per_s_per_consumer")
        )
        # against the setting best over the whole run (session 10's steady figure)
        out["steady_tokens_per_s_vs_mosaic_best_overall"] = _spread(
            _paired(runs, side, ms, mosaic, ms, "steady_tokens_per_s_per_consumer")
        )
        out["steady_tokens_per_s_vs_local"] = _spread(
            _paired(runs, side, ms, local, 0, "steady_tokens_per_s_per_consumer")
        )
        out["tokens_per_s_vs_local"] = _spread(_paired(runs, side, ms, local, 0, "tokens_per_s_per_consumer"))
        out["storage_waits"] = [
            None if r.get("unit_misses") is None else r["prefetch_waits"] + r["unit_misses"] for r in rows
        ]
        out["tokens_per_serving_cpu_s"] = med(side, ms, "tokens_per_serving_cpu_s")
        out["tokens_per_serving_cpu_s_vs_local"] = _spread(
            _paired(runs, side, ms, local, 0, "tokens_per_serving_cpu_s")
        )
        out["tokens_per_serving_cpu_s_vs_mosaic"] = _spread(
            _paired(runs, side, ms, mosaic, ms, "tokens_per_serving_cpu_s")
        )
        out["tokens_per_serve_start_cpu_s_vs_local"] = _spread(
            _paired(runs, side, ms, local, 0, "tokens_per_serve_start_cpu_s")
        )
        out["bench_process_cpu_s"] = med(side, ms, "bench_process_cpu_s")
        out["serve_workers_cpu_s"] = med(side, ms, "serve_workers_cpu_s")
        out["local_serve_workers_cpu_s"] = med(local, 0, "serve_workers_cpu_s")
        out["first_batch_s"] = med(side, ms, "first_batch_s")
        out["local_first_batch_s"] = med(local, 0, "first_batch_s")
        out["get_latency_ms"] = med(side, ms, "get_latency_ms")
        out["prefetch_reach_steps"] = med(side, ms, "prefetch_reach_steps")
        out["requests_per_step"] = med(side, ms, "requests_per_step")
        out["fetched_per_delivered"] = med(side, ms, "fetched_per_delivered")
        out["load_1m"] = [r.get("load_1m") for r in rows]
        summary[f"{side} @{ms:g}ms"] = out
    return summary


def _print_matrix(summary: dict[str, Any]) -> None:
    """The matrix: each S3 side and latency, its wait and tokens/s as paired ratios (median [min-max])."""

    def fmt(x: dict[str, Any] | None) -> str:
        return "-" if x is None else f"{x['median']:.2f} [{x['min']:.2f}-{x['max']:.2f}]"

    head = ["wait/local", "p90/local", "tok/s vs Mosaic", "steady vs Mosaic", "tok/s vs local", "tok/CPU-s vs Mosaic"]
    print(f"\n{'side @latency':<44}" + "".join(f"{h:>20}" for h in head) + "  wait - local ms (goal met)")
    for k, v in summary.items():
        cells = [v["wait_per_step_after_first_ms_vs_local"], v["wait_p90_ms_vs_local"]]
        cells += [v["tokens_per_s_vs_mosaic"], v["steady_tokens_per_s_vs_mosaic"], v["tokens_per_s_vs_local"]]
        cells += [v["tokens_per_serving_cpu_s_vs_mosaic"]]
        goal = f"  {v['wait_excess_ms_vs_local']} ({sum(v['wait_goal_met'])}/{len(v['wait_goal_met'])})"
        print(f"{k:<44}" + "".join(f"{fmt(c):>20}" for c in cells) + goal)


def _out_path(out: Path | None) -> Path:
    """`--out`, or a new file per run; never an existing file (the assembled results of other runs live there)."""
    path = out or RESULTS_DIR / f"object_store_run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    if path.exists():
        raise SystemExit(f"{path} exists: pass another --out (results of earlier runs are kept, never overwritten)")
    return path


def _read_paths(rounds: int, docs: int = 2000) -> dict[str, Any]:
    """CPU and wall per Parquet row group read from S3 (moto in its own process, so only the reader's CPU counts).

    Sides: the local file; loomdata's `RangeFile` (what a loader reads through) with the default transport (pyarrow's
    S3 client for large ranges) and with `LOOMDATA_S3_TRANSPORT=fsspec` (s3fs); `pyarrow.fs.S3FileSystem` directly.
    """
    import pyarrow.fs as pafs

    from loomdata.storage import RangeFile
    from loomdata.storage._arrow import TRANSPORT_ENV

    port = _free_port()
    code = (
        "from moto.server import ThreadedMotoServer as T; import time; "
        f"T(ip_address='127.0.0.1', port={port}).start(); time.sleep(1e6)"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import boto3

        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(CREDS | {"AWS_ENDPOINT_URL": endpoint})
        s3 = boto3.client("s3", endpoint_url=endpoint)
        _create_bucket(s3, tries=100)
        with tempfile.TemporaryDirectory(prefix="loom-bench-reads-") as tmp:
            files, _ = _write_docs(Path(tmp), docs, seed=0, per_file=docs)
            local = files[0]
            s3.upload_file(str(local), BUCKET, "reads/part.parquet")
            url, size = f"s3://{BUCKET}/reads/part.parquet", local.stat().st_size
            md = pq.read_metadata(local)
            arrow_fs = pafs.S3FileSystem(endpoint_override=endpoint)

            def through(f: Any) -> None:
                pf = pq.ParquetFile(f, metadata=md, pre_buffer=False)
                for i in range(md.num_row_groups):
                    pf.read_row_group(i, columns=["tokens"])

            def rangefile(transport: str | None) -> None:
                os.environ.pop(TRANSPORT_ENV, None)
                if transport:
                    os.environ[TRANSPORT_ENV] = transport
                through(RangeFile(url, size))
                os.environ.pop(TRANSPORT_ENV, None)

            sides = {
                "local file": lambda: through(str(local)),
                "RangeFile (default: pyarrow S3 for large ranges)": lambda: rangefile(None),
                "RangeFile (LOOMDATA_S3_TRANSPORT=fsspec: s3fs)": lambda: rangefile("fsspec"),
                "pyarrow.fs.S3FileSystem directly": lambda: through(arrow_fs.open_input_file(url[5:])),
            }
            got: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
            for _ in range(rounds):
                for name, fn in sides.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    fn()
                    got[name].append((time.process_time() - c0, time.perf_counter() - w0))
            n = md.num_row_groups
            out: dict[str, Any] = {"row_groups": n, "row_group_mib": round(size / n / 2**20, 3), "rounds": rounds}
            for name, vals in got.items():
                out[name] = {
                    "cpu_ms_per_row_group": round(1000 * float(np.median([c for c, _ in vals])) / n, 2),
                    "wall_ms_per_row_group": round(1000 * float(np.median([w for _, w in vals])) / n, 2),
                }
            out["load_1m"] = round(os.getloadavg()[0], 2)
            return out
    finally:
        server.kill()
        server.wait()


def _create_bucket(s3: Any, tries: int) -> None:
    """Create the benchmark's bucket once the server listens (a try every 0.1 s)."""
    for _ in range(tries):
        try:
            s3.create_bucket(Bucket=BUCKET)
            return
        except Exception:  # not listening yet
            time.sleep(0.1)


def main() -> None:
    from loomdata.execution import ServeConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=8000)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--latencies", type=float, nargs="+", default=[0, 20, 100], help="ms added per request")
    ap.add_argument("--shuffles", nargs="+", default=["global", "block"])
    ap.add_argument("--block-window", type=int, default=4, help="blocks shuffled together (`block`)")
    ap.add_argument(
        "--block-size",
        type=int,
        default=ROW_GROUP,
        help=f"documents per block (`block`; default {ROW_GROUP}: one row group; 2048: 8 row groups, about one object)",
    )
    ap.add_argument(
        "--prefetch", type=int, default=ServeConfig().loader_prefetch, help="row groups each loader reads ahead"
    )
    ap.add_argument(
        "--no-prefetch-at", type=float, nargs="*", default=[100], help="latencies (ms) also run with prefetch off"
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="simulated training steps per batch in each loomdata consumer, each its own pass (0: read flat out)",
    )
    ap.add_argument("--no-mosaic", action="store_true", help="skip the Mosaic Streaming rows")
    ap.add_argument(
        "--mosaic-settings",
        type=MosaicSetting.parse,
        nargs="+",
        default=[MosaicSetting()],
        metavar="SHARD_MIB:WORKERS:PREDOWNLOAD",
        help="Mosaic configurations, each run per latency and round; loomdata is compared with the best of them "
        "(default 32:2:d: 32 MiB shards, 2 DataLoader workers, Mosaic's default predownload)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="times every side runs, alternating (medians reported)")
    ap.add_argument(
        "--fsspec-at", type=float, nargs="*", default=[], help="latencies (ms) also run with row groups through s3fs"
    )
    ap.add_argument("--out", type=Path, default=None, help="result file (default: a new object_store_run-*.json)")
    ap.add_argument(
        "--trace", action="store_true", help="record loop lags, GC pauses and serving calls per worker (_stall_trace)"
    )
    ap.add_argument(
        "--py-spy", type=Path, default=None, help="a py-spy binary: profile workers and this process in every run"
    )
    ap.add_argument(
        "--store-in-process",
        action="store_true",
        help="run moto's S3 server in this process (beside the scheduler and the proxy), as sessions <= 17 did",
    )
    ap.add_argument("--local-only", action="store_true", help="only the local-disk sides (no S3 server, no Mosaic)")
    ap.add_argument(
        "--read-paths", type=int, default=0, metavar="ROUNDS", help="only measure row-group reads (CPU, wall) per path"
    )
    ap.add_argument(
        "--ab",
        type=Path,
        default=None,
        metavar="BEFORE_SRC",
        help="alternate rounds of the loomdata in BEFORE_SRC (a src/ folder) and this checkout, paired per round",
    )
    ap.add_argument(
        "--summarize",
        type=Path,
        default=None,
        metavar="RESULTS",
        help="only print the matrix of an earlier result file, its summary recomputed by this script (nothing runs)",
    )
    args = ap.parse_args()
    if args.summarize is not None:
        summary = _summary(json.loads(args.summarize.read_text())["runs"])
        print(json.dumps(summary, indent=1))
        _print_matrix(summary)
        return
    args.out = _out_path(args.out)
    if args.ab is not None:
        _ab(args)
        return
    if args.read_paths:
        found = {"benchmark": "object_store --read-paths", **_read_paths(args.read_paths)}
        print(json.dumps(found, indent=1))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=1) + "\n")
        return
    global TRACE, PY_SPY
    TRACE, PY_SPY = args.trace, args.py_spy
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log

    import boto3

    from loomdata.execution import open_cluster
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan

    os.environ.update(CREDS)
    results: dict[str, Any] = {"runs": []}
    with tempfile.TemporaryDirectory(prefix="loom-bench-objstore-") as tmp:
        root = Path(tmp)
        files, npz = _write_docs(root, args.docs, seed=0)
        tokens = int(np.load(npz)["offsets"][-1])
        steps = max(1, int(tokens * 0.9) // (args.seq_len * args.dp) - 1)
        server, port = _start_store(args.store_in_process)
        direct = f"http://127.0.0.1:{port}"
        os.environ["AWS_ENDPOINT_URL"] = direct
        s3 = boto3.client("s3", endpoint_url=direct)
        _create_bucket(s3, tries=200)
        _upload(s3, root / "parquet", "parquet")
        mosaic = PEERS_PYTHON.exists() and not args.no_mosaic and not args.local_only
        if args.local_only:
            args.latencies = []
        for setting in {m.prefix: m for m in args.mosaic_settings}.values() if mosaic else []:  # a copy per shard size
            mds = root / setting.prefix
            env = {**os.environ, "PYTHONPATH": str(HERE / "_peer_stubs")}
            child = [str(PEERS_PYTHON), str(HERE / "_mosaic_child.py"), "convert", str(npz), str(mds)]
            subprocess.run([*child, f"{setting.shard_mib:g}"], check=True, env=env)
            _upload(s3, mds, setting.prefix)
        print(
            f"{len(files)} files, {args.docs} documents, {tokens:,} tokens; "
            f"{steps} steps x dp {args.dp} x {args.seq_len}"
        )
        plans: dict[str, Any] = {}
        with open_cluster(n_workers=2, local_directory=root / "dask-index") as client:
            locals_ = {}
            for sh in args.shuffles:
                local = _spec(
                    root,
                    "parquet/*.parquet",
                    sh,
                    args.seq_len,
                    steps,
                    args.dp,
                    f"local-{sh}",
                    args.block_window,
                    args.block_size,
                )
                build_index(local, client)
                plans_of[local.name] = Path(make_plan(local).plan_dir)
                locals_[sh] = local
            for sh in [] if args.local_only else args.shuffles:
                try:
                    url = f"s3://{BUCKET}/parquet/*.parquet"
                    spec = _spec(
                        root, url, sh, args.seq_len, steps, args.dp, f"s3-{sh}", args.block_window, args.block_size
                    )
                except Exception as e:  # a shuffle this loomdata does not have: say so, go on
                    print(f"shuffle {sh}: not supported here ({type(e).__name__}: {e})")
                    continue
                build_index(spec, client)
                plans_of[spec.name] = Path(make_plan(spec).plan_dir)
                plans[sh] = spec
        header = (
            f"{'side':<40}{'ms':>5}{'tok/s/consumer':>16}{'steady tok/s':>14}{'wait/step ms':>14}{'after 1st':>11}"
            f"{'req/step':>10}"
            f"{'fetch/deliv':>12}"
        )
        print(header)
        proxies = {ms: LatencyProxy(port, ms / 1000) for ms in args.latencies}
        try:
            for rnd in range(args.rounds):  # rounds alternate every side: this machine's load drifts over minutes
                _one_round(args, rnd, locals_, plans, proxies, root, mosaic, results)
                _write(args, results, steps, tokens, partial=rnd + 1 < args.rounds)  # a cut-short run keeps its rounds
        finally:
            for proxy in proxies.values():
                proxy.close()
        _stop_store(server)
    _print_matrix(results["summary"])
    print(f"wrote {args.out}")


_AB_KEYS = (
    "wait_per_step_after_first_ms",
    "wait_p99_ms",
    "gap_max_ms",
    "stall_s",
    "tokens_per_s_per_consumer",
    "steady_tokens_per_s_per_consumer",
    "tokens_per_serving_cpu_s",
    "bench_process_cpu_s",
    "first_batch_s",
    "workers_cpu_s",
    "requests",
    "requests_per_step",
    "fetched_per_delivered",
)


def _ab(args: Any) -> None:
    """`--rounds` rounds, each the old loomdata (`--ab` src) then this checkout, in subprocesses (same script).

    Writes every run and, per side and latency, each key's median per code version and the per-round
    after/before ratios (rounds pair runs made minutes apart, so load drifting over the sitting cancels).
    """
    forward = [
        a
        for k, v in vars(args).items()
        if k
        not in (
            "ab",
            "rounds",
            "out",
            "trace",
            "local_only",
            "no_mosaic",
            "mosaic_settings",
            "read_paths",
            "store_in_process",
        )
        and v is not None
        for a in (f"--{k.replace('_', '-')}", *([str(x) for x in v] if isinstance(v, list) else [str(v)]))
    ]
    forward += ["--no-mosaic"] + ["--local-only"] * bool(args.local_only) + ["--trace"] * bool(args.trace)
    forward += ["--store-in-process"] * bool(args.store_in_process)
    own = HERE.parent / "src"
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="loom-bench-objstore-ab-") as tmp:
        for k in range(args.rounds):
            for label, src in (("before", args.ab.resolve()), ("after", own)):
                out = Path(tmp) / f"{label}-{k}.json"
                print(f"---- round {k + 1}/{args.rounds}: {label} ({src})", flush=True)
                env = {**os.environ, "PYTHONPATH": str(src)}
                subprocess.run([sys.executable, __file__, *forward, "--out", str(out)], env=env, check=True)
                runs += [{**r, "code": label, "round": k} for r in json.loads(out.read_text())["runs"]]
                _write_ab(args, runs)


def _median_of(vals: list[Any]) -> float | None:
    """The median of the values that are not None (None if none is)."""
    got = [float(v) for v in vals if v is not None]
    return round(float(np.median(got)), 3) if got else None


def _write_ab(args: Any, runs: list[dict[str, Any]]) -> None:
    by: dict[tuple[str, float], dict[str, dict[int, dict[str, Any]]]] = {}
    for r in runs:
        by.setdefault((r["side"], r["latency_ms"]), {}).setdefault(r["code"], {})[r["round"]] = r
    summary: dict[str, Any] = {}
    for (side, ms), codes in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        before, after = codes.get("before", {}), codes.get("after", {})
        row: dict[str, Any] = {}
        for key in _AB_KEYS:
            row[key] = {
                label: _median_of([r.get(key) for r in rs.values()])
                for label, rs in (("before", before), ("after", after))
            }
            both = sorted(set(before) & set(after))
            pairs = [
                after[k][key] / before[k][key] for k in both if before[k].get(key) and after[k].get(key) is not None
            ]
            row[f"{key}_after_vs_before"] = [round(float(x), 3) for x in pairs]
        summary[f"{side} @{ms:g}ms"] = row
    result = {
        "benchmark": "object_store --ab",
        "before_src": str(args.ab),
        "parameters": _parameters(args),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_now": os.getloadavg()},
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for k, v in summary.items():
        cells = "  ".join(f"{key} {v[key]['before']} -> {v[key]['after']}" for key in _AB_KEYS)
        print(f"{k:<36} {cells}")


def _parameters(args: Any) -> dict[str, Any]:
    """The command line as JSON: paths as strings, Mosaic settings by their labels."""
    out = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return out | {"mosaic_settings": [m.label for m in args.mosaic_settings]}


def _write(args: Any, results: dict[str, Any], steps: int, tokens: int, partial: bool) -> None:
    """The result file with the rounds so far (rewritten after each round: a run cut short keeps what it measured)."""
    results.update(
        benchmark="object_store",
        complete=not partial,
        machine={"cpus": os.cpu_count(), "python": platform.python_version(), "load_now": os.getloadavg()},
        parameters=_parameters(args) | {"steps": steps, "tokens": tokens},
        summary=_summary(results["runs"]),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
