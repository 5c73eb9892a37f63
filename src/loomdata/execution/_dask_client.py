"""A Dask Client whose failed construction leaves nothing behind for a later garbage collection; the workers
a cluster has now, asked of its scheduler.

A Client whose constructor raised stays alive in a reference cycle through the error's traceback. When a
later collection frees it, its `__del__` closes it; if that happens while another Client starts its IO loop
(a retry), both wait on Dask's class-wide `LoopRunner` lock and the process hangs. So the error is kept
without its frames and the half-built Client is collected at once, before anything else starts a loop.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["live_workers", "new_client"]


def new_client(address: str, **kwargs: Any) -> Client:
    """`distributed.Client(address, **kwargs)`; its error (if any) is raised without the half-built Client."""
    from distributed import Client

    try:
        return Client(address, **kwargs)
    except Exception as e:
        error: BaseException | None = e
        seen: set[int] = set()
        while error is not None and id(error) not in seen:  # the chain's tracebacks hold the Client's frames
            seen.add(id(error))
            error.with_traceback(None)
            error = error.__cause__ or error.__context__
        failed = e
    gc.collect()
    raise failed


def live_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The cluster's workers now, address -> the scheduler's entry for it (`nthreads`, `id`, ...), asked of the
    scheduler itself.

    Not `client.scheduler_info()["workers"]`: that refreshes the Client's cached identity and returns the cache,
    which the Client's periodic refresh (every `distributed.client.scheduler-info-interval`) overwrites with an
    identity of no workers (distributed 2026.8 asks for `n_workers=0` there), so a call racing it sees an empty
    cluster (79 of 2,000 calls at a 5 ms interval; at the default 2 s an Executor once refused to start in CI:
    "has no workers")."""
    info = client.sync(client.scheduler.identity, n_workers=-1)
    return dict(info.get("workers", {}))
