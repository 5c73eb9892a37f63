"""Shard opens ahead of the plan (`ShardOpens`) and shard checks asked from several threads (`Verifier`).

Opens are gated fakes (events), so these tests check ordering, not time: which opens run, in what order,
and who waits for whom.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loomdata.execution import _verify
from loomdata.execution._shard_opens import ShardOpens
from loomdata.execution._verify import ShardCheck, Verifier
from loomdata.schemas import SourceDataError
from loomdata.schemas.spec import SourceFormat, VerifyMode
from loomdata.sources._integrity import ShardStat

_T = 30.0  # seconds any wait in these tests may take before the test fails (never reached when correct)


class _Gated:
    """Fake opens: each shard's job records its start and blocks until that shard is released."""

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        self.started: list[int] = []
        self.gates: dict[int, threading.Event] = {}
        self.entered: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._fail = fail

    def _event(self, events: dict[int, threading.Event], shard: int) -> threading.Event:
        with self._lock:
            return events.setdefault(shard, threading.Event())

    def began(self, shard: int) -> bool:
        """Wait until the open of `shard` has started (False after `_T` seconds)."""
        return self._event(self.entered, shard).wait(_T)

    def jobs_of(self, shard: int) -> list[Callable[[], None]]:
        gate = self._event(self.gates, shard)
        entered = self._event(self.entered, shard)

        def job() -> None:
            with self._lock:
                self.started.append(shard)
            entered.set()
            assert gate.wait(_T)
            if shard in self._fail:
                raise OSError(f"shard {shard}: connection reset")

        return [job]

    def release(self, *shards: int) -> None:
        for s in shards:
            self._event(self.gates, s).set()


def test_shards_open_soonest_first_use_first_at_most_limit_at_once() -> None:
    fake = _Gated()
    opens = ShardOpens(fake.jobs_of, limit=2)
    opens.want(np.array([5, 1, 3, 7]), np.array([40, 10, 30, 20]))
    assert fake.began(1) and fake.began(7)
    assert sorted(fake.started) == [1, 7]  # first uses 10 and 20; two at once
    fake.release(7)
    assert fake.began(3)
    assert fake.started[2] == 3 and 5 not in fake.started  # the next soonest, still two at once
    fake.release(1, 3, 5)
    assert opens.settle(_T)
    assert sorted(fake.started[:2]) == [1, 7] and fake.started[2:] == [3, 5]
    assert opens.done([1, 3, 5, 7])


def test_a_shard_needed_now_starts_at_once_and_the_wait_is_for_it_alone() -> None:
    fake = _Gated()
    opens = ShardOpens(fake.jobs_of, limit=1)
    opens.want(np.array([0, 1, 2]), np.array([0, 1, 2]))
    assert fake.began(0)  # shard 0 holds the one slot, blocked
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(opens.wait, [2], _T)
        assert fake.began(2)  # needed now: started past the bound, ahead of shard 1
        assert 1 not in fake.started
        fake.release(2)
        assert waiting.result(_T) is True  # done while shard 0 is still held
    assert opens.done([2]) and not opens.done([0, 2])
    fake.release(0, 1)
    assert opens.settle(_T) and fake.started == [0, 2, 1]


def test_a_failed_open_is_not_raised_and_counts_as_done() -> None:
    fake = _Gated(fail=frozenset({4}))
    opens = ShardOpens(fake.jobs_of)
    fake.release(4)
    assert opens.wait([4], _T)  # the read that needs shard 4 opens it again and reports the error
    assert opens.done([4])


def test_a_closed_opener_starts_nothing_more() -> None:
    fake = _Gated()
    opens = ShardOpens(fake.jobs_of, limit=1)
    opens.want(np.array([0, 1]), np.array([0, 1]))
    assert fake.began(0)
    opens.close()
    fake.release(0, 1)
    assert opens.settle(_T)
    assert fake.started == [0]
    assert opens.wait([1], _T)  # nothing to wait for: the read opens it itself


def test_planning_waits_for_the_footer_alone_and_done_for_the_check_too() -> None:
    """A shard's check (a side job) still runs: `wait` (planning) returns, `done` (no request left) does not yet."""
    footers, checks = _Gated(), _Gated()
    opens = ShardOpens(footers.jobs_of, limit=1, side_of=checks.jobs_of)
    opens.want(np.array([0, 1]), np.array([0, 1]))
    assert footers.began(0) and checks.began(0)  # started together
    footers.release(0)
    assert opens.wait([0], _T)  # planned while the check is still held
    assert not opens.done([0])
    assert 1 not in footers.started  # the bound counts whole opens: shard 0 still holds the one slot
    checks.release(0)
    assert footers.began(1)
    footers.release(1)
    checks.release(1)
    assert opens.settle(_T) and opens.done([0, 1])
    assert footers.started == [0, 1] and checks.started == [0, 1]


def test_a_shard_with_side_jobs_only_is_planned_at_once() -> None:
    checks = _Gated()
    opens = ShardOpens(lambda shard: [], side_of=checks.jobs_of)
    assert opens.wait([2], _T) and checks.began(2)  # nothing planning needs: no wait on the check
    assert not opens.done([2])
    checks.release(2)
    assert opens.settle(_T) and opens.done([2])


_PATH = "/data/x.parquet"
"""A shard of local files (never opened: `stat_shard` is held by the test); the quick object check declines it."""


def _verifier() -> Verifier:
    checks = {3: ShardCheck(10, 7, "fp")}
    return Verifier("web", VerifyMode.SHARD, SourceFormat.PARQUET, checks)


def _two_checks_at_once(
    monkeypatch: pytest.MonkeyPatch, found_bytes: int
) -> tuple[list[str], Verifier, list[Future[None]]]:
    """Two threads check shard 3 (indexed at 10 bytes) while the first one's check is held; it finds `found_bytes`."""
    calls: list[str] = []
    entered, gate = threading.Event(), threading.Event()

    def stat(path: object, fmt: object, options: object = None, size: int | None = None) -> ShardStat:
        calls.append(str(path))
        entered.set()
        assert gate.wait(_T)
        return ShardStat(path=Path("x"), size_bytes=found_bytes, mtime_ns=7, fingerprint="fp")

    monkeypatch.setattr(_verify, "stat_shard", stat)
    v = _verifier()
    with ThreadPoolExecutor(2) as pool:  # a local path: the real quick check says "cannot tell", the full one runs
        first = pool.submit(v.open_shard, 3, _PATH)
        assert entered.wait(_T)
        second = pool.submit(v.open_shard, 3, _PATH)  # waits for the first instead of repeating it
        gate.set()
        wait_for([first, second], _T)
    return calls, v, [first, second]


def test_a_shard_checked_in_two_threads_at_once_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, v, futs = _two_checks_at_once(monkeypatch, found_bytes=10)
    assert [f.result() for f in futs] == [None, None]
    assert calls == [_PATH] and v.opened == {3}


def test_when_the_check_waited_for_fails_the_waiter_reports_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, v, futs = _two_checks_at_once(monkeypatch, found_bytes=11)  # rewritten: 11 bytes
    for fut in futs:
        with pytest.raises(SourceDataError, match=r"/data/x.parquet.*size 11 bytes, indexed 10"):
            fut.result()
    assert len(calls) == 2 and v.opened == set()


def test_finished_opens_keep_no_future_of_their_own() -> None:
    gated = _Gated()
    opens = ShardOpens(gated.jobs_of, limit=2)
    shards = np.arange(6)
    opens.want(shards, shards)
    gated.release(*shards.tolist())
    assert opens.wait(shards, timeout=_T) and opens.settle(timeout=_T)
    assert opens.done(shards)
    kept = {id(f) for f in [*opens._started.values(), *opens._whole.values()]}
    assert len(opens._started) == 6 and len(kept) == 1  # every finished open shares one finished future
    assert opens.wait([3], timeout=_T)  # and asking again still answers at once


@pytest.mark.parametrize(
    ("fmt", "stamp", "heads"),
    [
        (SourceFormat.PARQUET, 7, True),  # one object, size, stamp and ETag recorded: the check's HEAD opens it
        (SourceFormat.PARQUET, 0, False),  # no stamp recorded: the check sends no HEAD (edge reads instead)
        (SourceFormat.MEGATRON, 7, False),  # two objects (.idx, .bin): the check sends no HEAD
    ],
)
def test_a_shard_whose_check_sends_no_head_has_its_read_handle_opened_ahead(
    fmt: SourceFormat, stamp: int, heads: bool
) -> None:
    """`opens_handle` is the shard check's own test (`head_checked`): where the check will not HEAD the object (no
    stamp, several files), a loader's shard open also opens its read handle ahead (`open_ahead` beside the check)."""
    from loomdata.execution._plan_ahead import _check_and_handle
    from loomdata.sources._integrity import head_checked
    from loomdata.storage._arrow import ARROW_MIN_READ

    url, size = "s3://bkt/part-0", ARROW_MIN_READ + 1
    v = Verifier("src", VerifyMode.SHARD, fmt, {0: ShardCheck(size, stamp, "fp")}, versions={0: "etag"})
    assert v.opens_handle(0, url) is heads
    assert head_checked(url, fmt, None, size, stamp, "etag") is heads
    loader = SimpleNamespace(_verifier=v, _source=SimpleNamespace(storage_options=None))
    jobs = _check_and_handle(loader, 0, url)  # builds the jobs, runs none (no request)
    assert [j.func.__name__ for j in jobs] == (["open_shard"] if heads else ["open_shard", "open_ahead"])
