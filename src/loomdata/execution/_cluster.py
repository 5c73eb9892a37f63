"""Cluster handling: an embedded LocalCluster of worker processes, or a connection to a running one."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from distributed import Client, LocalCluster

from loomdata.execution._config import DEFAULT_WORKERS, Timings

__all__ = ["connect", "open_cluster"]


def connect(scheduler: str, *, timeout: float = Timings().connect_timeout_s, set_as_default: bool = True) -> Client:
    """A Client talking to workers directly (actor results never go through the scheduler)."""
    return Client(scheduler, timeout=timeout, direct_to_workers=True, set_as_default=set_as_default)


@contextlib.contextmanager
def open_cluster(
    scheduler: str | None = None,
    *,
    n_workers: int = DEFAULT_WORKERS,
    local_directory: str | Path | None = None,
    connect_timeout_s: float = Timings().connect_timeout_s,
) -> Iterator[Client]:
    """Yield a Client: connected to `scheduler`, or to an embedded LocalCluster of `n_workers` processes.

    The embedded cluster binds to 127.0.0.1, uses one thread per worker, and keeps its scratch files in
    `local_directory` (a fresh temporary folder, removed afterwards, when not given). Scripts that call
    this without a scheduler need an `if __name__ == "__main__":` guard (workers are spawned).
    """
    if scheduler:
        client = connect(scheduler, timeout=connect_timeout_s)
        try:
            yield client
        finally:
            client.close()
        return
    with contextlib.ExitStack() as stack:
        if local_directory is None:
            local_directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="loom-dask-"))
        Path(local_directory).mkdir(parents=True, exist_ok=True)
        cluster = stack.enter_context(
            LocalCluster(
                n_workers=n_workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address="127.0.0.1:0",  # HTTP routes only (no bokeh), on a free local port
                local_directory=str(local_directory),
            )
        )
        client = stack.enter_context(Client(cluster, direct_to_workers=True))
        yield client
