"""Planning in step ranges (planning._ranges, planning._distributed) without a cluster: fixed manifest bounds,
range cuts, carry fix-ups and the work's pickled form, through an in-process executor that pickles what it
is sent as a worker process would."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from loomdata.planning import _distributed as distributed_module
from loomdata.planning import _manifest as manifest_module
from loomdata.planning import _ranges as ranges_module
from loomdata.planning import make_plan
from loomdata.planning._distributed import indexed_samples, split_ranges, wants_cluster
from loomdata.planning._manifest import ManifestWriter, file_bounds
from loomdata.planning._ranges import PlanWork, balanced_blocks, same_carry, window
from loomdata.planning._segments import Segments
from loomdata.schemas.errors import PlanError
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.plan import read_plan
from loomdata.schemas.tables import TableKind, write_table
from loomtest.golden_plans import CASES


class _PicklingPool:
    """Runs tasks on threads, each on a pickled copy of its arguments and result (as worker processes do)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(2)
        self.sent: list[int] = []  # pickled bytes of each task's arguments
        self.works: list[PlanWork] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        blob = pickle.dumps((args, kwargs))
        self.sent.append(len(blob))
        a, kw = pickle.loads(blob)
        self.works.extend(x for x in a if isinstance(x, PlanWork))
        return self._pool.submit(lambda: pickle.loads(pickle.dumps(fn(*a, **kw))))


def _files(plan_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(plan_dir).as_posix(): p.read_bytes() for p in sorted(plan_dir.rglob("*")) if p.is_file()}


def test_file_bounds_close_a_partition_once_it_holds_enough_drawn_segments() -> None:
    drawn = np.array([3, 0, 5, 1, 1, 1, 9, 2])
    b = file_bounds(drawn, 4)
    assert b.tolist() == [0, 3, 7, 8]  # 3+0+5 >= 4 at step 2; 1+1+1 < 4, +9 at step 6; the rest (2) last
    assert file_bounds(np.zeros(5, dtype=np.int64), 4).tolist() == [0, 5]
    assert file_bounds(np.full(3, 100), 1).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="rows_per_file must be >= 1"):
        file_bounds(drawn, 0)


def test_a_writer_starts_and_ends_only_at_partition_bounds(tmp_path: Path) -> None:
    bounds = np.array([0, 3, 6])
    with pytest.raises(ValueError, match="first_step 2 is not the first step of a partition"):
        ManifestWriter(tmp_path, "p", bounds, first_step=2)
    w = ManifestWriter(tmp_path, "p", bounds, first_step=3)
    cols = {c: np.zeros(2, dtype=np.uint32) for c in ["dp_rank", "micro_batch", "sample", "offset", "length"]}
    w.add(4, {**cols, "source": np.zeros(2, np.uint16), "lane": np.zeros(2, np.uint8)})
    with pytest.raises(ValueError, match="step 4 is not the last step of a partition"):
        w.close(4)
    files = ManifestWriter(tmp_path, "p", bounds, first_step=3).close(5)
    assert [(f.path, f.first_step, f.last_step, f.rows) for f in files] == [
        ("manifest/steps-00000003-00000005.parquet", 3, 5, 0)
    ]


def test_same_carry_compares_every_column_and_its_type() -> None:
    def segs(length: list[int], dtype: Any = np.int64) -> Segments:
        n = len(length)
        z = np.zeros(n, dtype=np.uint32)
        return Segments(np.zeros(n, np.uint16), z.astype(np.uint64), z, np.array(length, dtype), z.astype(np.uint8), z)

    assert same_carry(None, None) and not same_carry(segs([1]), None) and not same_carry(None, segs([1]))
    assert same_carry(segs([1, 2]), segs([1, 2]))
    assert not same_carry(segs([1, 2]), segs([1, 3])) and not same_carry(segs([1]), segs([1, 2]))
    assert not same_carry(segs([1]), segs([1], np.int32))


@pytest.mark.parametrize(("name", "ranges"), [("images_defer_dp3", 1000), ("elastic_images_in_flight", 1000)])
def test_ranges_fixed_up_give_the_one_process_plan_byte_for_byte(
    name: str, ranges: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    fixed: list[tuple[int, int]] = []
    real_fix_up = distributed_module.fix_up

    def counting_fix_up(work: PlanWork, out: Path, part: Any, carry: Segments) -> Any:
        fixed.append((part.first, part.stop))
        return real_fix_up(work, out, part, carry)

    monkeypatch.setattr(distributed_module, "fix_up", counting_fix_up)
    spec, index, kw = CASES[name](tmp_path)
    single = make_plan(spec, index=index, **kw).plan_dir
    want = _files(single.rename(single.with_name("single")))
    pool = _PicklingPool()
    spec, index, kw = CASES[name](tmp_path)
    got = _files(make_plan(spec, index=index, client=pool, ranges=ranges, **kw).plan_dir)
    assert len(pool.sent) > 3 and fixed  # several ranges, and some were fixed up
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []
    # each range got its own window of the work: contiguous ranges cut at bounds that cover the rest
    cuts = [(w.step0, w.step0 + w.rows) for w in pool.works]
    assert all(w.windowed for w in pool.works) and cuts[0][0] <= fixed[0][0]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts)) and cuts[-1][1] == pool.works[0].steps
    assert all(a in w.bounds and b in w.bounds for w, (a, b) in zip(pool.works, cuts, strict=True))


def test_a_text_only_work_sends_no_image_column_and_ranges_need_no_fix_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    pool = _PicklingPool()
    res = make_plan(spec, index=index, client=pool, ranges=3, **kw)
    assert len(pool.sent) == 3 and len(read_plan(res.plan_dir).manifest) >= 3
    deferred = pq.read_table(res.plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy()
    assert not deferred.any()
    for work in pool.works:
        n = sum(len(t) for t in work.num_tokens)
        assert all(a.strides == (0,) for a in work.num_image_tokens)  # restored as broadcast zeros
        assert all(len(st.doc) == len(t) for st, t in zip(work.streams, work.num_tokens, strict=True))
    # a window's part of the stream: tokens 4 B, sample rows 4 B, assigned positions 4 B a position (steps as counts)
    n = [sum(len(t) for t in w.num_tokens) for w in pool.works]
    assert all(sent < 40 * k + 20_000 for sent, k in zip(pool.sent, n, strict=True)), (pool.sent, n)


def test_a_window_holds_its_range_alone_and_plans_it_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """window(work, a, b) keeps only the stream positions steps a..b-1 draw (re-indexed from 0) and balances
    those steps to the same blocks as the whole work; the windows of a cut hold the stream about once."""
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    pool = _PicklingPool()
    make_plan(spec, index=index, client=pool, ranges=1, **kw)
    (work,) = pool.works  # one range: the window of every step
    assert work.windowed and work.step0 == 0
    (tmp_path / "again").mkdir()
    spec, index, kw = CASES["web4k_dp8"](tmp_path / "again")
    whole = _whole_work(spec, index, kw)
    cuts = split_ranges(whole, 4, 0)
    assert len(cuts) == 4
    wins = [window(whole, a, b) for a, b in cuts]
    total = sum(len(t) for t in whole.num_tokens)
    held = sum(len(t) for w in wins for t in w.num_tokens)
    assert held < 1.1 * sum(int(p) for p in whole.ptr.last() - whole.ptr.row(0))  # the drawn positions, about once
    assert all(sum(len(t) for t in w.num_tokens) < total for w in wins)
    for (a, b), w in zip(cuts, wins, strict=True):
        back = pickle.loads(pickle.dumps(w))
        assert w.assignment is not None and back.assignment is not None  # sent as positions and counts a step
        for name in ("pos", "step"):
            for x, y in zip(getattr(w.assignment, name), getattr(back.assignment, name), strict=True):
                assert x.dtype == y.dtype and np.array_equal(x, y)
        step_bytes = sum(s.nbytes for s in w.assignment.step)
        with monkeypatch.context() as m:  # the same window with its steps sent as they are
            m.setattr(ranges_module._AssignedCounts, "of", classmethod(lambda cls, asg, *_: asg))
            plain = len(pickle.dumps(w))
        assert plain - len(pickle.dumps(w)) > 0.8 * step_bytes - 4 * (b - a) * len(w.names)
        got = list(balanced_blocks(back, a, b, None))
        want = list(balanced_blocks(whole, a, b, None))
        assert [g.steps for g in got] == [x.steps for x in want]
        for g, x in zip(got, want, strict=True):
            for name in ("source", "sample", "offset", "length", "lane", "image_tokens"):
                assert np.array_equal(getattr(g.segs, name), getattr(x.segs, name))
                assert getattr(g.segs, name).dtype == getattr(x.segs, name).dtype
            assert np.array_equal(g.rank, x.rank) and np.array_equal(g.micro_batch, x.micro_batch)
    with pytest.raises(ValueError, match="not within the work's steps"):
        window(whole, 0, whole.steps + 1)
    with pytest.raises(ValueError, match="cannot be cut from a window"):
        window(wins[1], cuts[1][0], cuts[1][1])


def _whole_work(spec: Any, index: Any, kw: dict[str, Any]) -> PlanWork:
    """The whole PlanWork make_plan builds (caught on its way to the ranges)."""
    caught: list[PlanWork] = []
    real = distributed_module.window

    def catch(work: PlanWork, first: int, stop: int) -> PlanWork:
        caught.append(work)
        return real(work, first, stop)

    distributed_module.window = catch  # type: ignore[assignment]
    try:
        make_plan(spec, index=index, client=_PicklingPool(), ranges=1, **kw)
    finally:
        distributed_module.window = real  # type: ignore[assignment]
    return caught[0]


def test_the_embedded_cluster_is_wanted_only_for_a_large_enough_index_and_two_workers(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = spec_of(tmp_path, ["web", "code"], steps=4)
    assert indexed_samples(spec) == 0  # nothing indexed yet
    for name, n in (("web", 300), ("code", 200)):
        files = IndexFiles.of(tmp_path, name)
        write_table(index_of(np.full(n, 50)), files.samples, TableKind.INDEX, {"fingerprint": name})
    assert indexed_samples(spec) == 500
    assert not wants_cluster(spec, 2)  # far below CLUSTER_MIN_SAMPLES
    monkeypatch.setattr(distributed_module, "CLUSTER_MIN_SAMPLES", 500)
    assert wants_cluster(spec, 2) and not wants_cluster(spec, 1)


class _ElsewherePool(_PicklingPool):
    """Workers on another machine: each task writes its files into a folder of its own."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        work, out, *rest = args
        elsewhere = out.parent / f"elsewhere-{len(self.sent)}"
        return super().submit(fn, work, elsewhere, *rest, **kwargs)


def test_a_cluster_that_does_not_share_the_workdir_is_refused(tmp_path: Path) -> None:
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    with pytest.raises(PlanError, match="needs the workdir on a filesystem every worker shares"):
        make_plan(spec, index=index, client=_ElsewherePool(), ranges=2, **kw)
    assert not (spec.plans_dir / "plan.json").exists() and not any(spec.plans_dir.glob("*/plan.json"))


def test_a_windows_assignment_goes_as_counts_only_where_they_are_smaller() -> None:
    """A source drawing in most of the window's steps sends counts a step; one drawing in few (many sources, small
    dp) sends its steps as they are, so the wire never holds a (steps x sources) table; both come back exact."""
    from loomdata.planning._lookahead import StepAssignment

    rng = np.random.default_rng(3)
    step0, steps = 100, 400
    busy = np.sort(rng.integers(step0, step0 + steps, 3000)).astype(np.int32)  # ~7 a step
    sparse = np.sort(rng.choice(np.arange(step0, step0 + steps), 20, replace=False)).astype(np.int32)
    none = np.zeros(0, dtype=np.int32)
    asg = StepAssignment([np.arange(len(s), dtype=np.uint32) for s in (busy, sparse, none)], [busy, sparse, none])
    wire = ranges_module._AssignedCounts.of(asg, step0, steps)
    assert isinstance(wire, ranges_module._AssignedCounts)
    assert wire.counts[0] is not None and wire.steps[0] is None  # 400 counts < 3000 steps
    assert wire.counts[1] is None and wire.steps[1] is not None  # 20 steps < 400 counts
    back = pickle.loads(pickle.dumps(wire)).restore()
    for x, y in zip(asg.step, back.step, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    outside = StepAssignment([np.zeros(1, dtype=np.uint32)], [np.array([step0 + steps], dtype=np.int32)])
    assert ranges_module._AssignedCounts.of(outside, step0, steps) is outside


def test_sweep_removes_only_this_users_old_unlocked_shared_work_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder whose planning process is gone (its lock free) is removed; one in use (locked), one just made,
    and anything not named as the shared work stay."""
    import fcntl
    import os

    monkeypatch.setattr(distributed_module, "_MEMORY_FS", tmp_path)
    gone, used, young = (tmp_path / f"loom-plan-{n}" for n in ("gone", "used", "young"))
    other, unlocked = tmp_path / "someone-else", tmp_path / "loom-plan-nolock"
    for folder in (gone, used, young, other, unlocked):
        folder.mkdir()
        if folder != unlocked:  # its process died between making the folder and its lock
            (folder / "lock").touch()
        (folder / "0.npy").write_bytes(b"x")
    for folder in (gone, used, other, unlocked):
        os.utime(folder, (1.0, 1.0))
    with (used / "lock").open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        distributed_module._sweep_memory_fs()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loom-plan-used", "loom-plan-young", "someone-else"]


def test_shared_work_in_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    """A worker never unpickles shared work from a folder another user could have written into."""

    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "work.pkl").write_bytes(b"not read")
    folder.chmod(0o777)
    with pytest.raises(PlanError, match="refusing to read it"):
        distributed_module.SharedWork(folder).load()


def _lookahead_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """(last step + 1, final) of every look-ahead planning works out from here on."""
    from loomdata.planning import _plan as plan_module

    calls: list[tuple[int, bool]] = []
    real = plan_module.assign_steps

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append((args[8], kwargs.get("final", True)))
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_module, "assign_steps", counting)
    return calls


@pytest.mark.parametrize("name", ["web4k_dp8", "web4k_dp1", "curriculum", "long_lane_cp4"])
def test_the_first_ranges_go_out_on_a_prefix_look_ahead_and_give_the_one_process_plan(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a cluster a fresh plan's first ranges are balanced on a look-ahead over a prefix of the steps (final
    False), the whole look-ahead after; where they agree on those ranges' steps, nothing is balanced twice (a
    mixture schedule and a long lane too)."""
    from loomdata.planning import _plan as plan_module

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    monkeypatch.setattr(plan_module, "EARLY_MARGIN", 0)
    monkeypatch.setattr(plan_module, "SPECULATE", True)
    spec, index, kw = CASES[name](tmp_path)
    single = make_plan(spec, index=index, **kw).plan_dir
    want = _files(single.rename(single.with_name("single")))
    calls = _lookahead_calls(monkeypatch)
    pool = _PicklingPool()
    spec, index, kw = CASES[name](tmp_path)
    got = _files(make_plan(spec, index=index, client=pool, ranges=6, **kw).plan_dir)
    steps = spec.training.steps
    assert len(calls) == 2 and calls[0][0] < steps and not calls[0][1] and calls[1] == (steps, True)
    cuts = [(w.step0, w.step0 + w.rows) for w in pool.works]
    assert len(cuts) == 6 and all(a[1] == b[0] for a, b in itertools.pairwise(cuts))  # each range once
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []


def test_first_ranges_whose_prefix_look_ahead_disagrees_are_balanced_again_on_the_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix that ends before the first ranges do (a margin below the reach of a move) cannot agree with the
    whole look-ahead there: those ranges are balanced again on the whole work, and the plan is the same bytes."""
    from loomdata.planning import _plan as plan_module

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    monkeypatch.setattr(plan_module, "EARLY_MARGIN", -8 * (spec.planning.lookahead + 1) - 3)
    single = make_plan(spec, index=index, **kw).plan_dir
    want = _files(single.rename(single.with_name("single")))
    calls = _lookahead_calls(monkeypatch)
    pool = _PicklingPool()
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    got = _files(make_plan(spec, index=index, client=pool, ranges=6, **kw).plan_dir)
    assert len(calls) == 2 and not calls[0][1]
    cuts = [(w.step0, w.step0 + w.rows) for w in pool.works]
    early = plan_module.early_ranges(6, 1)
    assert len(cuts) == 6 + early and cuts[:early] == cuts[early : 2 * early]  # the first ranges twice
    assert calls[0][0] == cuts[early - 1][1] - 3  # the prefix ended 3 steps before the first ranges did
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []


def test_a_prefix_past_the_first_ranges_can_still_disagree_and_the_plan_is_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A margin does not ensure agreement: on long_lane_cp4 a prefix ending 3 steps past the first ranges already
    differs from the whole look-ahead within them (a choice near the prefix's end moves an earlier step), so
    `agrees` refuses them; they are balanced again on the whole work, and the plan is the same bytes."""
    from loomdata.planning import _plan as plan_module

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    monkeypatch.setattr(plan_module, "SPECULATE", True)
    monkeypatch.setattr(plan_module, "EARLY_SHARE", 0.5)  # (the first half of the ranges: their last step is one
    # whose choices a prefix 3 steps longer gets wrong; at one range a worker that prefix happens to agree)
    spec, index, kw = CASES["long_lane_cp4"](tmp_path)
    monkeypatch.setattr(plan_module, "EARLY_MARGIN", -8 * (spec.planning.lookahead + 1) + 3)
    single = make_plan(spec, index=index, **kw).plan_dir
    want = _files(single.rename(single.with_name("single")))
    calls = _lookahead_calls(monkeypatch)
    pool = _PicklingPool()
    spec, index, kw = CASES["long_lane_cp4"](tmp_path)
    got = _files(make_plan(spec, index=index, client=pool, ranges=6, **kw).plan_dir)
    cuts = [(w.step0, w.step0 + w.rows) for w in pool.works]
    early = plan_module.early_ranges(6, 1)
    assert calls[0] == (cuts[early - 1][1] + 3, False)  # the prefix ended 3 steps past the first ranges
    assert len(cuts) == 6 + early and cuts[:early] == cuts[early : 2 * early]  # the first ranges twice
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []


class _LostFuture:
    """A Dask-like future lost in the driver (a scheduler reconnect) while its task may still run on a worker."""

    status = "lost"

    def __init__(self, inner: Future[Any]) -> None:
        self.inner = inner

    def result(self, timeout: float | None = None) -> Any:
        self.inner.result(timeout)  # (the task itself ran; only the driver lost sight of it)
        raise CancelledError("lost on reconnect")

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return True


def test_a_first_range_lost_in_the_driver_is_not_sent_again_beside_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a disagreement a first range is sent again only once its first run ended (a result or its own error):
    one whose future is lost in the driver may still be writing the same partition files, so it is an error."""
    from loomdata.planning import _plan as plan_module

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    monkeypatch.setattr(plan_module, "SPECULATE", True)
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    monkeypatch.setattr(plan_module, "EARLY_MARGIN", -8 * (spec.planning.lookahead + 1) - 3)  # (disagrees)
    pool = _PicklingPool()
    real = pool.submit

    def submit(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        fut = real(fn, *args, **kwargs)
        return _LostFuture(fut) if len(pool.sent) == 1 else fut

    pool.submit = submit  # type: ignore[method-assign]
    with pytest.raises(CancelledError, match="lost on reconnect"):
        make_plan(spec, index=index, client=pool, ranges=6, **kw)
    assert len(pool.sent) == plan_module.early_ranges(6, 1)  # none sent twice


def test_a_failed_whole_look_ahead_waits_for_the_first_ranges_before_raising(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the whole look-ahead fails, the first ranges already running (they write into the plan's temporary
    folder, which is then removed) have ended before the error is raised; those not started never run."""
    import threading

    from loomdata.planning import _plan as plan_module

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    monkeypatch.setattr(plan_module, "SPECULATE", True)
    monkeypatch.setattr(plan_module, "EARLY_MARGIN", 0)  # (a prefix short of the last step)
    monkeypatch.setattr(plan_module, "EARLY_SHARE", 0.5)  # 3 of 6 first ranges: one more than the pool's threads
    gate = threading.Event()  # the running ranges are held until a second after the whole look-ahead fails
    real_assign = plan_module.assign_steps

    def assign(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("final", True):
            threading.Timer(1.0, gate.set).start()
            raise MemoryError("the whole look-ahead")
        return real_assign(*args, **kwargs)

    monkeypatch.setattr(plan_module, "assign_steps", assign)
    pool = _PicklingPool()
    futures: list[Future[Any]] = []
    real = pool.submit

    def held(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            gate.wait(30)
            return fn(*a, **kw)

        futures.append(real(run, *args, **kwargs))
        return futures[-1]

    pool.submit = held  # type: ignore[method-assign]
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    with pytest.raises(MemoryError, match="the whole look-ahead"):
        make_plan(spec, index=index, client=pool, ranges=6, **kw)
    assert len(futures) == plan_module.early_ranges(6, 1) == 3
    assert all(f.done() for f in futures)  # (the pool's 2 threads ran two; the third, queued, was cancelled)
    assert [f.cancelled() for f in futures] == [False, False, True]


def test_the_whole_look_ahead_is_worked_out_once_however_often_it_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculation.finish drops the streams' counts as it reads them: asked again, it hands back the same work
    instead of running over emptied streams."""
    from loomdata.planning import _plan as plan_module
    from loomdata.planning._distributed import Speculation

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 30)
    monkeypatch.setattr(plan_module, "SPECULATE", True)
    monkeypatch.setattr(plan_module, "EARLY_MARGIN", 0)
    calls = _lookahead_calls(monkeypatch)
    seen: list[bool] = []
    real = plan_module.plan_ranges

    def plan_ranges(client: Any, work: Any, *args: Any) -> Any:
        if isinstance(work, Speculation):
            seen.append(work.finish() is work.finish())
        return real(client, work, *args)

    monkeypatch.setattr(plan_module, "plan_ranges", plan_ranges)
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    make_plan(spec, index=index, client=_PicklingPool(), ranges=6, **kw)
    assert seen == [True] and [final for _, final in calls] == [False, True]


def test_array_files_never_reuse_a_name_whatever_gaps_the_folder_has(tmp_path: Path) -> None:
    """A shared folder's array files are numbered past the highest there: with a gap (0.npy and 2.npy), a new array
    goes to 3.npy and 2.npy is left as it was."""
    np.save(tmp_path / "0.npy", np.zeros(4))
    np.save(tmp_path / "2.npy", np.ones(4))
    kept = (tmp_path / "2.npy").read_bytes()
    big = np.arange(distributed_module._FILE_MIN, dtype=np.int64)
    shared = distributed_module.SharedWork.write(big, tmp_path, name="w.pkl")  # type: ignore[arg-type]
    assert (tmp_path / "2.npy").read_bytes() == kept
    assert np.array_equal(np.load(tmp_path / "3.npy"), big)
    assert np.array_equal(shared.load(), big)  # type: ignore[arg-type]


def test_arrays_made_in_the_shared_folder_are_shared_as_they_are(tmp_path: Path) -> None:
    """_file_arrays makes large arrays as maps of new files in the folder (small ones in memory): a work holding them
    or contiguous slices of them is written without copying them (its pickle names the file and the items), and a
    worker reads back the same values; an array that is none of them is written as before."""
    saved: dict[int, tuple[str, np.ndarray]] = {}
    alloc = distributed_module._file_arrays(tmp_path, saved)
    n = distributed_module._FILE_MIN
    big, pos = alloc(n, np.int32), alloc(n, np.uint32)
    small = alloc(4, np.int64)
    big[:] = np.arange(n, dtype=np.int32)
    pos[:] = np.arange(n, dtype=np.uint32)[::-1]
    small[:] = 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a0.npy", "a1.npy"]
    work = {"steps": [big[: n // 2], big[n // 2 :]], "pos": pos, "small": small, "other": big[::2].copy()}
    shared = distributed_module.SharedWork.write(work, tmp_path, saved=saved)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir() if p.stem.isdigit()) == ["0.npy"]  # "other" alone
    got: Any = shared.load()
    assert np.array_equal(got["steps"][0], big[: n // 2]) and np.array_equal(got["steps"][1], big[n // 2 :])
    assert np.array_equal(got["pos"], pos) and np.array_equal(got["small"], small)
    assert np.array_equal(got["other"], work["other"])
    assert np.array_equal(np.load(tmp_path / "a0.npy"), big)  # what any reader of the file sees


def test_an_array_the_shared_folder_has_no_room_for_is_made_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the folder's filesystem cannot reserve an array's room (full), _file_arrays makes it in memory and
    leaves no file: a full memory filesystem is never met later, when a page of a map is first written."""

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(distributed_module.os, "posix_fallocate", full)
    saved: dict[int, tuple[str, np.ndarray]] = {}
    arr = distributed_module._file_arrays(tmp_path, saved)(distributed_module._FILE_MIN, np.int64)
    assert arr.shape == (distributed_module._FILE_MIN,) and arr.flags.writeable
    assert list(tmp_path.iterdir()) == [] and saved == {}


def test_a_whole_work_that_does_not_fit_leaves_nothing_of_itself_in_the_shared_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where writing the whole work beside the first fails (the memory filesystem full), its pickle and the array
    files it wrote are removed, and forgotten as shared (nothing else would remove them before the plan ends)."""
    saved: dict[int, tuple[str, np.ndarray]] = {}
    first = np.arange(distributed_module._FILE_MIN, dtype=np.int64)
    shared = distributed_module.SharedWork.write([first], tmp_path, saved=saved)  # type: ignore[arg-type]
    before = sorted(p.name for p in tmp_path.iterdir())
    real = np.save
    written: list[str] = []

    def save(path: Path, arr: np.ndarray, **kwargs: Any) -> None:
        if written:
            raise OSError(28, "No space left on device")
        written.append(Path(path).name)
        real(path, arr, **kwargs)

    monkeypatch.setattr(np, "save", save)
    whole = [first, first + 1, first + 2]  # the first's array shared, two of its own
    assert distributed_module._share_more(shared, whole, saved) is None  # type: ignore[arg-type]
    assert written == ["1.npy"]  # one of its own written before the filesystem filled
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert [name for name, _ in saved.values()] == ["0.npy"]


def test_a_cluster_filling_this_hosts_cores_works_the_look_ahead_out_once_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default (SPECULATE None) a plan speculates only where this host has a core beside the cluster's worker
    threads on it: a pool with more threads than cores gets the whole look-ahead before any range."""
    import os

    calls = _lookahead_calls(monkeypatch)
    pool = _PicklingPool()
    pool._max_workers = os.cpu_count() or 1  # type: ignore[attr-defined]  (at least the usable cores)
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    make_plan(spec, index=index, client=pool, ranges=6, **kw)
    assert calls == [(spec.training.steps, True)]


def test_the_first_ranges_are_a_share_of_all_a_whole_number_a_worker() -> None:
    from loomdata.planning._plan import EARLY_SHARE, early_ranges

    assert EARLY_SHARE == 0.25  # one range a worker at RANGES_PER_WORKER 4 (session 32; 0.5 before)
    assert [early_ranges(n, 2) for n in (1, 2, 3, 6, 8, 12, 16)] == [0, 0, 1, 2, 2, 2, 4]
    assert [early_ranges(n, 1) for n in (1, 3, 8)] == [0, 1, 2] and early_ranges(8, 3) == 2


def test_assignments_agree_only_on_the_same_positions_in_the_same_steps_before_a_step() -> None:
    from loomdata.planning._lookahead import StepAssignment

    def asg(pos: list[list[int]], step: list[list[int]]) -> StepAssignment:
        return StepAssignment([np.array(p, dtype=np.uint32) for p in pos], [np.array(s, dtype=np.int32) for s in step])

    a = asg([[0, 1, 2, 3], [0, 1]], [[0, 0, 1, 2], [1, 2]])
    assert a.agrees(asg([[0, 1, 2, 4], [0, 1, 5]], [[0, 0, 1, 2], [1, 2, 2]]), 2)  # steps 0-1 alike
    assert not a.agrees(asg([[0, 1, 2, 4], [0, 1, 5]], [[0, 0, 1, 2], [1, 2, 2]]), 3)  # step 2 differs
    assert not a.agrees(asg([[0, 2, 1, 3], [0, 1]], [[0, 0, 1, 2], [1, 2]]), 1)  # other positions in step 0
    assert not a.agrees(asg([[0, 1, 2, 3], [0, 1]], [[0, 1, 1, 2], [1, 2]]), 2)  # position 1 a step later
    assert not a.agrees(asg([[0, 1, 2, 3], [1]], [[0, 0, 1, 2], [1]]), 2)  # a position fewer


def test_the_first_ranges_can_be_cut_larger_than_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """split_ranges' `lead` (k, size): the first k ranges each about `size` times a later one's drawn segments;
    (k, 1.0) cuts as without it."""
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 10)
    spec, index, kw = CASES["web4k_dp8"](tmp_path)
    whole = _whole_work(spec, index, kw)
    cum = np.concatenate([[0], np.cumsum(np.diff(whole.ptr.totals()))])

    def drawn(cuts: list[tuple[int, int]]) -> list[int]:
        return [int(cum[b] - cum[a]) for a, b in cuts]

    assert split_ranges(whole, 8, 0, (2, 1.0)) == split_ranges(whole, 8, 0)
    even, lead = drawn(split_ranges(whole, 8, 0)), drawn(split_ranges(whole, 8, 0, (2, 1.5)))
    assert len(lead) == 8 and sum(lead) == sum(even)
    assert min(lead[:2]) > max(lead[2:])  # (partition bounds make them about, not exactly, 1.5x)
    assert 1.2 < np.mean(lead[:2]) / np.mean(lead[2:]) < 1.8
