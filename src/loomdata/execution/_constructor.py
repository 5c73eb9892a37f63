"""The Data Constructor actor: builds a group of ranks' micro-batches a bounded window ahead.

A thin actor wiring three parts: the pure step window (`_window.StepWindow`: per rank `want`, held
steps and their takes, what to build, when to release or jump), the read/route protocol
(`_reads.Reads`: routes per source, re-issuing reads a `set_routes` abandoned, retrying lost loaders)
and packing (`_pack_group.pack_joined`: a build group's batches in one pass, into one block). Its own
job is the event loop: start builds the window asks for, let takes wait on them, record metrics.

State is rebuildable from the plan and a step number. A constructor recreated after its worker died
(`_recovery`) starts empty: the ranks' next takes name their steps, which it builds on demand or moves
the window to, so nothing is skipped or repeated. Peers (tp/pp/cp ranks of one dp rank) take the same
batches; one read serves them all (a take naming a `cp_rank` gets only that CP rank's shards of them).

Delivery in bulk: `take_steps` answers a step and every following step already held, up to the count
asked (a client asks for as many as keep its bytes in flight), in one call. Builds started together
are read together (`_window.build_groups`): one loader request per (loader, group of steps), each
segment naming its step, then packed together; a take's answer is a slice of that block (no copy
unless its steps come from two groups).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from loomdata.execution import _gateway
from loomdata.execution._heap import arrays_in_heap, maybe_trim
from loomdata.execution._manifest import ManifestSlice
from loomdata.execution._pack_group import StepPack, block_of, pack_joined
from loomdata.execution._packing import PackRules, peer_batches
from loomdata.execution._plan_meta import shared_plan
from loomdata.execution._reads import Reads, Route
from loomdata.execution._telemetry import TelemetryBuffer, valid_report
from loomdata.execution._window import Admission, Build, StepWindow, build_groups
from loomdata.execution.protocol import ExecutorUnavailable
from loomdata.schemas.batch import Batch, BatchBlock
from loomdata.schemas.context_parallel import cp_group_check
from loomdata.schemas.errors import ExecutionError, LoomError
from loomdata.schemas.metrics import BuildPhases, ConstructorMetrics, StepTelemetry

__all__ = ["DataConstructor", "Route"]

_MANIFEST_CHUNK = 32  # manifest steps read at a time, at least
_MANIFEST_CHUNK_ROWS = 1 << 17  # ... or as many as hold about this many of the group's rows (a few MiB)


@dataclass
class _Stats:
    built_steps: int = 0
    on_demand_steps: int = 0
    batches_taken: int = 0
    build_s: float = 0.0
    manifest_s: float = 0.0
    loaders_s: float = 0.0
    pack_s: float = 0.0
    wait_s: dict[int, float] = field(default_factory=dict)
    takes: dict[int, int] = field(default_factory=dict)


class DataConstructor:
    """Dask actor serving `take(dp_rank, step)`, `take_steps` / `take_block` (several steps) for a group of dp ranks."""

    def __init__(
        self,
        plan_dir: str,
        ranks: list[int],
        routes: dict[int, Route],
        window: int = 2,
        peers: int = 1,
        start_step: int = 0,
    ) -> None:
        arrays_in_heap()
        self._meta = shared_plan(plan_dir)  # a PlanView: no pydantic in a worker
        self._rules = PackRules.of(self._meta.spec)
        self._window: StepWindow[StepPack] = StepWindow(ranks, self._meta.steps, window, peers, start_step)
        self._ranks = self._window.ranks
        self._reads = Reads(routes, self._meta.plan_id)
        chunks = {"chunk_steps": _MANIFEST_CHUNK, "chunk_rows": _MANIFEST_CHUNK_ROWS}
        self._manifest = ManifestSlice(plan_dir, self._meta, self._ranks, **chunks, keep_steps=self._window.window)
        self._done: dict[int, asyncio.Future[None]] = {}  # Build.id -> resolved when that build ends
        self._tasks: set[asyncio.Task[None]] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loom-constructor")
        self._stats = _Stats(wait_s={r: 0.0 for r in self._ranks}, takes={r: 0 for r in self._ranks})
        self._telemetry = TelemetryBuffer.of(self._meta)

    # ---- public actor methods -------------------------------------------------------------------

    async def start(self) -> list[int]:
        """Begin building the first window of steps; returns the ranks served."""
        self._launch(self._window.start())
        return self._ranks

    async def take(
        self,
        dp_rank: int,
        step: int,
        telemetry: list[tuple[int, float]] | None = None,
        cp_rank: int | None = None,
    ) -> list[Batch]:
        """All micro-batches of `dp_rank` at `step`, in order (waits while they are being built).

        `telemetry`: (step, seconds) the rank measured for earlier steps, riding on this take; kept
        for `drain_telemetry` (an invalid pair is dropped, never fails the take). `cp_rank`: the
        taker is that CP peer of the dp rank and receives only its shards (`_packing.peer_batches`);
        None: the whole micro-batches.
        """
        return (await self._take_one(dp_rank, step, telemetry, cp_rank, None)).batches

    async def _take_one(
        self,
        dp_rank: int,
        step: int,
        telemetry: list[tuple[int, float]] | None,
        cp_rank: int | None,
        deferred: list[Build] | None,
    ) -> StepPack:
        """`take`; the builds its release starts go to `deferred` when given (the caller starts them)."""
        if cp_rank is not None:
            cp_group_check(self._meta, cp_rank)
        if dp_rank not in self._window.want:
            raise ExecutionError(f"dp rank {dp_rank} is not served by this constructor (ranks {self._ranks})")
        if not 0 <= step < self._meta.steps:
            raise ExecutionError(f"step {step} is outside plan {self._meta.plan_id} (steps 0..{self._meta.steps - 1})")
        if self._window.stopped:
            raise ExecutorUnavailable("the executor is stopping; reconnect to a running one")
        if telemetry:
            await self._record(dp_rank, telemetry)
        t0 = time.perf_counter()
        admission = self._window.admit(dp_rank, step)
        try:
            pack = await self._take(dp_rank, step, admission, deferred)
        finally:
            self._window.finish(dp_rank)
        self._stats.wait_s[dp_rank] += time.perf_counter() - t0
        return self._taken(dp_rank, pack, cp_rank)

    def _taken(self, rank: int, pack: StepPack, cp_rank: int | None) -> StepPack:
        """Count a take of `pack`; a CP peer's shards of it (the window holds whole batches: one read serves all)."""
        self._stats.takes[rank] += 1
        self._stats.batches_taken += len(pack)
        if cp_rank is None:
            return pack
        return StepPack(batches=peer_batches(self._meta, self._rules, pack.made(), cp_rank))  # the held pack stays thin

    async def take_steps(
        self,
        dp_rank: int,
        step: int,
        count: int,
        telemetry: list[tuple[int, float]] | None = None,
        cp_rank: int | None = None,
    ) -> list[list[Batch]]:
        """`step`'s micro-batches (as `take`), then those of each following step already built, up to `count` steps.

        The steps after the first are only the ones held now (never waited for), so the answer comes
        as soon as `step` is ready; each counts as a take of that step (released after `peers`).
        """
        return [p.made() for p in await self._take_packs(dp_rank, step, count, telemetry, cp_rank)]  # held: thin

    async def take_block(self, dp_rank: int, step: int, count: int, *more: Any, **cp: Any) -> BatchBlock:
        """`take_steps` as one `BatchBlock` (what clients call): slices of the blocks the steps were packed in."""
        return block_of(await self._take_packs(dp_rank, step, count, *more, **cp))

    async def _take_packs(
        self, dp_rank: int, step: int, count: int, telemetry: list[tuple[int, float]] | None = None, cp_rank: Any = None
    ) -> list[StepPack]:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ExecutionError(f"take_steps: count must be an int >= 1, got {count!r}")
        builds: list[Build] = []  # what these takes release: started together (one group of reads), also on errors
        try:
            out = [await self._take_one(dp_rank, step, telemetry, cp_rank, builds)]
            held, released = self._window.collect_run(dp_rank, step + 1, min(count, self._meta.steps - step) - 1)
            builds.extend(released)  # the steps after the first: held ones only, one release for them all
            # (counted as taken before `_taken` runs: it ran on the first step's pack already, so it does not raise)
            out.extend([self._taken(dp_rank, pack, cp_rank) for pack in held])
        finally:
            self._launch(tuple(builds))
            maybe_trim()  # released steps' arrays: their heap pages back to the OS (at most every 2 s, trailing)
        return out

    async def record_telemetry(self, dp_rank: int, telemetry: list[tuple[int, float]]) -> None:
        """Step times a rank sends without a take (its last steps, on close)."""
        if dp_rank in self._window.want:
            await self._record(dp_rank, telemetry)

    async def drain_telemetry(self) -> list[StepTelemetry]:
        """The step times recorded since the last drain (one per rank and step), emptying the buffer."""
        return self._telemetry.drain()

    async def set_routes(self, routes: dict[int, Route]) -> None:
        """Route sources (id -> route) to new sets of loaders (scaling, a recreated loader), all in one call.

        Reads in flight on the old routes are abandoned and asked again on the new ones: a read to a
        loader lost with its worker may never answer (Dask waits on the lost actor's future). One call for
        every source: a call each kept 300 idle connections between the serving process and this worker.
        """
        self._reads.set_routes(routes)

    async def metrics(self) -> ConstructorMetrics:
        """Queue depth (held batches), per-rank wait, build counters."""
        s, w = self._stats, self._window
        return ConstructorMetrics(
            ranks=list(self._ranks),
            queue_depth=sum(len(b) for b in w.held()),
            held_steps=len(w.held()),
            building_steps=w.building_steps,
            want=dict(w.want),
            built_steps=s.built_steps,
            on_demand_steps=s.on_demand_steps,
            loader_calls=self._reads.calls,
            read_retries=self._reads.retries,
            batches_taken=s.batches_taken,
            build_s=s.build_s,
            build_phases_s=BuildPhases(manifest=s.manifest_s, loaders=s.loaders_s, pack=s.pack_s),
            rank_wait_s=dict(s.wait_s),
            rank_takes=dict(s.takes),
        )

    async def open_gateway(self, name: str) -> _gateway.GatewayAddress | None:
        """Serve ranks' takes under `name` on this worker's gateway (`_gateway`): address and id (None: Dask only)."""
        return await _gateway.register(name, self)

    async def stop(self) -> None:
        """Cancel builds in flight and drop held batches."""
        _gateway.unregister(self)
        self._window.stop()
        for t in list(self._tasks):
            t.cancel()
        self._pool.shutdown(wait=False)

    async def _record(self, rank: int, reports: list[tuple[int, float]]) -> None:
        """Buffer a rank's measured step times with the segment lengths of those steps (from the manifest)."""
        await _record_reports(self._telemetry, self._manifest, self._pool, self._meta.steps, rank, reports)

    # ---- the window's builds --------------------------------------------------------------------

    async def _take(self, rank: int, step: int, admission: Admission, deferred: list[Build] | None = None) -> StepPack:
        self._launch(admission.builds)  # started at once: this take may wait on them
        if admission.error is not None:
            raise admission.error
        if admission.wait is not None:
            await asyncio.shield(self._done[admission.wait.id])
        got = self._window.collect(rank, step)
        if deferred is not None:
            deferred.extend(got.builds)
        else:
            self._launch(got.builds)
        if got.error is not None:
            raise got.error
        if got.payload is not None:
            return got.payload
        pack = (await self._build_many([(step, [rank])]))[0][rank]  # outside the window: built, not held
        self._stats.on_demand_steps += 1
        return pack

    def _launch(self, builds: tuple[Build, ...]) -> None:
        """Start the builds the window asked for, in groups read together; each resolves a future its takes wait on."""
        loop = asyncio.get_running_loop()
        for group in build_groups(builds, self._window.want, self._window.window):
            for b in group:
                self._done[b.id] = loop.create_future()
            task = asyncio.ensure_future(self._build_into_window(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _build_into_window(self, group: tuple[Build, ...]) -> None:
        try:
            built = await self._build_many([(b.step, list(b.ranks)) for b in group])
        except asyncio.CancelledError:
            for b in group:
                self._window.cancelled(b)
                self._done.pop(b.id).cancel()
            raise
        except Exception as e:  # reported to the takes of these builds, once each
            for b in group:
                err = e if isinstance(e, LoomError) else ExecutionError(f"building step {b.step}: {e}")
                self._window.failed(b, err)
        else:
            for b, payloads in zip(group, built, strict=True):
                self._window.built(b, payloads)
            self._stats.built_steps += len(group)
        for b in group:
            self._done.pop(b.id).set_result(None)

    async def _build_many(self, work: list[tuple[int, list[int]]]) -> list[dict[int, StepPack]]:
        """Build several (step, ranks) with one loader request per (source, partition) for all of them."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        if all(self._manifest.cached(step) for step, _ in work):
            rows, bounds = self._manifest.rows_of(work)  # the steps' rows end to end
        else:  # reading a manifest chunk is file I/O: off the event loop
            rows, bounds = await loop.run_in_executor(self._pool, self._manifest.rows_of, work)
        t1 = time.perf_counter()
        joined = await self._reads.read_steps([step for step, _ in work], rows)
        t2 = time.perf_counter()
        out = pack_joined(self._meta, self._rules, work, rows, bounds, joined)  # one vectorised pass, one block
        t3 = time.perf_counter()
        s = self._stats
        s.build_s += t3 - t0
        s.manifest_s += t1 - t0
        s.loaders_s += t2 - t1
        s.pack_s += t3 - t2
        return out


async def _record_reports(
    telemetry: TelemetryBuffer,
    manifest: ManifestSlice,
    pool: ThreadPoolExecutor,
    steps: int,
    rank: int,
    reports: list[tuple[int, float]],
) -> None:
    """Add each valid (step, seconds) of `rank` to `telemetry` with that step's manifest rows; count others dropped."""
    for item in reports:
        step, secs = item if isinstance(item, (tuple, list)) and len(item) == 2 else (None, None)
        if not valid_report(step, secs, steps):
            telemetry.dropped += 1
            continue
        step = int(step)
        try:
            if manifest.cached(step):
                rows = manifest.rows(step, [rank])
            else:  # an older chunk: file I/O, off the event loop
                rows = await asyncio.get_running_loop().run_in_executor(pool, manifest.rows, step, [rank])
        except Exception:  # telemetry is best effort: a failing read fails the builds, not this take
            telemetry.dropped += 1
            continue
        telemetry.add(rank, step, float(secs), rows)
