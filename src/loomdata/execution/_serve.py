"""`loom serve`: run an executor for a plan until Ctrl-C or SIGTERM, logging metrics, then shut down.

The executor recreates actors lost with a worker while serving; metrics lines count them. Serving
autoscales loaders by default (`Executor` itself does not: a library caller that sizes loaders with
`set_loaders` keeps control); resizes and recovery share one protocol (see `_executor`).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from loomdata.execution._cluster import open_cluster
from loomdata.execution._executor import Executor
from loomdata.schemas.errors import ExecutionError

__all__ = ["serve"]


def _report(m: dict[str, Any], json_out: bool) -> None:
    """One metrics line: a JSON object on stdout with --json, else a readable line on stderr."""
    rates = {k: v["samples_per_s"] for k, v in m["sources"].items()}
    if json_out:
        line = {"event": "metrics", "samples_per_s": rates, "queue_depth": m["queue_depth"]}
        line["rank_wait_s"] = m["rank_wait_s"]
        line["recovered_actors"] = m["recovered_actors"]
        line["loaders"] = {k: v["loaders"] for k, v in m["sources"].items()}
        print(json.dumps(line), flush=True)
    else:
        print(
            f"samples/s by source {rates}; constructor queue depth {m['queue_depth']}; rank wait s {m['rank_wait_s']}; "
            f"actors recreated after worker loss {m['recovered_actors']}",
            file=sys.stderr,
            flush=True,
        )


def serve(
    plan_dir: str | Path,
    *,
    scheduler: str | None = None,
    constructors: int = 1,
    window: int = 2,
    json_out: bool = False,
    n_workers: int = 2,
    metrics_every_s: float = 10.0,
    peers: int | None = None,
    loaders_per_source: int = 1,
    autoscale: bool = True,
) -> None:
    """Serve `plan_dir` until Ctrl-C/SIGTERM, printing metrics every `metrics_every_s`.

    With `json_out`, stdout carries JSON lines only: `serving` (the ServeInfo), `metrics`, `stopped`
    (final metrics). The embedded cluster (no `scheduler`) has `n_workers` worker processes. `peers`
    (processes per dp rank, default the plan's tp*pp*cp), `loaders_per_source` (the start) and
    `autoscale` (on by default here, unlike `Executor`: resize loaders to demand x cost while serving,
    safe together with worker-loss recovery) go to the Executor.
    """
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():

        def _on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _on_signal)
    try:
        with (
            open_cluster(scheduler, n_workers=n_workers) as client,
            Executor(
                plan_dir,
                client,
                constructors=constructors,
                window=window,
                peers=peers,
                loaders_per_source=loaders_per_source,
                autoscale=autoscale,
            ) as ex,
        ):
            info = ex.info
            if info is None:
                raise ExecutionError(f"executor for {plan_dir} did not start")
            if json_out:
                print(json.dumps({"event": "serving", **info.model_dump(mode="json")}), flush=True)
            else:
                print(
                    f"serving plan {info.plan_id} on {info.scheduler}: {len(info.loaders)} loader(s), "
                    f"{len(info.constructors)} constructor(s), window {info.window}; Ctrl-C to stop",
                    flush=True,
                )
            next_log = time.monotonic() + metrics_every_s
            while not stop.wait(0.2):
                if time.monotonic() >= next_log:
                    next_log = time.monotonic() + metrics_every_s
                    _report(ex.metrics(), json_out)
            summary = ex.metrics()
        if json_out:
            print(json.dumps({"event": "stopped", "metrics": summary}, default=str), flush=True)
        else:
            print(f"stopped serving plan {info.plan_id}", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
