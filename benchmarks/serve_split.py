"""Where serving CPU goes, per delivered token: py-spy over loomdata's processes, stacks sorted into parts.

The same data, plan and consumers as `stream_throughput.py` (pre-tokenized Parquet, two sources, dp 4); the
index and plan are made first, then `--repeat` fresh executors serve each consumer count in turn while
`py-spy record --subprocesses` samples this process (scheduler, serving control loop), the Dask workers
(loaders, constructors, gateway) and the consumer processes (ranks). Busy samples (py-spy leaves idle threads
out) are sorted into parts by the frames they hold, first match wins (`_PARTS`): loader reads and decoding,
the constructor's builds and packing, its window, the gateway (TLS, pickling), Dask (actor calls, comms, event
loop), the client. CPU seconds per process are measured as `stream_throughput.py` does, so the split can be
read as CPU-seconds per million tokens.

    .venv/bin/pip install py-spy        # not a loomdata dependency
    .venv/bin/python benchmarks/serve_split.py --docs 20000 --steps 1000 --seq-len 4096 --micro-batches 1 \\
        --consumers 1 4 --repeat 3 --out benchmarks/results/serve_split.json

A benchmark tool: nothing in loomdata imports it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stream_throughput as st

# (part, frame patterns): a sample's part is the first whose pattern one of its frames matches, leaf to root
# within a part's list, parts in this order (so a pack inside a build counts as pack, not build).
_PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("imports", ("_find_and_load",)),
    ("pack", ("_pack_group.py", "_packing.py", "pack_group ", "pack_step ")),
    (
        "loader read/decode",
        (
            "sources/",
            "_loader_cache.py",
            "_loader.py",
            "_prefetch.py",
            "_strand.py",
            "_shard_opens.py",
            "_sample_index.py",
            "_plan_ahead.py",
            "_verify.py",
        ),
    ),
    ("constructor build (manifest, reads, window)", ("_constructor.py", "_window.py", "_reads.py", "_manifest.py")),
    ("TLS and pickling (rank gateway, Dask comms)", ("_gateway.py", "_wire.py", "sslproto", "ssl.py", "pickle")),
    ("client (rank)", ("client/", "loomdata/torch", "_loom_consumer", "_consume (")),
    (
        "control loop / metrics",
        ("_loop.py", "_fleet.py", "_metrics.py", "_autoscale.py", "_publish.py", "_heap.py", "_telemetry.py"),
    ),
    ("dask (actors, comms, scheduler, loop)", ("distributed/", "tornado/", "asyncio/", "msgpack", "dask/")),
]


def _part(frames: list[str]) -> str:
    for part, pats in _PARTS:
        for f in frames:
            if any(p in f for p in pats):
                return part
    return "other"


_PROCESS = re.compile(r'process (\d+):"[^"]*";?')  # py-spy's process frames (a command line may hold ';')
# Leaves where a thread waits: py-spy counts a runnable thread as busy, so on a loaded machine a thread woken
# from a wait shows there until it gets a core; those samples are no CPU of the serving code.
_IDLE_LEAVES = ("EpollSelector.select", "Condition.wait", "Event.wait", "_worker (concurrent/futures/thread.py")


def _read_raw(path: Path, roles: dict[int, str]) -> dict[str, collections.Counter[str]]:
    """py-spy raw lines -> per process kind, busy samples per part (and per leaf function under '#leaf ...').

    Consumer processes are told by their frames (`_loom_consumer`: a rank's delivery loop); their start-up
    (imports, connecting) is not in the benchmark's CPU figures and is left out here too.
    """
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        pids = [int(p) for p in _PROCESS.findall(stack)]
        frames = [f for f in _PROCESS.sub("", stack).split(";") if f]
        if not pids or not frames or frames[-1].startswith(_IDLE_LEAVES):
            continue
        kind = roles.get(pids[-1])
        if kind is None:
            if not any("_loom_consumer" in f for f in frames):
                continue
            kind = "ranks"
        part = _part(list(reversed(frames)))
        out[kind][part] += int(count)
        out[kind]["#leaf " + frames[-1]] += int(count)
        out[kind]["#total"] += int(count)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--shuffle", default="global", choices=["global", "block"], help="as stream_throughput.py's")
    ap.add_argument("--consumers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeat", type=int, default=3, help="fresh executors per consumer count")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--out", type=Path, default=st.RESULTS.parent / "serve_split.json")
    ap.add_argument("--no-spy", action="store_true", help="CPU per process only (no py-spy)")
    ap.add_argument("--raw", type=Path, default=None, help="py-spy's raw stacks go here (default: the temp folder)")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")

    from loomdata.execution import Executor, open_cluster
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="loom-serve-split-") as tmp:
        root = Path(tmp)
        os.environ["TMPDIR"] = str(root)
        st._write_data(root, args.docs, seed=0)
        spec = st._spec(root, args.seq_len, args.steps, args.micro_batches, shuffle=args.shuffle)
        with open_cluster(n_workers=2, local_directory=root / "dask") as client:
            build_index(spec, client)
            plan_dir = make_plan(spec).plan_dir
            roles = {os.getpid(): "main (scheduler, serving)"}
            for k, (_, pid) in enumerate(sorted(client.run(os.getpid).items())):
                roles[pid] = f"worker{k}"
            print(f"processes: {roles}", flush=True)
            raw = args.raw or Path(tempfile.gettempdir()) / f"serve-split-{os.getpid()}.txt"
            proc = None
            if not args.no_spy:
                proc = subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--subprocesses",
                        "--nonblocking",
                        "-r",
                        str(args.rate),
                        "-f",
                        "raw",
                        "-o",
                        str(raw),
                        "-p",
                        str(os.getpid()),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)
            for _ in range(args.repeat):
                for n in args.consumers:
                    with Executor(plan_dir, client, window=args.window) as _ex:
                        before: dict[str, float] = {}
                        cpu0 = st._worker_cpu(client, before)
                        rows, wall = st._run_consumers(st._loom_consumer, lambda r: (str(plan_dir), r), n)
                        after: dict[str, float] = {}
                        cpu = st._worker_cpu(client, after) - cpu0 + sum(r["cpu_s"] for r in rows)
                    side = st._side(rows, wall, cpu)
                    side["consumers"] = n
                    side["cpu_s_by_process"] = {
                        "ranks": round(sum(r["cpu_s"] for r in rows), 3),
                        **{k: round(after[k] - before.get(k, 0.0), 3) for k in after},
                    }
                    runs.append(side)
                    print(
                        json.dumps(
                            {
                                k: side[k]
                                for k in ("consumers", "tokens_per_s", "tokens_per_cpu_s", "cpu_s", "cpu_s_by_process")
                            }
                        ),
                        flush=True,
                    )
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
    result: dict[str, Any] = {
        "benchmark": "serve_split",
        "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
    }
    if proc is not None and raw.exists():
        split = _read_raw(raw, roles)
        shown: dict[str, Any] = {}
        grand = sum(c["#total"] for c in split.values())
        for kind, c in sorted(split.items()):
            total = c["#total"]
            parts = {p: round(100 * v / total, 1) for p, v in c.most_common() if not p.startswith("#")}
            leaves = {p[6:]: round(100 * v / total, 1) for p, v in c.most_common() if p.startswith("#leaf ")}
            shown[kind] = {
                "samples": total,
                "share_of_all_pct": round(100 * total / max(grand, 1), 1),
                "parts_pct": parts,
                "top_leaves_pct": dict(list(leaves.items())[:25]),
            }
        overall: collections.Counter[str] = collections.Counter()
        for c in split.values():
            for p, v in c.items():
                if not p.startswith("#"):
                    overall[p] += v
        shown["all"] = {p: round(100 * v / max(grand, 1), 1) for p, v in overall.most_common()}
        result["split"] = shown
        print(json.dumps(shown, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
