"""`StepWindow._schedule` looks only past each rank's known steps: the same builds as a full scan of the window.

The reference below is the full scan (every (rank, step) of the window checked on every release); both
windows are driven by the same random events (takes at and around each rank's position, builds that
finish, fail or are cancelled in any order, jumps ahead) and must answer the same builds, ids included.
"""

from __future__ import annotations

import random

import pytest

from loomdata.execution._window import Build, StepWindow


class _FullScan(StepWindow[str]):
    """The window as it scheduled before the per-rank hint: every step of the window, every rank, each time."""

    def _schedule(self, only_rank: int | None = None) -> tuple[Build, ...]:
        if self.stopped:
            return ()
        ranks = [only_rank] if only_rank is not None else self.ranks
        lead = [only_rank] if only_rank is not None else sorted(self._active) or self.ranks
        lo = min(self.want[r] for r in lead)
        out: list[Build] = []
        for step in range(lo, min(lo + self.window, self.steps)):
            need = tuple(
                r
                for r in ranks
                if self.in_window(r, step)
                and (r, step) not in self._held
                and (r, step) not in self._building
                and (r, step) not in self._failed
            )
            if need:
                build = Build(self._next_id, step, need)
                self._next_id += 1
                for r in need:
                    self._building[(r, step)] = build
                out.append(build)
        return tuple(out)


def _key(builds: tuple[Build, ...]) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(b.id, b.step, b.ranks) for b in builds]


@pytest.mark.parametrize("seed", range(12))
def test_schedule_matches_a_full_scan_under_random_events(seed: int) -> None:
    rng = random.Random(seed)
    ranks, steps, window, peers = rng.sample(range(8), rng.randint(1, 4)), rng.randint(20, 120), rng.randint(1, 9), 1
    peers = rng.choice([1, 1, 2])
    a, b = StepWindow[str](ranks, steps, window, peers), _FullScan(ranks, steps, window, peers)
    assert _key(a.start()) == _key(b.start())
    running: dict[int, tuple[Build, Build]] = {}  # id -> (build of a, build of b)

    def launch(x: tuple[Build, ...], y: tuple[Build, ...]) -> None:
        assert _key(x) == _key(y)
        running.update((p.id, (p, q)) for p, q in zip(x, y, strict=True))

    launch((), ())
    for _ in range(600):
        event = rng.random()
        if event < 0.45 and running:  # a build ends: built, failed or cancelled
            bid = rng.choice(sorted(running))
            p, q = running.pop(bid)
            outcome = rng.random()
            if outcome < 0.8:
                a.built(p, {r: f"{p.step}/{r}" for r in p.ranks})
                b.built(q, {r: f"{q.step}/{r}" for r in q.ranks})
            elif outcome < 0.95:
                a.failed(p, ValueError("x"))
                b.failed(q, ValueError("x"))
            else:
                a.cancelled(p)
                b.cancelled(q)
        else:  # a take near the rank's position (sometimes far ahead: a resume)
            rank = rng.choice(ranks)
            far = rng.random() < 0.03
            step = min(
                steps - 1, max(0, a.want[rank] + (rng.randint(window, 3 * window + 2) if far else rng.randint(-1, 2)))
            )
            x, y = a.admit(rank, step), b.admit(rank, step)
            launch(x.builds, y.builds)
            assert (x.error is None) == (y.error is None) and (x.wait is None) == (y.wait is None)
            if x.wait is None and x.error is None:
                cx, cy = a.collect(rank, step), b.collect(rank, step)
                launch(cx.builds, cy.builds)
                assert cx.payload == cy.payload and (cx.error is None) == (cy.error is None)
            a.finish(rank)
            b.finish(rank)
        assert a.want == b.want
        assert a.held_keys() == b.held_keys()
        assert sorted(a._building) == sorted(b._building) and sorted(a._failed) == sorted(b._failed)
