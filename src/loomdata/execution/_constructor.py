"""The Data Constructor actor: builds a group of ranks' micro-batches a bounded window ahead.

State (rebuildable from the plan and a step number): the plan, its ranks, the routes to the
loaders, and per rank `want` = the first step not yet taken by all its peers. Steps
`[want, want + window)` of every rank are built ahead (one loader request per (loader, step) for
all ranks that need the step) and held until taken; memory is bounded by `window`, whatever the plan
size.

A constructor recreated after its worker died (`_recovery`) starts empty: the ranks' next takes name
their steps, which it builds on demand or moves the window to, so nothing is skipped or repeated.

Peers (tp/pp/cp ranks of one dp rank) take the same batches: a held step is released once `peers`
takes of it arrived, so one read serves them all. A take outside the window (a resume, a restarted
executor, a peer that fell behind after release) is built on demand and not held, so every take
succeeds; a take far ahead that nobody has consumed before it moves the rank's window there (resume).

Re-routing (scaling, recovery) is race-free without pauses: `set_route` swaps a source's route in one
step on the actor's event loop and bumps a route generation. Every read batch records the generation
it was issued under; any loader read gives the true tokens of its samples, so an answer is always
usable, whichever route it came from. A read still in flight when the route changes is abandoned and
asked again on the new route, and an error from a read issued under an older generation (a retired
loader's `LoaderRetired`, a released or lost actor) is retried at once on the current route rather
than counted as a failure. The executor retires old loaders only after every live constructor
acknowledged the new route, so no read is issued to a retired loader after that point.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loomdata.execution._loader import REQUEST_DTYPE, SegmentData
from loomdata.execution._manifest import ManifestRows, ManifestSlice
from loomdata.execution._packing import pack_batch
from loomdata.execution._partition import LoaderPartition
from loomdata.execution.protocol import ExecutorUnavailable
from loomdata.schemas.batch import SEGMENT_DTYPE, Batch
from loomdata.schemas.errors import ExecutionError, LoomError
from loomdata.schemas.plan import read_plan

__all__ = ["DataConstructor", "Route"]

_READ_RETRY_S = 60.0  # how long a read waits for lost loaders to be recreated before the step fails


@dataclass(frozen=True, slots=True)
class Route:
    """Where one source's samples are read: partition sample ranges and the loader actor of each."""

    partitions: list[LoaderPartition]
    loaders: list[Any]  # distributed.Actor of SourceLoader, one per partition

    def part_of(self, samples: np.ndarray) -> np.ndarray:
        """Partition index per sample (searchsorted over partition first samples)."""
        starts = np.array([p.first_sample for p in self.partitions], dtype=np.uint64)
        return np.searchsorted(starts, samples, side="right") - 1


def _local_instance(actor: Any) -> Any:
    """The object behind `actor` when it lives in this worker process, else None."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:  # not on a worker (a test calling a constructor directly)
        return None
    if getattr(actor, "_address", None) != worker.address:
        return None
    return worker.state.actors.get(actor.key)


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned future's outcome, so asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


@dataclass
class _Held:
    batches: list[Batch]
    takes: int = 0


@dataclass
class _Stats:
    built_steps: int = 0
    on_demand_steps: int = 0
    loader_calls: int = 0
    batches_taken: int = 0
    build_s: float = 0.0
    manifest_s: float = 0.0
    loaders_s: float = 0.0
    pack_s: float = 0.0
    read_retries: int = 0
    wait_s: dict[int, float] = field(default_factory=dict)
    takes: dict[int, int] = field(default_factory=dict)


class DataConstructor:
    """Dask actor serving `take(dp_rank, step)` for a contiguous group of dp ranks."""

    def __init__(
        self,
        plan_dir: str,
        ranks: list[int],
        routes: dict[int, Route],
        window: int = 2,
        peers: int = 1,
        start_step: int = 0,
    ) -> None:
        if window < 1 or peers < 1:
            raise ExecutionError(f"window and peers must be >= 1 (got window={window}, peers={peers})")
        self._meta = read_plan(plan_dir)
        self._image_token_id = self._meta.spec.images.placeholder_token_id
        self._ranks = sorted(ranks)
        self._routes = dict(routes)
        self._rerouted: asyncio.Event | None = None  # set (and replaced) by `set_route`; made on the loop
        self._route_gen = 0  # bumped by every `set_route`
        self._window = window
        self._peers = peers
        self._manifest = ManifestSlice(plan_dir, self._meta, self._ranks)
        self._want = {r: start_step for r in self._ranks}
        self._held: dict[tuple[int, int], _Held] = {}
        self._pending: dict[tuple[int, int], asyncio.Future[None]] = {}
        self._failed: dict[tuple[int, int], BaseException] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loom-constructor")
        self._stats = _Stats(wait_s={r: 0.0 for r in self._ranks}, takes={r: 0 for r in self._ranks})
        self._in_progress = {r: 0 for r in self._ranks}
        self._active: set[int] = set()  # ranks that have taken something: the group window follows them
        self._stopped = False

    # ---- public actor methods -------------------------------------------------------------------

    async def start(self) -> list[int]:
        """Begin building the first window of steps; returns the ranks served."""
        self._schedule()
        return self._ranks

    async def take(self, dp_rank: int, step: int) -> list[Batch]:
        """All micro-batches of `dp_rank` at `step`, in order (waits while they are being built)."""
        if dp_rank not in self._want:
            raise ExecutionError(f"dp rank {dp_rank} is not served by this constructor (ranks {self._ranks})")
        if not 0 <= step < self._meta.steps:
            raise ExecutionError(f"step {step} is outside plan {self._meta.plan_id} (steps 0..{self._meta.steps - 1})")
        if self._stopped:
            raise ExecutorUnavailable("the executor is stopping; reconnect to a running one")
        t0 = time.perf_counter()
        self._in_progress[dp_rank] += 1
        try:
            batches = await self._take(dp_rank, step)
        finally:
            self._in_progress[dp_rank] -= 1
        self._stats.wait_s[dp_rank] += time.perf_counter() - t0
        self._stats.takes[dp_rank] += 1
        self._stats.batches_taken += len(batches)
        return batches

    async def _take(self, dp_rank: int, step: int) -> list[Batch]:
        key = (dp_rank, step)
        self._active.add(dp_rank)
        self._maybe_jump(dp_rank, step)
        if key in self._failed:
            raise self._failed.pop(key)
        if key not in self._held and key not in self._pending and self._in_window(dp_rank, step):
            self._schedule(only_rank=dp_rank)
        fut = self._pending.get(key)
        if fut is not None:
            await asyncio.shield(fut)
            if key in self._failed:
                raise self._failed.pop(key)
        held = self._held.get(key)
        if held is not None:
            held.takes += 1
            batches = held.batches
            if held.takes >= self._peers:
                self._release(dp_rank, step)
        else:  # outside the window or already released: rebuild it from the plan, do not hold it
            batches = (await self._build(step, [dp_rank]))[dp_rank]
            self._stats.on_demand_steps += 1
        return batches

    async def set_route(self, source_id: int, route: Route) -> None:
        """Route a source's samples to a new set of loaders (scaling, a recreated loader).

        Reads in flight on the old routes are abandoned and asked again on the new ones: a read to a
        loader lost with its worker may never answer (Dask waits on the lost actor's future).
        """
        self._routes[source_id] = route
        self._route_gen += 1
        if self._rerouted is not None:
            self._rerouted.set()
        self._rerouted = asyncio.Event()

    async def metrics(self) -> dict[str, Any]:
        """Queue depth (held batches), per-rank wait, build counters."""
        s = self._stats
        return {
            "ranks": self._ranks,
            "queue_depth": sum(len(h.batches) for h in self._held.values()),
            "held_steps": len(self._held),
            "building_steps": len({k[1] for k in self._pending}),
            "want": {str(r): w for r, w in self._want.items()},
            "built_steps": s.built_steps,
            "on_demand_steps": s.on_demand_steps,
            "loader_calls": s.loader_calls,
            "read_retries": s.read_retries,
            "batches_taken": s.batches_taken,
            "build_s": round(s.build_s, 4),
            "build_phases_s": {
                "manifest": round(s.manifest_s, 4),
                "loaders": round(s.loaders_s, 4),
                "pack": round(s.pack_s, 4),
            },
            "rank_wait_s": {str(r): round(w, 4) for r, w in s.wait_s.items()},
            "rank_takes": {str(r): n for r, n in s.takes.items()},
        }

    async def stop(self) -> None:
        """Cancel builds in flight and drop held batches."""
        self._stopped = True
        for t in list(self._tasks):
            t.cancel()
        self._held.clear()
        self._pool.shutdown(wait=False)

    # ---- window bookkeeping ---------------------------------------------------------------------

    def _in_window(self, rank: int, step: int) -> bool:
        return self._want[rank] <= step < self._want[rank] + self._window

    def _maybe_jump(self, rank: int, step: int) -> None:
        """A take beyond the window while the rank is idle (nothing taken or being taken): move the window.

        That is a resume or a reconnect at a later step. With takes in progress (a client prefetching
        deeper than the window, a peer ahead of another) the window stays and the take is built on demand.
        """
        want = self._want[rank]
        if step < want + self._window or self._in_progress[rank] > 1:
            return
        if any(h.takes for (r, s), h in self._held.items() if r == rank and s < step):
            return
        self._want[rank] = step
        for key in [k for k in self._held if k[0] == rank and k[1] < step]:
            del self._held[key]
        self._schedule()

    def _release(self, rank: int, step: int) -> None:
        """All peers took `step`: free it and everything older of the rank, and build further ahead."""
        self._want[rank] = max(self._want[rank], step + 1)
        for key in [k for k in self._held if k[0] == rank and k[1] < self._want[rank]]:
            del self._held[key]
        self._schedule()

    def _schedule(self, only_rank: int | None = None) -> None:
        """Start builds for every (rank, step) in the window that is neither held nor being built.

        Steps are built for all ranks of the group at once (one loader request per (loader, step)),
        from the slowest rank that has taken anything (ranks nobody consumes do not hold the group
        back); `only_rank` builds one rank's window when it ran ahead of the group's slowest rank.
        """
        if self._stopped:
            return
        ranks = [only_rank] if only_rank is not None else self._ranks
        lead = [only_rank] if only_rank is not None else sorted(self._active) or self._ranks
        lo = min(self._want[r] for r in lead)
        hi = min(lo + self._window, self._meta.steps)
        for step in range(lo, hi):
            need = [
                r
                for r in ranks
                if self._in_window(r, step)
                and (r, step) not in self._held
                and (r, step) not in self._pending
                and (r, step) not in self._failed
            ]
            if not need:
                continue
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            for r in need:
                self._pending[(r, step)] = fut
            task = asyncio.ensure_future(self._build_into_window(step, need, fut))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _build_into_window(self, step: int, ranks: list[int], fut: asyncio.Future[None]) -> None:
        try:
            built = await self._build(step, ranks)
        except asyncio.CancelledError:
            for r in ranks:
                self._pending.pop((r, step), None)
            fut.cancel()
            raise
        except BaseException as e:
            err = e if isinstance(e, ExecutionError) else ExecutionError(f"building step {step}: {e}")
            for r in ranks:
                self._pending.pop((r, step), None)
                self._failed[(r, step)] = err
            fut.set_result(None)
            return
        for r in ranks:
            self._pending.pop((r, step), None)
            if step >= self._want[r]:
                self._held[(r, step)] = _Held(built[r])
        self._stats.built_steps += 1
        fut.set_result(None)

    # ---- building -------------------------------------------------------------------------------

    async def _build(self, step: int, ranks: list[int]) -> dict[int, list[Batch]]:
        """Read the segments of `step` for `ranks` from the loaders and pack every micro-batch."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        if self._manifest.cached(step):
            rows = self._manifest.rows(step, ranks)
        else:  # reading a manifest chunk is file I/O: off the event loop
            rows = await loop.run_in_executor(self._pool, self._manifest.rows, step, ranks)
        t1 = time.perf_counter()
        starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(rows.length, out=starts[1:])
        groups, answers = await self._read_all(step, rows)
        t2 = time.perf_counter()
        out = self._pack_step(step, ranks, rows, starts, groups, answers)  # vectorised, well under a ms per batch
        t3 = time.perf_counter()
        s = self._stats
        s.build_s += t3 - t0
        s.manifest_s += t1 - t0
        s.loaders_s += t2 - t1
        s.pack_s += t3 - t2
        return out

    async def _read_all(self, step: int, rows: ManifestRows) -> tuple[list[np.ndarray], list[SegmentData]]:
        """All loader answers for `rows`; retried on the current routes while a loader is unreachable.

        Data errors (a LoomError from a loader) fail at once. A lost loader (its worker died) refuses
        calls or never answers; the executor recreates it and swaps the route (`set_route`) within
        seconds, which abandons the reads in flight. An error from a read issued before the last
        `set_route` (a retired loader) is retried at once on the current route. Reads are retried for
        up to `_READ_RETRY_S`: the plan makes any read repeatable.
        """
        deadline = time.monotonic() + _READ_RETRY_S
        attempt = 0
        while True:
            if self._rerouted is None:
                self._rerouted = asyncio.Event()
            rerouted = asyncio.ensure_future(self._rerouted.wait())  # the event of the routes used below
            gathered: asyncio.Future[list[SegmentData]] | None = None
            gen = self._route_gen
            try:
                groups, calls = self._requests(rows)  # a lost loader's handle may refuse the call right here
                self._stats.loader_calls += len(calls)
                gathered = asyncio.ensure_future(asyncio.gather(*calls))
                await asyncio.wait([gathered, rerouted], return_when=asyncio.FIRST_COMPLETED)
                if gathered.done():
                    return groups, list(gathered.result())
                attempt += 1  # routes changed under the read: ask the new loaders at once
                self._stats.read_retries += 1
                continue
            except Exception as e:
                if gen != self._route_gen and time.monotonic() < deadline:  # issued on a replaced route
                    attempt += 1  # (a retired loader's LoaderRetired, a released actor): ask the new one now
                    self._stats.read_retries += 1
                    continue
                if isinstance(e, LoomError):
                    raise
                if time.monotonic() >= deadline:
                    raise ExecutionError(
                        f"step {step}: source loaders stayed unreachable for {_READ_RETRY_S:.0f}s, "
                        f"{attempt + 1} attempts (last: {type(e).__name__}: {e}); check the workers, "
                        "or restart `loom serve`"
                    ) from e
                attempt += 1
                self._stats.read_retries += 1
                await asyncio.sleep(min(0.1 * attempt, 1.0))
            finally:  # also when this build is cancelled (stop): no read or wait outlives it
                rerouted.cancel()
                if gathered is not None and not gathered.done():
                    gathered.cancel()
                    gathered.add_done_callback(_consume)

    def _read(self, loader: Any, request: np.ndarray) -> Any:
        """An awaitable loader read: a direct call when the loader lives in this worker process.

        Dask routes actor calls through an RPC even between actors of one worker (from the event
        loop); calling the local instance saves both ends of that round trip.
        """
        local = _local_instance(loader)
        return local.read(request) if local is not None else loader.read(request)

    def _requests(self, rows: ManifestRows) -> tuple[list[np.ndarray], list[Any]]:
        """One loader request per (source, partition) present in `rows`: (row indices, call futures)."""
        groups: list[np.ndarray] = []
        calls: list[Any] = []
        for src in np.unique(rows.source).tolist():
            route = self._routes.get(int(src))
            if route is None:
                raise ExecutionError(f"no loader serves source id {src} of plan {self._meta.plan_id}")
            idx = np.flatnonzero(rows.source == src)
            parts = route.part_of(rows.sample[idx])
            for p in np.unique(parts).tolist():
                sel = idx[parts == p]
                req = np.empty(len(sel), dtype=REQUEST_DTYPE)
                req["sample"] = rows.sample[sel]
                req["offset"] = rows.offset[sel]
                req["length"] = rows.length[sel]
                groups.append(sel)
                calls.append(self._read(route.loaders[int(p)], req))
        return groups, calls

    def _pack_step(
        self,
        step: int,
        ranks: list[int],
        rows: ManifestRows,
        starts: np.ndarray,
        groups: list[np.ndarray],
        answers: list[SegmentData],
    ) -> dict[int, list[Batch]]:
        """Scatter loader answers into manifest order, then pack each (rank, micro-batch)."""
        flat = np.empty(int(starts[-1]), dtype=np.int32)
        img_row: list[np.ndarray] = []
        img_off: list[np.ndarray] = []
        images: list[np.ndarray] = []
        for sel, ans in zip(groups, answers, strict=True):
            lens = rows.length[sel].astype(np.int64)
            ans_starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            dst = np.repeat(starts[sel] - ans_starts, lens) + np.arange(int(lens.sum()), dtype=np.int64)
            flat[dst] = ans.tokens
            if ans.images:
                images.extend(ans.images)
                img_row.append(sel[ans.image_segment])
                img_off.append(ans.image_offset)
        all_img_row = np.concatenate(img_row) if img_row else np.zeros(0, dtype=np.int64)
        all_img_off = np.concatenate(img_off) if img_off else np.zeros(0, dtype=np.int64)
        mbs = self._meta.micro_batches
        key = rows.dp_rank.astype(np.int64) * mbs + rows.micro_batch.astype(np.int64)
        out: dict[int, list[Batch]] = {}
        for r in ranks:
            batches = []
            for mb in range(mbs):
                lo, hi = (int(x) for x in np.searchsorted(key, [r * mbs + mb, r * mbs + mb + 1]))
                seg = np.empty(hi - lo, dtype=SEGMENT_DTYPE)
                seg["source"] = rows.source[lo:hi]
                seg["sample"] = rows.sample[lo:hi]
                seg["offset"] = rows.offset[lo:hi]
                seg["length"] = rows.length[lo:hi]
                lane = int(rows.lane[lo]) if hi > lo else 0
                in_mb = np.flatnonzero((all_img_row >= lo) & (all_img_row < hi))
                batches.append(
                    pack_batch(
                        step=step,
                        dp_rank=r,
                        micro_batch=mb,
                        lane=lane,
                        seq_len=self._meta.lane_seq_len(lane),
                        segments=seg,
                        tokens=flat[starts[lo] : starts[hi]],
                        images=[images[k] for k in in_mb.tolist()],
                        image_positions=(starts[all_img_row[in_mb]] - starts[lo] + all_img_off[in_mb]),
                        image_token_id=self._image_token_id,
                    )
                )
            out[r] = batches
        return out
