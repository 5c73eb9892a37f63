"""The Data Constructor's step window as a pure state machine: which steps to build, hold and release.

No asyncio, no Dask, no I/O (like distributed's `WorkerState`): the actor feeds it events (a take
arrives, a build finished, failed or was cancelled, a take ended) and carries out what it answers
(`Build`s to start, a build to wait for, a held payload, or "build it on demand").

Per rank `want` is the first step not yet taken by all its `peers`; steps `[want, want + window)` are
built ahead, one `Build` per step for every rank of the group that needs it, and held until `peers`
takes of each arrived. Held steps therefore always lie inside a rank's window: memory is bounded by
`window` whatever the plan size. A take outside the window is served on demand (not held); a take far
ahead of an idle rank moves its window there (a resume). A failed build is reported to the first take
of each of its (rank, step) and then forgotten, so the next take of that step builds it again.
`ready_run` says how many held steps one take may carry on; `build_groups` cuts the builds started
together into groups read with one loader request each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Admission", "Build", "Collected", "StepWindow", "build_groups", "step_bytes"]

T = TypeVar("T")

_BATCH_ARRAYS = 1  # input_ids: int32[seq_len] (a thin block: labels and position ids are made on the rank; session 18)


def step_bytes(seq_len: int, micro_batches: int) -> int:
    """About how many bytes one rank's step of packed batches takes where it is held and moved (text; images come on
    top): a thin block's `input_ids`, 4 bytes a token (cu_seqlens and the scalars are small)."""
    return max(1, micro_batches * seq_len * 4 * _BATCH_ARRAYS)


REFILL_FRACTION = 2
"""A release builds further ahead once 1/REFILL_FRACTION of the window is free (not at every take): half a window
per group of builds. At 1 consumer (block shuffle, window 64) a take freed about 16 steps, so each group read 16
steps with one request per loader, and the loaders' per-request bookkeeping (pending uses, prune, next uses: arrays
the size of the planned horizon) dominated the worker's CPU."""


def refill_steps(window: int) -> int:
    """Free steps of a rank's window before a release builds further ahead: half the window (1 for a window of 2)."""
    return max(1, window // REFILL_FRACTION)


def build_groups(builds: Sequence[Build], want: Mapping[int, int], most: int) -> list[tuple[Build, ...]]:
    """Cut builds started together into groups read with one loader request each (per loader).

    A group holds at most `most` consecutive builds. When the first build is a step a rank wants now
    (nothing ahead of it is held: a start, a resume, a rank catching up), the groups grow 1, 2, 4, ...
    so that step is not kept waiting for the reads of the steps behind it.
    """
    most = max(1, most)
    urgent = bool(builds) and any(want[r] >= builds[0].step for r in builds[0].ranks)
    out: list[tuple[Build, ...]] = []
    i, size = 0, 1 if urgent else most
    while i < len(builds):
        out.append(tuple(builds[i : i + size]))
        i += size
        size = min(2 * size, most)
    return out


@dataclass(frozen=True, slots=True)
class Build:
    """Build `step` for `ranks` (read with the builds started with it: `build_groups`); `id` is unique."""

    id: int
    step: int
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Admission:
    """What to do when a take arrives: start `builds`, then raise `error` or wait for `wait` (if any)."""

    builds: tuple[Build, ...] = ()
    error: Exception | None = None
    wait: Build | None = None


@dataclass(frozen=True, slots=True)
class Collected(Generic[T]):
    """A take's answer once nothing is building for it: `error`, a held `payload`, or neither (on demand)."""

    builds: tuple[Build, ...] = ()
    error: Exception | None = None
    payload: T | None = None


@dataclass(slots=True)
class _Held(Generic[T]):
    payload: T
    takes: int = 0


class StepWindow(Generic[T]):
    """Window bookkeeping for a group of ranks; `T` is what a built (rank, step) holds (its batches)."""

    def __init__(self, ranks: Sequence[int], steps: int, window: int, peers: int, start_step: int = 0) -> None:
        if window < 1 or peers < 1:
            raise ValueError(f"window and peers must be >= 1 (got window={window}, peers={peers})")
        self.ranks = sorted(ranks)
        self.steps = steps
        self.window = window
        self.peers = peers
        self.want = {r: start_step for r in self.ranks}
        self.refill = refill_steps(window)
        self._held: dict[tuple[int, int], _Held[T]] = {}
        self._building: dict[tuple[int, int], Build] = {}
        self._failed: dict[tuple[int, int], Exception] = {}
        self._in_progress = {r: 0 for r in self.ranks}
        self._active: set[int] = set()  # ranks that have taken something: the group window follows them
        # Per rank: every step in [want, _known_to) is held, building or failed, so `_schedule` looks only
        # past it (a release then costs the steps it adds, not the window's size); lowered whenever a
        # key in the window becomes unknown again (a failure reported, a build cancelled).
        self._known_to = {r: start_step for r in self.ranks}
        self._next_id = 0
        self.stopped = False

    # ---- events ---------------------------------------------------------------------------------

    def admit(self, rank: int, step: int) -> Admission:
        """A take of `(rank, step)` arrived (counted in progress until `finish`)."""
        key = (rank, step)
        self._in_progress[rank] += 1
        self._active.add(rank)
        builds = self._maybe_jump(rank, step)
        if key in self._failed:
            self._forget(key)
            return Admission(builds, error=self._failed.pop(key))
        if key not in self._held and key not in self._building and self.in_window(rank, step):
            builds += self._schedule(only_rank=rank)
        return Admission(builds, wait=self._building.get(key))

    def collect(self, rank: int, step: int) -> Collected[T]:
        """After waiting: the failure, or the held payload (counting this take; released after `peers`)."""
        key = (rank, step)
        if key in self._failed:
            self._forget(key)
            return Collected(error=self._failed.pop(key))
        held = self._held.get(key)
        if held is None:  # outside the window or already released: the caller builds it, unheld
            return Collected()
        held.takes += 1
        builds = self._release(rank, step) if held.takes >= self.peers else ()
        return Collected(builds, payload=held.payload)

    def collect_run(self, rank: int, step: int, most: int) -> tuple[list[T], tuple[Build, ...]]:
        """`collect` of the held steps from `step` on (at most `most`, up to the first one not held or failed), each
        counted as a take, and the same releases and builds as one `collect` a step, for less bookkeeping.

        For a take's steps after its first (12,000 `collect`s at 4 consumers). A release builds ahead only once at
        most `window - refill` steps from `want` are known; before that point (every step below `_known_to` is known)
        it would only move `want`, which a later release in the run does for it. From there each step is released as
        `collect` does: the same builds in the same order (one release for the whole run built further ahead than
        `collect` and grouped the builds differently: not the window's behaviour, so not kept)."""
        held, failed = self._held, self._failed
        out: list[T] = []
        builds: tuple[Build, ...] = ()
        last = released = step - 1
        for s in range(step, step + most):
            h = held.get((rank, s))
            if h is None or (failed and (rank, s) in failed):
                break
            h.takes += 1
            out.append(h.payload)
            if h.takes < self.peers:
                continue
            last = s
            if s + 1 >= self._known_to[rank] - self.window + self.refill:  # this release may build ahead
                builds += self._release(rank, s)
                released = s
        if last > released:
            builds += self._release(rank, last)  # only moves `want`: nothing is due before the point above
        return out, builds

    def finish(self, rank: int) -> None:
        """A take of `rank` ended (served, failed or cancelled)."""
        self._in_progress[rank] -= 1

    def built(self, build: Build, payloads: Mapping[int, T]) -> None:
        """`build` finished: hold each rank's payload unless that rank already moved past the step."""
        for r in build.ranks:
            self._building.pop((r, build.step), None)
            if build.step >= self.want[r] and not self.stopped:
                self._held[(r, build.step)] = _Held(payloads[r])
            else:
                self._forget((r, build.step))

    def failed(self, build: Build, error: Exception) -> None:
        """`build` failed: each of its (rank, step) reports `error` to its next take, once."""
        for r in build.ranks:
            self._building.pop((r, build.step), None)
            self._failed[(r, build.step)] = error

    def cancelled(self, build: Build) -> None:
        """`build` was cancelled (stop): forget it."""
        for r in build.ranks:
            self._building.pop((r, build.step), None)
            self._forget((r, build.step))

    def start(self) -> tuple[Build, ...]:
        """The first window's builds."""
        return self._schedule()

    def stop(self) -> None:
        """Drop held payloads; schedule nothing more."""
        self.stopped = True
        self._held.clear()

    # ---- views ----------------------------------------------------------------------------------

    def in_window(self, rank: int, step: int) -> bool:
        return self.want[rank] <= step < self.want[rank] + self.window

    def held(self) -> list[T]:
        """Payloads held now."""
        return [h.payload for h in self._held.values()]

    def ready_run(self, rank: int, step: int, most: int) -> int:
        """How many consecutive steps from `step` (at most `most`) are held for `rank`: one take can carry them."""
        n = 0
        while n < most and (rank, step + n) in self._held and (rank, step + n) not in self._failed:
            n += 1
        return n

    def held_keys(self) -> list[tuple[int, int]]:
        return sorted(self._held)

    @property
    def building_steps(self) -> int:
        """Distinct steps being built."""
        return len({k[1] for k in self._building})

    # ---- transitions ----------------------------------------------------------------------------

    def _maybe_jump(self, rank: int, step: int) -> tuple[Build, ...]:
        """A take beyond the window while the rank is idle (nothing taken or being taken): move the window.

        That is a resume or a reconnect at a later step. With takes in progress (a client prefetching
        deeper than the window, a peer ahead of another) the window stays and the take is built on demand.
        A take before the window moves it back (`_jump_back`) under the same condition, with one peer a rank.
        """
        if step < self.want[rank] and self.peers == 1 and self._in_progress[rank] == 1:
            return self._jump_back(rank, step)
        if step < self.want[rank] + self.window or self._in_progress[rank] > 1:
            return ()
        if any(h.takes for (r, s), h in self._held.items() if r == rank and s < step):
            return ()
        old, self.want[rank] = self.want[rank], step
        self._drop_below(rank, old)
        return self._schedule()

    def _jump_back(self, rank: int, step: int) -> tuple[Build, ...]:
        """A take before the rank's window while it is idle: a rank restarted from an earlier step (a resume from an
        older checkpoint on a live executor) or a take retried after its answer was lost. The window moves back to
        it, so the steps from there are built ahead in groups again, not one on-demand build per take (3,000 steps
        replayed at about 9 ms each, session 18). Held steps past the new window are dropped; one peer per rank
        only: with several, a late peer's take would pull the window back under peers still ahead, and the step
        it re-holds would wait for takes that never come."""
        self.want[rank] = step
        for key in [k for k in self._held if k[0] == rank and k[1] >= step + self.window]:
            del self._held[key]
        self._known_to[rank] = step  # nothing from the new `want` is known yet: `_schedule` looks again
        return self._schedule()

    def _release(self, rank: int, step: int) -> tuple[Build, ...]:
        """All peers took `step`: free it and everything older of the rank, and build further ahead once at least
        `refill` steps of its window are free (`refill_steps`): builds started together are read with one loader
        request per loader and packed in one pass, and every request costs its loader fixed bookkeeping."""
        old = self.want[rank]
        self.want[rank] = max(old, step + 1)
        self._drop_below(rank, old)
        if self._known_ahead(rank) > self.window - self.refill:
            return ()
        return self._schedule()

    def _known_ahead(self, rank: int) -> int:
        """Consecutive steps from the rank's `want` held, building or failed (at most the window). The scan starts at
        `_known_to` (every step below it is known): a release after each take scanned the whole window (64 steps of
        dict lookups per take, 4% of the constructor worker's samples at 4 consumers)."""
        want = self.want[rank]
        n = min(max(self._known_to[rank] - want, 0), self.window)
        held, building, failed = self._held, self._building, self._failed
        while n < self.window and (
            (rank, want + n) in held or (rank, want + n) in building or (rank, want + n) in failed
        ):
            n += 1
        return n

    def _drop_below(self, rank: int, old_want: int) -> None:
        """Forget held steps and unreported failures of `rank` before its `want`: it moved past them.

        Held steps all lie at or above the old `want` (`built` holds nothing below it), so a short move
        drops them step by step; failures (rare) and a long move scan the table.
        """
        want = self.want[rank]
        if want - old_want <= len(self._held):
            for s in range(old_want, want):
                self._held.pop((rank, s), None)
        else:
            for key in [k for k in self._held if k[0] == rank and k[1] < want]:
                del self._held[key]
        if self._failed:
            for key in [k for k in self._failed if k[0] == rank and k[1] < want]:
                del self._failed[key]

    def _forget(self, key: tuple[int, int]) -> None:
        """`key` is no longer held, building or failed: `_schedule` must look at its step again."""
        rank, step = key
        self._known_to[rank] = min(self._known_to[rank], step)

    def _schedule(self, only_rank: int | None = None) -> tuple[Build, ...]:
        """Builds for every (rank, step) in the window that is neither held, building nor failed.

        Steps are built for all ranks of the group at once, from the slowest rank that has taken
        anything (ranks nobody consumes do not hold the group back); `only_rank` builds one rank's
        window when it ran ahead of the group's slowest rank.
        """
        if self.stopped:
            return ()
        ranks = [only_rank] if only_rank is not None else self.ranks
        lead = [only_rank] if only_rank is not None else sorted(self._active) or self.ranks
        lo = min(self.want[r] for r in lead)
        top = min(lo + self.window, self.steps)
        need: dict[int, list[int]] = {}  # step -> ranks (in order) that need it built
        held, building, failed = self._held, self._building, self._failed
        for r in ranks:
            want = self.want[r]
            lo_r, hi_r = max(lo, want), min(want + self.window, top)
            known = max(self._known_to[r], want)
            for step in range(max(lo_r, known), hi_r):
                key = (r, step)
                if key not in held and key not in building and key not in failed:
                    need.setdefault(step, []).append(r)
            if known >= lo_r:  # [want, hi_r) is all known once these builds are registered
                self._known_to[r] = max(known, hi_r)
        out: list[Build] = []
        for step in sorted(need):
            build = Build(self._next_id, step, tuple(need[step]))
            self._next_id += 1
            for r in build.ranks:
                building[(r, step)] = build
            out.append(build)
        return tuple(out)
