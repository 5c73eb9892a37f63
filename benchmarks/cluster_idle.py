"""The embedded cluster's fixed cost: CPU seconds a second of each process while nothing is served, and while an
executor serves a plan nobody takes from, with loomdata's Dask housekeeping periods against Dask's defaults.

`open_cluster` (2 worker processes) runs in a fresh child interpreter per run; `dask` runs set Dask's own defaults
through DASK_* variables (which `_cluster.embedded_worker_config` leaves as the user's), `loomdata` runs leave them
unset (`QUIET_PERIODS`). Runs alternate, `--rounds` of each. Per process: `worker0`, `worker1` and `main` (the
scheduler, the nannies and, when serving, the serving process's control loop).

    .venv/bin/python benchmarks/cluster_idle.py --rounds 2 --out benchmarks/results/cluster_idle.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DASK_DEFAULTS = {  # Dask's own periods for QUIET_PERIODS' keys (distributed.yaml)
    "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "20ms",
    "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "100ms",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "500ms",
}


def _cpu(client: Any) -> dict[str, float]:
    """CPU seconds so far of each worker process (address order) and of this process."""
    import psutil

    def cpu() -> tuple[int, float]:
        t = psutil.Process().cpu_times()
        return os.getpid(), float(t.user + t.system)

    per = {a: v for a, (pid, v) in client.run(cpu).items() if pid != os.getpid()}
    out = {f"worker{k}": per[a] for k, a in enumerate(sorted(per))}
    main = os.times()
    out["main"] = main.user + main.system
    return out


def _rate(client: Any, seconds: float) -> dict[str, float]:
    a, t = _cpu(client), time.perf_counter()
    time.sleep(seconds)
    b, dt = _cpu(client), time.perf_counter() - t
    rates = {k: round((b[k] - a[k]) / dt, 4) for k in b}
    rates["total"] = round(sum(rates.values()), 4)
    return rates


def _periods(dask_worker: Any) -> dict[str, float]:
    """The periods (ms) a server's housekeeping callbacks really run at (and a worker's memory monitor)."""
    out = {name: dask_worker.periodic_callbacks[name].callback_time for name in ("tick", "monitor")}
    if hasattr(dask_worker, "memory_manager"):
        out["memory"] = dask_worker.memory_manager.memory_monitor_interval * 1000
    return out


def child(seconds: float) -> dict[str, Any]:
    """One run: the idle cluster, then an executor serving a small plan that no rank takes from."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import stream_throughput as st
    from loomdata.execution import Executor, open_cluster
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan

    with tempfile.TemporaryDirectory(prefix="loom-bench-idle-") as tmp:
        root = Path(tmp)
        st._write_data(root, 4000, seed=0)
        spec = st._spec(root, 4096, 200, 1, shuffle="block", dp=1)
        with open_cluster(n_workers=2, local_directory=root / "dask") as client:
            build_index(spec, client)
            plan_dir = make_plan(spec).plan_dir
            periods = {"workers": list(client.run(_periods).values()), "scheduler": client.run_on_scheduler(_periods)}
            time.sleep(2)  # start-up settled
            idle = _rate(client, seconds)
            with Executor(plan_dir, client):
                time.sleep(2)  # the first window built
                served = _rate(client, seconds)
    return {"cluster_idle": idle, "serving_untaken": served, "periods_ms": periods}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each measured interval")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "cluster_idle.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.seconds)))
        return
    runs: dict[str, list[dict[str, Any]]] = {"dask": [], "loomdata": []}
    want = {  # what each side's workers must really run (the scheduler: the same but the memory monitor)
        "dask": {"tick": 20.0, "monitor": 500.0, "memory": 100.0},
        "loomdata": {"tick": 1000.0, "monitor": 2000.0, "memory": 500.0},
    }
    for k in range(args.rounds):
        for side in list(runs) if k % 2 == 0 else list(runs)[::-1]:  # alternate which side runs first
            env = {key: v for key, v in os.environ.items() if key not in DASK_DEFAULTS}
            if side == "dask":
                env.update(DASK_DEFAULTS)
            cmd = [sys.executable, __file__, "--child", "--seconds", str(args.seconds)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            ran = [*got["periods_ms"]["workers"], {**got["periods_ms"]["scheduler"], "memory": want[side]["memory"]}]
            if any(r != want[side] for r in ran):
                raise SystemExit(f"the {side} run's servers ran periods {ran}, not {want[side]}: not what it measures")
            runs[side].append(got)
            print(f"round {k + 1} {side:8}: idle {got['cluster_idle']}  serving {got['serving_untaken']}", flush=True)
    result = {
        "benchmark": "cluster_idle",
        "machine": {"cpus": os.cpu_count()},
        "parameters": {"seconds": args.seconds, "rounds": args.rounds, "dask_defaults": DASK_DEFAULTS},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
