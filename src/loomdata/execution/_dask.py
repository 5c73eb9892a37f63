"""The Dask internals loomdata relies on, in one place (each is a private attribute of `distributed.Actor`).

distributed has no public way to ask where an actor lives or to reach an actor's object from inside
its own worker; both are needed (ServeInfo says where each actor runs, metrics sum RSS per worker,
and a constructor reads from a loader on its own worker without an RPC). If a distributed release
renames these attributes, only this module changes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["actor_worker", "local_instance"]


def actor_worker(actor: Any) -> str:
    """The address of the worker that holds `actor` (a `distributed.Actor` handle)."""
    return str(actor._address)  # Actor._address: set when the handle is made; no RPC


def local_instance(actor: Any) -> Any:
    """The object behind `actor` when it lives in this worker process, else None."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:  # not on a worker (a test calling a constructor directly)
        return None
    if getattr(actor, "_address", None) != worker.address:
        return None
    return worker.state.actors.get(actor.key)  # WorkerState.actors: the worker's actor objects by key
