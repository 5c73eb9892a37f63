"""`loom serve`: run an executor for a plan until Ctrl-C or SIGTERM, logging metrics, then shut down."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from loomdata.execution._cluster import open_cluster
from loomdata.execution._executor import Executor

__all__ = ["serve"]

_log = logging.getLogger("loomdata.serve")


def serve(
    plan_dir: str | Path,
    *,
    scheduler: str | None = None,
    constructors: int = 1,
    window: int = 2,
    json_out: bool = False,
    n_workers: int = 2,
    metrics_every_s: float = 10.0,
) -> None:
    """Serve `plan_dir` until Ctrl-C/SIGTERM; `json_out` prints one JSON line at start and a summary at exit."""
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
            Executor(plan_dir, client, constructors=constructors, window=window) as ex,
        ):
            info = ex.info
            assert info is not None  # set by start()
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
                    m = ex.metrics()
                    _log.info(
                        "samples/s by source %s, queue depth %s, rank wait %s",
                        {k: v["samples_per_s"] for k, v in m["sources"].items()},
                        m["queue_depth"],
                        m["rank_wait_s"],
                    )
            summary = ex.metrics()
        if json_out:
            print(json.dumps({"event": "stopped", "metrics": summary}, default=str), flush=True)
        else:
            print(f"stopped serving plan {info.plan_id}", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
