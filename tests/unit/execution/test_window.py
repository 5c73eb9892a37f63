"""The constructor's step window alone: no cluster, no event loop, no sleeps (builds finish when told)."""

from __future__ import annotations

import random

import pytest

from loomdata.execution._window import Build, StepWindow, build_groups, refill_steps


class _Sim:
    """Drives a StepWindow the way DataConstructor does; a build finishes only when `finish` says so."""

    def __init__(self, w: StepWindow[str]) -> None:
        self.w = w
        self.running: dict[int, Build] = {}
        self.started: list[Build] = []
        self.on_demand = 0

    def launch(self, builds: tuple[Build, ...]) -> None:
        for b in builds:
            assert b.id not in self.running
            self.running[b.id] = b
            self.started.append(b)

    def finish(self, build: Build, error: Exception | None = None) -> None:
        del self.running[build.id]
        if error is None:
            self.w.built(build, {r: f"s{build.step}r{r}" for r in build.ranks})
        else:
            self.w.failed(build, error)

    def finish_all(self) -> None:
        for b in list(self.running.values()):
            self.finish(b)

    def take(self, rank: int, step: int) -> str | Exception:
        """One take; the build it waits on (if any) finishes first. Returns the payload or the error."""
        adm = self.w.admit(rank, step)
        try:
            self.launch(adm.builds)
            if adm.error is not None:
                return adm.error
            if adm.wait is not None:
                self.finish(adm.wait)
            got = self.w.collect(rank, step)
            self.launch(got.builds)
            if got.error is not None:
                return got.error
            if got.payload is not None:
                return got.payload
            self.on_demand += 1
            return f"s{step}r{rank}"
        finally:
            self.w.finish(rank)

    def built_steps(self, rank: int) -> list[int]:
        return sorted(b.step for b in self.started if rank in b.ranks)


def test_start_builds_the_first_window_for_all_ranks_at_once() -> None:
    sim = _Sim(StepWindow([1, 0], steps=10, window=2, peers=1))
    sim.launch(sim.w.start())
    assert [(b.step, b.ranks) for b in sim.started] == [(0, (0, 1)), (1, (0, 1))]
    assert sim.w.building_steps == 2 and sim.w.held() == []
    sim.finish_all()
    assert sim.w.held_keys() == [(0, 0), (0, 1), (1, 0), (1, 1)] and sim.w.building_steps == 0


def test_a_step_is_released_after_peers_takes_and_the_window_moves_on() -> None:
    sim = _Sim(StepWindow([0], steps=10, window=2, peers=3))
    sim.launch(sim.w.start())
    sim.finish_all()
    assert sim.take(0, 0) == "s0r0" and sim.take(0, 0) == "s0r0"
    assert sim.w.want[0] == 0 and (0, 0) in sim.w.held_keys() and sim.built_steps(0) == [0, 1]
    assert sim.take(0, 0) == "s0r0"  # the third peer: released, step 2 starts
    assert sim.w.want[0] == 1 and sim.w.held_keys() == [(0, 1)] and sim.built_steps(0) == [0, 1, 2]
    assert sim.on_demand == 0


def test_a_late_peer_after_release_is_served_on_demand() -> None:
    sim = _Sim(StepWindow([0], steps=10, window=2, peers=2))
    sim.launch(sim.w.start())
    sim.finish_all()
    for _ in range(2):
        sim.take(0, 0)
    assert sim.take(0, 0) == "s0r0" and sim.on_demand == 1  # released already: rebuilt, not held
    assert (0, 0) not in sim.w.held_keys()


def test_a_take_far_ahead_of_an_idle_rank_moves_its_window_there() -> None:
    sim = _Sim(StepWindow([0, 1], steps=100, window=2, peers=1))
    sim.launch(sim.w.start())
    sim.finish_all()
    assert sim.take(0, 40) == "s40r0"  # a resume at step 40
    assert sim.w.want == {0: 41, 1: 0} and sim.on_demand == 0  # taken and released: the window is 41, 42
    assert sim.built_steps(0) == [0, 1, 40, 41, 42] and sim.built_steps(1) == [0, 1]
    assert all(k[1] >= 41 for k in sim.w.held_keys() if k[0] == 0)  # the old window is dropped


def test_no_jump_past_a_step_a_peer_already_took() -> None:
    sim = _Sim(StepWindow([0], steps=100, window=2, peers=2))
    sim.launch(sim.w.start())
    sim.finish_all()
    sim.take(0, 0)  # one of two peers took step 0
    assert sim.take(0, 50) == "s50r0" and sim.on_demand == 1  # built on demand, window kept
    assert sim.w.want[0] == 0 and (0, 0) in sim.w.held_keys()


def test_a_take_beyond_the_window_while_another_is_in_progress_is_built_on_demand() -> None:
    w: StepWindow[str] = StepWindow([0], steps=100, window=2, peers=1)
    sim = _Sim(w)
    sim.launch(w.start())
    first = w.admit(0, 0)  # waiting on its build (a client prefetching deeper than the window)
    sim.launch(first.builds)
    assert first.wait is not None
    assert sim.take(0, 5) == "s5r0" and sim.on_demand == 1 and w.want[0] == 0
    sim.finish(first.wait)
    assert w.collect(0, 0).payload == "s0r0"
    w.finish(0)


def test_a_fast_rank_is_not_held_back_by_a_slow_one() -> None:
    sim = _Sim(StepWindow([0, 1], steps=100, window=2, peers=1))
    sim.launch(sim.w.start())
    sim.finish_all()
    sim.take(1, 0)  # rank 1 is active but slow: it stays at step 1
    for step in range(12):
        assert sim.take(0, step) == f"s{step}r0"
    assert sim.on_demand == 0  # every take of the fast rank came from a build of its window
    assert sim.w.want == {0: 12, 1: 1}
    assert sim.built_steps(1) == [0, 1, 2]  # the slow rank's window only


def test_a_rank_nobody_consumes_does_not_hold_the_group_back() -> None:
    sim = _Sim(StepWindow([0, 1], steps=100, window=2, peers=1))
    sim.launch(sim.w.start())
    sim.finish_all()
    for step in range(6):
        sim.take(0, step)
        sim.finish_all()  # prefetched builds finish before the next take
    assert sim.on_demand == 0 and sim.built_steps(1) == [0, 1]
    assert sim.w.held_keys() == [(0, 6), (0, 7), (1, 0), (1, 1)]


def test_a_failed_build_is_reported_once_to_each_rank_then_rebuilt() -> None:
    sim = _Sim(StepWindow([0, 1], steps=10, window=2, peers=1))
    sim.launch(sim.w.start())
    step0 = next(b for b in sim.running.values() if b.step == 0)
    boom = ValueError("loader exploded")
    sim.finish(step0, boom)
    assert sim.take(0, 0) is boom and sim.take(1, 0) is boom
    assert sim.take(0, 0) == "s0r0"  # reported once: the next take builds it again
    assert sim.built_steps(0).count(0) == 2 and sim.on_demand == 0


def test_a_failure_is_reported_to_a_take_waiting_on_the_build() -> None:
    w: StepWindow[str] = StepWindow([0], steps=10, window=1, peers=1)
    sim = _Sim(w)
    sim.launch(w.start())
    adm = w.admit(0, 0)
    assert adm.wait is not None and adm.error is None
    sim.finish(adm.wait, KeyError("gone"))
    got = w.collect(0, 0)
    w.finish(0)
    assert isinstance(got.error, KeyError) and got.payload is None
    assert w.collect(0, 0).error is None  # once


def test_a_cancelled_build_is_forgotten_and_stop_drops_everything() -> None:
    w: StepWindow[str] = StepWindow([0], steps=10, window=2, peers=1)
    builds = w.start()
    w.cancelled(builds[0])
    assert w.building_steps == 1
    w.built(builds[1], {0: "s1r0"})
    w.stop()
    assert w.held() == [] and w.start() == () and w.stopped
    adm = w.admit(0, 0)
    assert adm.builds == () and adm.wait is None


def test_a_build_finishing_after_the_rank_moved_past_it_is_not_held() -> None:
    w: StepWindow[str] = StepWindow([0], steps=100, window=2, peers=1)
    sim = _Sim(w)
    sim.launch(w.start())
    late = next(b for b in sim.running.values() if b.step == 1)
    sim.take(0, 30)  # jump: steps 0 and 1 are behind the rank now
    sim.finish(late)
    assert all(s >= 30 for _, s in w.held_keys())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="window and peers must be >= 1"):
        StepWindow([0], steps=10, window=0, peers=1)
    with pytest.raises(ValueError, match="window and peers must be >= 1"):
        StepWindow([0], steps=10, window=2, peers=0)


@pytest.mark.parametrize("seed", range(8))
def test_held_steps_stay_inside_each_ranks_window_whatever_the_order(seed: int) -> None:
    rng = random.Random(seed)
    window, peers, steps = rng.randint(1, 3), rng.randint(1, 3), 60
    w: StepWindow[str] = StepWindow([0, 1, 2], steps=steps, window=window, peers=peers)
    sim = _Sim(w)
    sim.launch(w.start())
    cursor = {r: 0 for r in w.ranks}  # per rank: the next step, taken `peers` times in turn
    for _ in range(400):
        r = rng.choice(w.ranks)
        if rng.random() < 0.3:
            for b in rng.sample(list(sim.running.values()), k=min(2, len(sim.running))):
                sim.finish(b)
        if cursor[r] >= steps * peers:
            continue
        step = cursor[r] // peers
        assert sim.take(r, step) == f"s{step}r{r}"
        cursor[r] += 1
        for rank, s in w.held_keys():
            assert w.want[rank] <= s < w.want[rank] + window
        assert len(w.held_keys()) <= window * len(w.ranks)
        assert w.building_steps <= window * len(w.ranks)


def _builds(steps: range, ranks: tuple[int, ...] = (0, 1)) -> tuple[Build, ...]:
    return tuple(Build(i, s, ranks) for i, s in enumerate(steps))


def test_builds_wanted_now_are_read_in_growing_groups_the_rest_in_full_ones() -> None:
    want = {0: 0, 1: 0}
    sizes = [len(g) for g in build_groups(_builds(range(0, 20)), want, most=8)]
    assert sizes == [1, 2, 4, 8, 5]  # step 0 is wanted now: it does not wait for the reads behind it
    sizes = [len(g) for g in build_groups(_builds(range(4, 24)), want, most=8)]
    assert sizes == [8, 8, 4]  # far ahead of every rank: as few loader requests as the bound allows
    groups = build_groups(_builds(range(0, 5)), want, most=1)
    assert [[b.step for b in g] for g in groups] == [[0], [1], [2], [3], [4]]
    assert build_groups((), want, most=4) == []
    flat = [b for g in build_groups(_builds(range(0, 20)), want, most=3) for b in g]
    assert [b.step for b in flat] == list(range(20))  # every build once, in order


def test_ready_run_counts_the_held_steps_one_take_can_carry() -> None:
    sim = _Sim(StepWindow([0], steps=10, window=4, peers=1))
    sim.launch(sim.w.start())
    builds = {b.step: b for b in sim.started}
    for s in (0, 1, 3):  # step 2 is still being built
        sim.finish(builds[s])
    assert sim.w.ready_run(0, 0, most=10) == 2 and sim.w.ready_run(0, 0, most=1) == 1
    assert sim.w.ready_run(0, 2, most=10) == 0 and sim.w.ready_run(0, 3, most=10) == 1
    assert sim.take(0, 0) == "s0r0" and sim.w.ready_run(0, 1, most=3) == 1
    sim.finish(builds[2])
    assert sim.w.ready_run(0, 1, most=3) == 3
    for s in (1, 2, 3):  # what take_steps does for the steps after the first: collect each
        got = sim.w.collect(0, s)
        sim.launch(got.builds)
        assert got.payload == f"s{s}r0"
    assert sim.w.want[0] == 4 and sorted(b.step for b in sim.running.values()) == [4, 5, 6, 7]


def test_a_release_builds_ahead_once_half_the_window_is_free_in_one_group() -> None:
    """Builds wait until `refill_steps` of the window are free, then start together (one loader request each)."""
    w = StepWindow[str]([0], steps=100, window=8, peers=1)
    assert w.refill == refill_steps(8) == 4
    sim = _Sim(w)
    sim.launch(w.start())
    sim.finish_all()
    for step in range(3):  # 1..3 steps free: nothing built yet
        assert sim.take(0, step) == f"s{step}r0"
        assert not sim.running
    assert sim.take(0, 3) == "s3r0"  # 4 free: steps 8..11 start together
    assert sorted(b.step for b in sim.running.values()) == [8, 9, 10, 11]
    assert [len(g) for g in build_groups(tuple(sim.running.values()), w.want, w.window)] == [4]
    sim.finish_all()
    assert [sim.take(0, s) for s in range(4, 12)] == [f"s{s}r0" for s in range(4, 12)]
    assert sim.on_demand == 0  # never served outside the window
    assert refill_steps(2) == 1 and refill_steps(1) == 1  # small windows build at every release, as before


def test_a_take_before_the_window_of_an_idle_rank_moves_its_window_back() -> None:
    """A rank restarted from an earlier step on a live executor (or retrying a take whose answer was lost): the
    window moves back, so the replayed steps are built ahead again, not one on-demand build per take."""
    sim = _Sim(StepWindow([0, 1], steps=100, window=4, peers=1))
    sim.launch(sim.w.start())
    sim.finish_all()
    for step in range(20):
        assert sim.take(0, step) == f"s{step}r0"
        sim.finish_all()
    assert sim.w.want[0] == 20 and sim.on_demand == 0
    started = len(sim.started)
    assert sim.take(0, 5) == "s5r0"  # the rewind: its window is 6..9 now, built ahead
    assert sim.on_demand == 0 and sim.w.want[0] == 6
    assert sorted(b.step for b in sim.started[started:]) == [5, 6, 7, 8]
    sim.finish_all()
    for step in range(6, 30):
        assert sim.take(0, step) == f"s{step}r0"
        sim.finish_all()
    assert sim.on_demand == 0
    for rank, s in sim.w.held_keys():  # nothing kept from before the rewind past the window
        assert sim.w.want[rank] <= s < sim.w.want[rank] + 4


def test_a_take_before_the_window_while_another_is_in_progress_is_built_on_demand() -> None:
    w: StepWindow[str] = StepWindow([0], steps=100, window=2, peers=1)
    sim = _Sim(w)
    sim.launch(w.start())
    sim.finish_all()
    for step in range(10):
        sim.take(0, step)
        sim.finish_all()
    held = w.admit(0, 11)  # a prefetching take in progress
    assert sim.take(0, 3) == "s3r0" and sim.on_demand == 1  # the window stays
    assert w.want[0] == 10
    w.finish(0)
    sim.launch(held.builds)


def _sims_at(window: int, peers: int) -> tuple[_Sim, _Sim]:
    """Two windows in the same state: the first window built, step 0 taken by every peer."""
    sims = (_Sim(StepWindow([0], steps=40, window=window, peers=peers)), _Sim(StepWindow([0], 40, window, peers)))
    for sim in sims:
        sim.launch(sim.w.start())
        sim.finish_all()
        for _ in range(peers):
            assert sim.take(0, 0) == "s0r0"
        sim.finish_all()
    return sims


def test_collect_run_is_the_step_by_step_collects() -> None:
    """A take of several steps collects the ones after its first in one call: the same payloads, the same steps freed
    and the same builds started in the same order as one `collect` a step (so the same groups and loader requests)."""
    rng = random.Random(7)
    for _ in range(60):
        window, peers, ranks = rng.choice([2, 4, 8, 16]), rng.choice([1, 1, 2]), rng.choice([[0], [0, 1], [0, 1, 2]])
        one, run = (_Sim(StepWindow(ranks, steps=80, window=window, peers=peers)) for _ in range(2))
        for sim in (one, run):
            sim.launch(sim.w.start())
        at = {(r, p): 0 for r in ranks for p in range(peers)}
        while min(at.values()) < 80:
            r, p = rng.choice([k for k, v in at.items() if v < 80])
            s, most = at[(r, p)], rng.randint(1, 12)
            for sim in (one, run):
                assert sim.take(r, s) == f"s{s}r{r}"
            n = min(one.w.ready_run(r, s + 1, most), 79 - s)
            step_by_step = []
            for k in range(s + 1, s + 1 + n):
                got = one.w.collect(r, k)
                one.launch(got.builds)
                step_by_step.append(got.payload)
            payloads, builds = run.w.collect_run(r, s + 1, n)
            run.launch(builds)
            assert payloads == step_by_step == [f"s{k}r{r}" for k in range(s + 1, s + 1 + n)]
            assert [(b.step, b.ranks) for b in run.started] == [(b.step, b.ranks) for b in one.started]
            assert run.w.held_keys() == one.w.held_keys() and run.w.want == one.w.want
            at[(r, p)] = s + 1 + n
            if rng.random() < 0.5:  # builds finish in the same order on both
                for sim in (one, run):
                    sim.finish_all()
        assert one.on_demand == run.on_demand


def test_collect_run_stops_at_a_step_not_held_and_releases_only_what_every_peer_took() -> None:
    _, sim = _sims_at(window=8, peers=1)
    payloads, builds = sim.w.collect_run(0, 1, 0)
    assert (payloads, builds, sim.w.want[0]) == ([], (), 1)  # nothing asked: nothing taken or released
    sim.launch(sim.w.collect_run(0, 1, 2)[1])  # steps 1, 2: two free, under half the window: nothing built
    assert sim.w.want[0] == 3 and not sim.running
    sim.launch(sim.w.collect_run(0, 3, 2)[1])  # half the window free at step 3: 8..11 start (as `collect` does)
    building = sorted(b.step for b in sim.running.values())
    assert building == [8, 9, 10, 11] and sim.w.want[0] == 5
    payloads, _ = sim.w.collect_run(0, 5, 10)  # 8 is still being built: the run ends at 7
    assert payloads == [f"s{s}r0" for s in range(5, 8)] and sim.w.want[0] == 8
    sim.w.failed(sim.running.pop(next(b.id for b in sim.running.values() if b.step == 8)), RuntimeError("x"))
    assert sim.w.collect_run(0, 8, 3) == ([], ())  # a failed step is not a held one: `take` reports it

    _, peers = _sims_at(window=4, peers=2)
    assert peers.w.collect_run(0, 1, 2) == (["s1r0", "s2r0"], ())  # one peer took them: nothing released
    assert peers.w.want[0] == 1 and (0, 1) in peers.w.held_keys()
    payloads, builds = peers.w.collect_run(0, 1, 1)  # the second peer takes step 1 only
    peers.launch(builds)
    assert payloads == ["s1r0"] and peers.w.want[0] == 2 and peers.w.held_keys()[0] == (0, 2)
