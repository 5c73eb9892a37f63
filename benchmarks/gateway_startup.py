"""How long a rank's TLS handshake to a constructor's gateway takes while one worker starts N Source Loaders.

Session 7's one-worker memory run failed once at start-up: a rank's handshake to the gateway timed out
while the single worker started 300 loaders. This script serves memory.py's data (N Parquet sources x 4
shards) from an embedded cluster of `--workers` processes, as `loom serve` does (autoscaling executor), starts
R rank processes iterating `LoomDataset`, and from the moment the executor is serving opens a fresh TLS
connection to rank 0's gateway every 0.25 s for `--seconds`, timing connect + handshake. `--spy` (py-spy
on PATH or `--py-spy`) dumps the stacks of the serving process and its workers at 4, 12 and 25 s (what
the worker's loop is doing while a handshake waits). Run it once per tree (PYTHONPATH) for a side-by-side figure:

    PYTHONPATH=src .venv/bin/python benchmarks/gateway_startup.py --data /tmp/mem --out /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "gateway_startup.json"


def _plan(data: Path, n: int, ranks: int) -> Path:
    """memory.py's data, index and plan for N sources and R ranks (reused from `data` when there)."""
    sys.path.insert(0, str(HERE))
    import memory
    from loomdata.execution import open_cluster
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan

    root = data / f"n{n}"
    memory.write_data(root, n, 4, 2000, 200.0, seed=n)
    steps = math.ceil(1.6 * n * 128 / (ranks * 4096 / (200.0 * math.exp(0.18)))) + 8
    spec = memory.make_spec(root, n, ranks, steps, 4096)
    with open_cluster(n_workers=2, local_directory=root / "dask-index") as client:
        build_index(spec, client)
    return Path(make_plan(spec).plan_dir)


def _spy(server_pid: int, t0: float, py_spy: str, out: dict[str, str]) -> None:
    import psutil

    for at in (4, 12, 25):
        time.sleep(max(0.0, at - (time.perf_counter() - t0)))
        server = psutil.Process(server_pid)
        for child in [server, *server.children(recursive=True)]:  # `--workers 0`: the worker is in the server
            if child.memory_info().rss > 150 << 20:  # a worker or the server (the resource tracker is small)
                got = subprocess.run([py_spy, "dump", "--pid", str(child.pid)], capture_output=True, text=True)
                out[f"{at}s-{child.pid}"] = got.stdout + got.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=int, default=300)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--workers", type=int, default=1, help="worker processes of the embedded cluster")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to probe after serving starts")
    ap.add_argument("--data", type=Path, required=True, help="data, index and plan (memory.py --data's layout)")
    ap.add_argument("--spy", action="store_true", help="dump the workers' stacks with py-spy at 4, 12, 25 s")
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import memory
    from loomdata.execution.protocol import client_ssl_context, read_serve_info
    from loomdata.schemas.plan import read_plan

    plan_dir = _plan(args.data.resolve(), args.sources, args.ranks)
    os.environ["LOOM_BENCH_WORKERS"] = str(args.workers)  # memory.loom_serve's cluster size
    ctx = mp.get_context("spawn")
    ready, cmds, answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    local = args.data.resolve() / f"dask-gateway-{args.sources}"
    local.mkdir(parents=True, exist_ok=True)
    load0 = Path("/proc/loadavg").read_text().strip()
    t0 = time.perf_counter()
    server = ctx.Process(target=memory.loom_serve, args=(str(plan_dir), str(local), ready, cmds, answers))
    server.start()
    memory._wait(ready, 1, "serving", [server], timeout_s=900)
    serving_s = time.perf_counter() - t0
    info = read_serve_info(plan_dir)
    gateway = info.constructor_for(0).gateway
    assert gateway is not None, "no gateway published"
    ssl_ctx = client_ssl_context(gateway, info.tls, plan_id=read_plan(plan_dir).plan_id)
    host, port = gateway.split("://", 1)[1].rsplit(":", 1)
    never = 10**9  # the ranks iterate until stopped
    ranks = [
        ctx.Process(target=memory.loom_rank, args=(str(plan_dir), r, never, never, ready, go, stop))
        for r in range(args.ranks)
    ]
    for p in ranks:
        p.start()
    t1 = time.perf_counter()
    stacks: dict[str, str] = {}
    if args.spy:
        threading.Thread(target=_spy, args=(server.pid, t1, args.py_spy, stacks), daemon=True).start()
    probes: list[dict[str, Any]] = []
    while time.perf_counter() - t1 < args.seconds:
        a = time.perf_counter()
        try:
            sock = socket.create_connection((host, int(port)), timeout=120)
            try:
                if ssl_ctx is not None:
                    sock = ssl_ctx.wrap_socket(sock)  # the handshake
            finally:
                sock.close()
            probes.append({"at_s": round(a - t1, 2), "handshake_s": round(time.perf_counter() - a, 4)})
        except OSError as e:
            probes.append({"at_s": round(a - t1, 2), "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(probes[-1]), flush=True)
        time.sleep(0.25)
    dead = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
    stop.set()
    go.set()
    for p in ranks:
        p.kill()
    cmds.put("stop")
    server.join(timeout=120)
    if server.is_alive():
        server.kill()
    times = sorted(p["handshake_s"] for p in probes if "handshake_s" in p)
    import loomdata

    result = {
        "benchmark": "gateway_startup",
        "tree": str(Path(loomdata.__file__).resolve().parents[1]),
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load_before": load0,
        "load_after": Path("/proc/loadavg").read_text().strip(),
        "serving_after_s": round(serving_s, 1),
        "handshakes": len(times),
        "first_handshake_s": probes[0].get("handshake_s") if probes else None,
        "max_handshake_s": times[-1] if times else None,
        "median_handshake_s": times[len(times) // 2] if times else None,
        "failed_ranks": dead,
        "probes": probes,
        "worker_stacks": stacks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"first {result['first_handshake_s']} s, max {result['max_handshake_s']} s; wrote {args.out}")


if __name__ == "__main__":
    main()
