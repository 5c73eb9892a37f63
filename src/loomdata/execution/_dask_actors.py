"""The one place that reads Dask actor internals: a handle's worker address and a worker's live actors.

Why: Dask routes an actor call through an RPC even between two actors of one worker process (when
called from the event loop), so a constructor reading from a loader on its own worker pays both ends
of a round trip for nothing; calling the local instance skips it. Dask has no public API for either
fact (distributed 2026.8: `Actor._address`, set in `Actor.__init__` and pickled by `__reduce__`;
`Worker.state.actors`, key -> instance). If Dask renames them, `local_instance` returns None and reads
take the RPC path: slower, still correct. `actor_address` then returns None.

Creation: a constructor gets its routes by `set_routes` once created, never as task arguments. Handles
in a task's arguments become its dependencies (an `Actor` is a `TaskRef`), and the scheduler keeps the
task's arguments for the task's life: with the embedded scheduler they are live handles holding futures
of their loaders, so every loader a constructor started with stayed on its worker after a resize.

`release(handles)`: every handle holds its own `Future` of the actor's key (`Actor._future`, made when
the handle is unpickled where a client is reachable), so a replaced loader stays on its worker while any
stale handle object lives, and handles caught in reference cycles live until a garbage collection.
Retiring releases those futures at once; a handle's methods still work (they do not need the future).

`detach(handles)`: a constructor's loader handles hold no key reference at all (the serving process's
fleet holds the one that keeps a loader alive). Why: a handle refuses every call once its future is
not pending or finished, and a worker's client that loses its scheduler connection for a moment (a
busy machine) cancels every future it holds when it reconnects, so its constructor's handles refused
every read of live loaders until the read deadline (seen with 300 sources and 16 ranks on 2 cores).
A detached handle calls the loader's worker directly; a dead worker shows as a failed call instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["actor_address", "detach", "local_instance", "release", "worker_actor"]


def actor_address(actor: Any) -> str | None:
    """The address of the worker holding `actor` (a `distributed.Actor` handle), None if unknown."""
    address = getattr(actor, "_address", None)
    return str(address) if address is not None else None


def local_instance(actor: Any) -> Any:
    """The object behind `actor` when it lives in this worker process, else None (call it remotely)."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:  # not on a worker (a test calling a constructor directly)
        return None
    if actor_address(actor) != worker.address:
        return None
    return worker_actor(worker, actor.key)


def worker_actor(worker: Any, key: str) -> Any:
    """The live actor instance `worker` holds under `key`, else None (released, or never held there)."""
    actors = getattr(getattr(worker, "state", None), "actors", None)
    return actors.get(key) if actors is not None else None


def release(handles: Iterable[Any]) -> None:
    """Drop the key reference each of these `distributed.Actor` handles holds (idempotent)."""
    for h in handles:
        fut = getattr(h, "_future", None)
        if fut is not None and hasattr(fut, "release"):
            fut.release()


def detach(handles: Iterable[Any]) -> None:
    """Release each handle's key reference and stop it checking that future's status (see above)."""
    for h in handles:
        bind = getattr(h, "_try_bind_worker_client", None)
        if bind is not None:  # a handle binds (and makes a future) at its first call unless bound already
            bind()
        release([h])
        if getattr(h, "_future", None) is not None:
            h._future = None
