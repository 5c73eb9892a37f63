"""Cluster handling: an embedded LocalCluster of worker processes, or a connection to a running one.

Secured by default: the embedded cluster speaks TLS with mutual authentication, with credentials
made for it at start (`tls_apart`: `_security.embedded_tls` in a child interpreter); a running
scheduler is reached with the user's own credentials (`--tls-*` or LOOM_TLS_*). Plain TCP only with
`insecure`, which prints a warning.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster
from distributed.security import Security

from loomdata.execution._arrow_pool import WORKER_ARROW_POOL, jemalloc_conf_env, user_pool
from loomdata.execution._child import SAME_LOOMDATA, child_argv
from loomdata.execution._config import DEFAULT_WORKERS, Timings
from loomdata.execution._dask_client import new_client
from loomdata.execution._security import TLS_DIR, TlsFiles, security_of
from loomdata.schemas.errors import ExecutionError

__all__ = [
    "INSECURE_WARNING",
    "PROFILE_KEY",
    "WORKER_ARROW_POOL",
    "check_insecure_allowed",
    "connect",
    "embedded_worker_config",
    "open_cluster",
    "tls_apart",
    "worker_env",
]

INSECURE_WARNING = (
    "loomdata: WARNING: --insecure: plain TCP without authentication; any local process of any user "
    "that reaches the scheduler port can run code in the workers and in this process"
)


def connect(
    scheduler: str,
    *,
    timeout: float = Timings().connect_timeout_s,
    set_as_default: bool = True,
    security: Security | None = None,
) -> Client:
    """A Client talking to workers directly (actor results never go through the scheduler)."""
    return new_client(
        scheduler, timeout=timeout, direct_to_workers=True, set_as_default=set_as_default, security=security
    )


@contextlib.contextmanager
def open_cluster(
    scheduler: str | None = None,
    *,
    n_workers: int = DEFAULT_WORKERS,
    local_directory: str | Path | None = None,
    connect_timeout_s: float = Timings().connect_timeout_s,
    tls: TlsFiles | None = None,
    tls_dir: str | Path | None = None,
    insecure: bool = False,
    dashboard: bool = False,
) -> Iterator[Client]:
    """Yield a Client: connected to `scheduler`, or to an embedded LocalCluster of `n_workers` processes.

    `n_workers` 0: one worker thread inside this process (`IN_PROCESS`: one copy of the imports, no worker
    process; a worker cannot be lost alone, so recovery has nothing to do); set
    `ARROW_DEFAULT_MEMORY_POOL=jemalloc` before this process starts for its memory (`_use_worker_pool_here`).

    The embedded cluster binds to 127.0.0.1, uses one thread per worker, keeps its scratch files in
    `local_directory` (a fresh temporary folder, removed afterwards, when not given) and uses TLS:
    `tls` if given, else fresh credentials written to `tls_dir` (default: LOCAL_DIRECTORY/.loom-tls;
    folder 0700, files 0600). A `scheduler` needs `tls` (the user's credentials). The
    dashboard is off unless `dashboard`, then on loopback. `insecure`: plain TCP, with a warning.
    Scripts that call this without a scheduler need an `if __name__ == "__main__":` guard.
    """
    if insecure:
        check_insecure_allowed()
        print(INSECURE_WARNING, file=sys.stderr, flush=True)
    if scheduler:
        security = None if insecure else security_of(_needs_tls(scheduler, tls))
        if security is not None and "://" not in scheduler:
            scheduler = f"tls://{scheduler}"
        client = connect(scheduler, timeout=connect_timeout_s, security=security)
        try:
            yield client
        finally:
            client.close()
        return
    with contextlib.ExitStack() as stack:
        if local_directory is None:
            local_directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="loom-dask-"))
        Path(local_directory).mkdir(parents=True, exist_ok=True)
        security = None
        if not insecure:
            folder = Path(tls_dir) if tls_dir is not None else Path(local_directory) / TLS_DIR
            security = security_of(tls or tls_apart(folder))
        in_process = n_workers == IN_PROCESS
        if in_process:
            _use_worker_pool_here()
        stack.enter_context(dask.config.set(embedded_worker_config(dashboard=dashboard)))
        cluster = stack.enter_context(
            LocalCluster(
                n_workers=1 if in_process else n_workers,
                threads_per_worker=1,
                processes=not in_process,
                host="127.0.0.1",
                protocol="tcp://" if insecure else "tls://",
                security=security,
                dashboard_address="127.0.0.1:0" if dashboard else None,
                # without a dashboard the scheduler still serves Dask's HTTP routes (health, metrics): on a
                # free loopback port, not on 8787 (taken by any other cluster on the host: a warning each start)
                scheduler_kwargs=None if dashboard else {"dashboard_address": "127.0.0.1:0"},
                local_directory=str(local_directory),
                **({} if in_process else {"env": worker_env()}),
            )
        )
        client = stack.enter_context(Client(cluster, direct_to_workers=True, security=security))
        if dashboard:
            print(f"loomdata: Dask dashboard at {client.dashboard_link}", file=sys.stderr, flush=True)
        yield client


_MAKE_TLS = (
    SAME_LOOMDATA
    + """
import pathlib
from loomdata.execution._security import embedded_tls
embedded_tls(pathlib.Path(sys.argv[2]))
"""
)
TLS_CHILD_TIMEOUT_S = 60.0
"""The most seconds the child interpreter that makes an embedded cluster's credentials may take."""

_NOT_WRITABLE = ("PermissionError", "Read-only file system", "Not a directory", "Is a directory", "FileExistsError")
"""What a child's error says when the folder, not the interpreter, is the problem."""


def tls_apart(folder: Path) -> TlsFiles:
    """`_security.embedded_tls(folder)` run in a short-lived child interpreter: the same files in `folder`.

    Making certificates imports `cryptography` (and its OpenSSL bindings): 3.0 MiB of anonymous memory that
    the serving process would keep for its whole run to use once at start (benchmarks/memory.py's serving
    process; the child, which imports no Dask, takes about 0.1-0.2 s). Only the files' paths come back;
    `cryptography` is never imported here (Dask's TLS contexts then load the files as they would any).
    """
    where = f"the embedded cluster's TLS credentials in {folder}"
    try:
        subprocess.run(
            child_argv(_MAKE_TLS, str(folder)),
            check=True,
            capture_output=True,
            text=True,
            timeout=TLS_CHILD_TIMEOUT_S,
        )
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or "").strip().splitlines()
        last = lines[-1] if lines else f"exit status {e.returncode}"
        hint = (
            "check that the folder can be created and written"
            if any(k in last for k in _NOT_WRITABLE)
            else "drop the other loomdata from PYTHONPATH"
            if "imported loomdata from" in last
            else "check that `cryptography` imports in this environment"
        )
        raise ExecutionError(
            f"making {where} failed: {last}; {hint}, or pass your own with --tls-ca-file, --tls-cert and --tls-key"
        ) from None
    except subprocess.TimeoutExpired:
        raise ExecutionError(
            f"making {where} took more than {TLS_CHILD_TIMEOUT_S:.0f} s in a child interpreter "
            f"({sys.executable}); pass your own with --tls-ca-file, --tls-cert and --tls-key"
        ) from None
    except OSError as e:
        raise ExecutionError(f"could not start a Python interpreter ({sys.executable}) to make {where}: {e}") from None
    return TlsFiles(*(str(folder / name) for name in ("ca.pem", "cert.pem", "key.pem")))


IN_PROCESS = 0
"""`n_workers` of the layout without worker processes: the worker runs as a thread of the serving process."""


def _use_worker_pool_here() -> None:
    """Arrow's allocator of the workers (`worker_env`) for this process, where the worker thread runs in it.

    Only in part: allocations Arrow set up at import keep the allocator chosen then (mimalloc by default),
    whose freed pages stay as huge pages (300 sources: 809 MiB warm against 405 with
    `ARROW_DEFAULT_MEMORY_POOL=jemalloc` set before the process started; benchmarks/memory.py).
    """
    import pyarrow as pa

    chosen = worker_env().get("ARROW_DEFAULT_MEMORY_POOL")
    if chosen == "jemalloc" and pa.default_memory_pool().backend_name != "jemalloc":
        pa.set_memory_pool(pa.jemalloc_memory_pool())


def worker_env() -> dict[str, str]:
    """Environment set in each embedded worker process before it imports pyarrow: Arrow's allocator,
    `WORKER_ARROW_POOL` unless the user chose one (`_arrow_pool`; a pool this serving process got from
    `choose_before_import` is not the workers'). Empty where this pyarrow build has no jemalloc and the user
    set nothing: Arrow's default stays.

    Arrow's default, mimalloc, keeps per-thread heaps whose freed pages stay resident (as transparent huge
    pages where the kernel allows): the two workers serving 300 sources to 16 ranks held 1,871 MiB with it
    and 942 MiB with jemalloc, which returns freed pages after its decay time (benchmarks/memory.py, warm).
    With jemalloc, also its options (`_arrow_pool.WORKER_JEMALLOC_CONF`) unless the user set `JE_ARROW_MALLOC_CONF`.
    """
    chosen = user_pool()
    if chosen is None:
        import pyarrow as pa

        try:
            pa.jemalloc_memory_pool()
        except NotImplementedError:
            return {}
        chosen = WORKER_ARROW_POOL
    return {"ARROW_DEFAULT_MEMORY_POOL": chosen, **(jemalloc_conf_env() if chosen == "jemalloc" else {})}


PROFILE_KEY = "distributed.worker.profile.enabled"
"""Dask's statistical profiler of worker threads (feeds the dashboard's Profile page and `Client.profile`)."""


TICK_KEY = "distributed.admin.tick.interval"
SYSTEM_MONITOR_KEY = "distributed.admin.system-monitor.interval"
QUIET_PERIODS = {
    TICK_KEY: "1s",  # Dask: 20ms
    "distributed.worker.memory.monitor-interval": "500ms",  # Dask: 100ms
    SYSTEM_MONITOR_KEY: "2s",  # Dask: 500ms
}
"""Periods of Dask's housekeeping callbacks in the embedded cluster (`embedded_worker_config`)."""

DASHBOARD_PERIODS = frozenset({TICK_KEY, SYSTEM_MONITOR_KEY})
"""`QUIET_PERIODS`' keys left at Dask's period when the dashboard is on: its event-loop and system plots read them."""


def embedded_worker_config(*, dashboard: bool) -> dict[str, Any]:
    """Dask config set while the embedded cluster runs (the nannies hand it to the workers they start; the
    in-process layout's worker reads it in this process).

    - `distributed.worker.profile.enabled` False unless `dashboard` or the user configured the key (Dask's
      config files or DASK_* variables). The profiler samples the stacks of the worker's task threads every 10 ms
      and keeps an hour of per-second profiles; reading each sampled frame's source line fills `linecache` with
      whole source files (2.4-2.6 MiB a worker serving 300 sources, tracemalloc, benchmarks/memory.py). Nothing
      of loomdata reads the profiles; the dashboard's Profile page does, so `dashboard` keeps them. A value set in
      code with `dask.config.set` is not seen as the user's (set the key in a config file or DASK_* variable), and
      the False holds in this process's Dask config for as long as the embedded cluster runs.
    - Dask's periodic housekeeping slower, each unless the user configured its key (`QUIET_PERIODS`; config files or
      DASK_* variables, hyphens or underscores): with Dask's periods the embedded cluster (2 workers) costs a fixed
      CPU a second idle or serving a plan nobody takes from, whatever a delivery moves (benchmarks/cluster_idle.py,
      results/cluster_idle_s22*.json). The event-loop tick (20 ms) feeds "event loop unresponsive" warnings (the
      tick's duration includes its period: a block is warned of past the 3 s limit less the period) and the
      heartbeats' event-loop interval; the memory monitor (100 ms; 500 ms here) watches for spill, pause and the
      nanny's terminate threshold, so a runaway worker can overshoot by up to 0.5 s of allocation; the system monitor
      (500 ms) feeds heartbeats' metrics. The dashboard plots the tick and the system monitor, so `dashboard` keeps
      their periods (`DASHBOARD_PERIODS`). Set process-wide while the embedded cluster runs: another Dask server
      started in this process meanwhile gets the same periods.
    """
    config: dict[str, Any] = {}
    if not dashboard and not _user_configured(PROFILE_KEY):
        config[PROFILE_KEY] = False
    for key, period in QUIET_PERIODS.items():
        if not (dashboard and key in DASHBOARD_PERIODS) and not _user_configured(key):
            config[key] = period
    return config


def _user_configured(key: str) -> bool:
    """Whether `key` (dotted) is set in the user's Dask config files or DASK_* environment variables."""
    node: Any = dask.config.collect()
    for part in key.split("."):
        if not isinstance(node, dict):
            return False
        name = dask.config.canonical_name(part, node)  # `system-monitor` finds a DASK_* variable's `system_monitor`
        if name not in node:
            return False
        node = node[name]
    return True


def check_insecure_allowed() -> None:
    """ExecutionError when plain TCP is asked for while Dask's config requires encryption."""
    if dask.config.get("distributed.comm.require-encryption", False):
        raise ExecutionError(
            "--insecure conflicts with Dask's distributed.comm.require-encryption setting; drop --insecure "
            "(loomdata uses TLS by default) or unset DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"
        )


def _needs_tls(scheduler: str, tls: TlsFiles | None) -> TlsFiles:
    if scheduler.startswith("tcp://"):
        raise ExecutionError(
            f"scheduler {scheduler} speaks plain TCP; loomdata connects with TLS only: start the scheduler with "
            "TLS (`loom certs DIR` makes the certificates) or pass --insecure"
        )
    if tls is None:
        raise ExecutionError(
            f"connecting to scheduler {scheduler} needs TLS credentials: pass --tls-ca-file, --tls-cert and "
            "--tls-key (or LOOM_TLS_CA_FILE, LOOM_TLS_CERT, LOOM_TLS_KEY; `loom certs DIR` makes them), "
            "or --insecure for a plain-TCP scheduler"
        )
    return tls
