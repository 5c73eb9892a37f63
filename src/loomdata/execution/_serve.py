"""`loom serve`: run an executor for a plan until Ctrl-C or SIGTERM, logging metrics, then shut down.

The executor recreates actors lost with a worker while serving; metrics lines count them. Serving
autoscales loaders by default (`Executor` itself does not: a library caller that sizes loaders with
`set_loaders` keeps control); resizes and recovery share one protocol (see `_actors`). Settings come
in one `ServeConfig`, built here (or by `loom serve`) and passed down.

One serve per plan dir (serve.lock, see `_lock`). The embedded cluster uses TLS with credentials made
at start in PLAN_DIR/.loom-tls (0700; clients find them through serve.json); a given scheduler is
reached with the user's credentials (`tls`); plain TCP only with `insecure`.

Storage options (object store endpoints and credentials) come from the spec the plan was made from
(`spec`, `loom serve --spec`; checked against plan.json before the lock and the cluster) or a mapping per
source (`storage_options`); they are carried in memory to the loaders and written nowhere (`_storage_options`).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from loomdata.execution._cluster import check_insecure_allowed, open_cluster
from loomdata.execution._config import Autoscaling, ServeConfig
from loomdata.execution._executor import Executor
from loomdata.execution._lock import serve_lock
from loomdata.execution._plan_meta import check_plan
from loomdata.execution._security import TLS_DIR, TlsFiles
from loomdata.execution._storage_options import OptionsBySource
from loomdata.execution._telemetry import TELEMETRY_FILE, append_telemetry, imbalance
from loomdata.schemas.errors import ExecutionError
from loomdata.schemas.metrics import ExecutorMetrics, StepTelemetry

if TYPE_CHECKING:
    from loomdata.schemas.spec import Spec

__all__ = ["serve"]


def _write_telemetry(ex: Executor, plan_dir: Path) -> list[StepTelemetry]:
    """Drain the ranks' recorded step times and append them to PLAN_DIR/telemetry.jsonl."""
    records = ex.telemetry()
    append_telemetry(plan_dir, records)
    return records


def _report(m: ExecutorMetrics, json_out: bool, telemetry: dict[str, Any] | None = None) -> None:
    """One metrics line: a JSON object on stdout with --json, else a readable line on stderr.

    `telemetry`: predicted vs measured imbalance of the latest step every rank reported (None: none did).
    """
    sources = m.sources
    rates = {k: round(v.samples_per_s, 1) for k, v in sources.items()}
    wait = {str(r): round(w, 4) for r, w in m.rank_wait_s.items()}
    if json_out:
        line = {
            "event": "metrics",
            "samples_per_s": rates,
            "queue_depth": m.queue_depth,
            "rank_wait_s": wait,
            "recovered_actors": m.recovery.recovered,
            "loaders": {k: v.loaders for k, v in sources.items()},
        }
        if telemetry is not None:
            line["telemetry"] = telemetry
        print(json.dumps(line), flush=True)
    else:
        print(
            f"samples/s by source {rates}; constructor queue depth {m.queue_depth}; rank wait s {wait}; "
            f"actors recreated after worker loss {m.recovery.recovered}"
            + (
                f"; step {telemetry['step']} imbalance predicted {telemetry['predicted_imbalance']} "
                f"measured {telemetry['measured_imbalance']} ({TELEMETRY_FILE})"
                if telemetry is not None
                else ""
            ),
            file=sys.stderr,
            flush=True,
        )


def serve(
    plan_dir: str | Path,
    config: ServeConfig | None = None,
    *,
    scheduler: str | None = None,
    json_out: bool = False,
    tls: TlsFiles | None = None,
    insecure: bool = False,
    dashboard: bool = False,
    spec: Spec | str | Path | None = None,
    storage_options: OptionsBySource | None = None,
    **settings: Any,
) -> None:
    """Serve `plan_dir` until Ctrl-C/SIGTERM, printing metrics every `config.metrics_every_s`.

    `config` defaults to `ServeConfig(autoscale=Autoscaling())`: `serve` autoscales unless told not to,
    unlike `Executor`. Keyword `settings` override config fields (`constructors=2`, `autoscale=False`).
    With `json_out`, stdout carries JSON lines only: `serving` (the ServeInfo), `metrics`, `stopped`
    (final metrics). The embedded cluster (no `scheduler`) has `config.n_workers` worker processes.
    `tls`: the user's credentials (needed with `scheduler`); `insecure`: plain TCP (a warning is printed).
    `spec`: the spec (a Spec or its file) the plan was made from, for its sources' `storage_options` (a
    ContractError names both when its content hash is not plan.json's); or `storage_options`: source name ->
    {protocol: options}. Without either, the workers' environment reaches the store (AWS_*, profiles).
    """
    cfg = config or ServeConfig(autoscale=Autoscaling())
    cfg = cfg.with_settings(**settings) if settings else cfg
    plan_dir = Path(plan_dir).resolve()
    # a missing or bad plan, another spec or a stale index says so before the lock, the cluster and the signal
    # handlers (validated in a child interpreter: this process never imports pydantic, `check_plan`)
    checked = check_plan(plan_dir, spec=spec, storage_options=storage_options)
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():

        def _on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _on_signal)
    if insecure:
        check_insecure_allowed()
    try:
        with (
            serve_lock(plan_dir),
            open_cluster(
                scheduler,
                n_workers=cfg.n_workers,
                connect_timeout_s=cfg.timings.connect_timeout_s,
                tls=tls,
                tls_dir=plan_dir / TLS_DIR,
                insecure=insecure,
                dashboard=dashboard,
            ) as client,
            Executor(plan_dir, client, cfg, checked=checked) as ex,
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
            next_log = time.monotonic() + cfg.metrics_every_s
            while not stop.wait(cfg.timings.serve_poll_s):
                if time.monotonic() >= next_log:
                    next_log = time.monotonic() + cfg.metrics_every_s
                    recorded = _write_telemetry(ex, plan_dir)
                    _report(ex.metrics(), json_out, imbalance(recorded, ex.meta.dp_size))
            final = _write_telemetry(ex, plan_dir)  # what the ranks sent since the last line, before the actors go
            summary = ex.metrics()
        if json_out:
            line = {"event": "stopped", "metrics": summary.to_dict(), "telemetry": imbalance(final, ex.meta.dp_size)}
            print(json.dumps(line, default=str), flush=True)
        else:
            print(f"stopped serving plan {info.plan_id}", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
