"""The read/route protocol of a Data Constructor: where each source is read, and reads that survive re-routing.

Re-routing (scaling, recovery) is race-free without pauses: `set_route` swaps a source's route in one
step on the actor's event loop and bumps the route generation. Any loader read gives the true tokens
of its samples, so an answer is always usable, whichever route it came from. A read still in flight
when the route changes is abandoned and asked again on the new route (a read to a loader lost with
its worker may never answer: Dask waits on the lost actor's future). Every failed read is sorted by
`_outcome.sort_read_failure`: a data error (LoomError) fails the step at once; a read refused because it was issued on
a replaced route (a retired loader's `LoaderRetired`, a released actor) is asked again at once on the
current route; a lost loader (its worker died) is retried with a short back-off, woken early by the
next `set_route`, until `deadline_s`: the executor recreates lost loaders and swaps the route within
seconds, and the plan makes any read repeatable. The executor retires old loaders only after every
live constructor acknowledged the new route, so no read is issued to a retired loader after that.

`read_steps` reads several steps' rows with one request per (source, partition) for all of them; the answers stay
whole (for the rows end to end): packing lays a group's steps out in one block from them, and cuts them per step
only where images need `pack_step` (`_pack_group.split_answers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loomdata.execution._dask_actors import detach, local_instance
from loomdata.execution._loader import REQUEST_DTYPE, SegmentData
from loomdata.execution._loader_link import NotServed, link_for
from loomdata.execution._manifest import ManifestRows
from loomdata.execution._outcome import Kind, sort_read_failure
from loomdata.execution._partition import LoaderPartition
from loomdata.schemas.errors import ExecutionError

__all__ = ["READ_DEADLINE_S", "Answers", "Reads", "Route"]

READ_DEADLINE_S = 60.0
"""How long a read waits for lost loaders to be recreated before the step fails."""

Answers = tuple[list[np.ndarray], list[SegmentData]]
"""Loader answers for some manifest rows: (row indices per request, answer per request)."""


@dataclass(frozen=True, slots=True)
class Route:
    """Where one source's samples are read: partition sample ranges and the loader actor of each."""

    partitions: list[LoaderPartition]
    loaders: list[Any]  # distributed.Actor of SourceLoader, one per partition

    def part_of(self, samples: np.ndarray) -> np.ndarray:
        """Partition index per sample (searchsorted over partition first samples)."""
        starts = np.array([p.first_sample for p in self.partitions], dtype=np.uint64)
        return np.searchsorted(starts, samples, side="right") - 1


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned future's outcome, so asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


class Reads:
    """The routes of every source, their generation, and `read(step, rows)` across re-routes."""

    def __init__(self, routes: Mapping[int, Route], plan_id: str, deadline_s: float = READ_DEADLINE_S) -> None:
        self.routes = dict(routes)
        for route in self.routes.values():
            detach(route.loaders)
        self.generation = 0  # bumped by every `set_route`
        self.calls = 0  # loader calls issued
        self.retries = 0  # reads asked again (re-routed, refused, or unreachable)
        self._plan_id = plan_id
        self._deadline_s = deadline_s
        self._rerouted: asyncio.Event | None = None  # set (and replaced) by `set_route`; made on the loop

    def set_route(self, source_id: int, route: Route) -> None:
        """Route a source to new loaders; wakes every read in flight or backing off on the old routes."""
        self.set_routes({source_id: route})

    def set_routes(self, routes: Mapping[int, Route]) -> None:
        """Route several sources at once (one wake-up of the reads in flight for all of them)."""
        for route in routes.values():
            detach(route.loaders)  # no key references here: the fleet's keep loaders alive (see `_dask_actors`)
        self.routes.update(routes)
        self.generation += 1
        if self._rerouted is not None:
            self._rerouted.set()
        self._rerouted = asyncio.Event()

    async def read_steps(self, steps: Sequence[int], rows: ManifestRows) -> Answers:
        """The answers for several steps' rows laid end to end (`ManifestSlice.rows_of`), with one request per
        (source, partition) for all of them; not cut per step (a Python step per answer and step, session 26: 3 ms a
        call of ~230 steps, the constructor's largest term on long plans)."""
        return await self._read(f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}", rows)

    async def read(self, step: int, rows: ManifestRows) -> Answers:
        """All loader answers for `rows`, as (row indices per request, answer per request)."""
        return await self._read(f"step {step}", rows)

    async def _read(self, what: str, rows: ManifestRows) -> Answers:
        deadline = time.monotonic() + self._deadline_s
        attempt = 0
        while True:
            if self._rerouted is None:
                self._rerouted = asyncio.Event()
            rerouted, gen = self._rerouted, self.generation  # the routes this attempt uses
            try:
                answer = await self._attempt(rows, rerouted)
            except Exception as e:
                if sort_read_failure(e, stale=gen != self.generation) is Kind.ERROR:
                    raise
                if time.monotonic() >= deadline:
                    raise ExecutionError(
                        f"{what}: source loaders stayed unreachable for {self._deadline_s:g}s, "
                        f"{attempt + 1} attempts (last: {type(e).__name__}: {e}); check the workers, "
                        "or restart `loom serve`"
                    ) from e
                attempt += 1
                self.retries += 1
                if gen == self.generation:  # nothing changed yet: back off until the route changes
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(rerouted.wait(), timeout=min(0.1 * attempt, 1.0))
                continue
            if answer is not None:
                return answer
            attempt += 1  # routes changed under the read: ask the new loaders at once
            self.retries += 1

    async def _attempt(
        self, rows: ManifestRows, rerouted: asyncio.Event
    ) -> tuple[list[np.ndarray], list[SegmentData]] | None:
        """One round of requests; None if the routes changed before every answer came back."""
        groups, calls = self._requests(rows)  # a lost loader's handle may refuse the call right here
        self.calls += len(calls)
        gathered: asyncio.Future[list[SegmentData]] = asyncio.ensure_future(asyncio.gather(*calls))
        woke: asyncio.Future[Any] = asyncio.ensure_future(rerouted.wait())
        try:
            first: list[asyncio.Future[Any]] = [gathered, woke]
            await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
            return (groups, list(gathered.result())) if gathered.done() else None
        finally:  # also when the build is cancelled (stop): no read or wait outlives it
            woke.cancel()
            if not gathered.done():
                gathered.cancel()
                gathered.add_done_callback(_consume)

    def _requests(self, rows: ManifestRows) -> tuple[list[np.ndarray], list[Awaitable[SegmentData]]]:
        """One loader request per (source, partition) present in `rows`: (row indices, calls issued)."""
        groups: list[np.ndarray] = []
        targets: list[tuple[Any, np.ndarray]] = []
        for src in np.unique(rows.source).tolist():
            route = self.routes.get(int(src))
            if route is None:
                raise ExecutionError(f"no loader serves source id {src} of plan {self._plan_id}")
            idx = np.flatnonzero(rows.source == src)
            parts = route.part_of(rows.sample[idx])
            for p in np.unique(parts).tolist():
                sel = idx[parts == p]
                req = np.empty(len(sel), dtype=REQUEST_DTYPE)
                req["sample"] = rows.sample[sel]
                req["offset"] = rows.offset[sel]
                req["length"] = rows.length[sel]
                req["step"] = rows.step[sel]
                groups.append(sel)
                targets.append((route.loaders[int(p)], req))
        calls: list[Awaitable[SegmentData]] = []
        try:
            for loader, req in targets:
                calls.append(_call_read(loader, req))
        except Exception:
            for c in calls:  # calls made before one was refused: never awaited, close them
                if asyncio.iscoroutine(c):
                    c.close()
            raise
        return groups, calls


REMOTE_READS = 32
"""Loader reads to other workers in flight at once per worker process (each holds a connection)."""

_LIMITS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _call_read(loader: Any, request: np.ndarray) -> Awaitable[SegmentData]:
    """An awaitable loader read: a direct call when the loader lives in this worker process, over the loader
    link (`_loader_link`) when it lives on another worker of this host, else a Dask actor call.

    Dask routes actor calls through an RPC even between actors of one worker (from the event loop);
    calling the local instance saves both ends of that round trip. Remote reads through Dask are bounded per
    worker process (`REMOTE_READS`): a step over 300 sources is ~300 reads, and every concurrent Dask actor call
    opens a connection of its own, so unbounded fan-out from a few constructors opened hundreds of TLS
    connections at once, whose handshakes timed out on a loaded machine ("Unable to contact Actor's worker").
    A link is one connection per pair of workers, its reads unbounded.
    """
    local = local_instance(loader)
    if local is not None:
        return local.read(request)
    link = link_for(loader)
    if link is None:
        return _remote_read(loader, request)
    return _linked_read(link, loader, request)


async def _linked_read(link: Any, loader: Any, request: np.ndarray) -> SegmentData:
    """Read over `link` (or the future of one opening); through Dask where none opened or the loader is not there."""
    if isinstance(link, asyncio.Future):
        link = await link
    if link is not None:
        with contextlib.suppress(NotServed):
            answer: SegmentData = await link.read(loader.key, request)
            return answer
    return await _remote_read(loader, request)


async def _remote_read(loader: Any, request: np.ndarray) -> SegmentData:
    loop = asyncio.get_running_loop()
    limit = _LIMITS.get(loop)
    if limit is None:
        limit = _LIMITS[loop] = asyncio.Semaphore(REMOTE_READS)
    async with limit:
        answer: SegmentData = await loader.read(request)
        return answer
