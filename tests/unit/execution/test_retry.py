"""The one retry helper: budgets in time and attempts, fatal errors at once, pauses, the give-up error."""

from __future__ import annotations

import pytest

from loomdata.execution._retry import Deadline, backoff, retry_until
from loomdata.schemas.errors import ExecutionError, LoomError


class Clock:
    """A fake monotonic clock that `sleep` advances: no test waits."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def flaky(failures: list[Exception]) -> tuple[list[int], object]:
    calls: list[int] = []

    def attempt() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return "ok"

    return calls, attempt


def test_retries_until_it_succeeds_with_pauses_and_resets() -> None:
    clock = Clock()
    calls, attempt = flaky([OSError("a"), OSError("b")])
    resets: list[str] = []
    out = retry_until(
        attempt,  # type: ignore[arg-type]
        retryable=lambda e: isinstance(e, OSError),
        give_up=lambda e, n: ExecutionError(f"gave up after {n}"),
        within_s=10,
        pause_s=lambda k: 0.5 * k,
        on_retry=lambda e: resets.append(str(e)),
        clock=clock,
        sleep=clock.sleep,
    )
    assert out == "ok" and len(calls) == 3 and clock.slept == [0.5, 1.0] and resets == ["a", "b"]


def test_a_fatal_error_is_raised_at_once() -> None:
    clock = Clock()
    calls, attempt = flaky([LoomError("bad data")])
    with pytest.raises(LoomError, match="bad data"):
        retry_until(
            attempt,  # type: ignore[arg-type]
            retryable=lambda e: not isinstance(e, LoomError),
            give_up=lambda e, n: ExecutionError("never"),
            within_s=10,
            clock=clock,
            sleep=clock.sleep,
        )
    assert len(calls) == 1 and clock.slept == []


def test_the_time_budget_ends_with_the_give_up_error_from_the_last() -> None:
    clock = Clock()
    _calls, attempt = flaky([OSError(str(k)) for k in range(100)])
    with pytest.raises(ExecutionError, match="after 5 tries") as info:
        retry_until(
            attempt,  # type: ignore[arg-type]
            retryable=lambda e: True,
            give_up=lambda e, n: ExecutionError(f"after {n} tries"),
            within_s=1.0,
            pause_s=0.25,
            clock=clock,
            sleep=clock.sleep,
        )
    assert isinstance(info.value.__cause__, OSError) and str(info.value.__cause__) == "4"


def test_the_attempt_budget_and_a_budget_is_required() -> None:
    calls, attempt = flaky([OSError("x")] * 5)
    with pytest.raises(ExecutionError, match="3"):
        retry_until(
            attempt,  # type: ignore[arg-type]
            retryable=lambda e: True,
            give_up=lambda e, n: ExecutionError(str(n)),
            attempts=3,
            sleep=lambda s: None,
        )
    assert len(calls) == 3
    with pytest.raises(ValueError, match="needs a budget"):
        retry_until(lambda: 1, retryable=lambda e: True, give_up=lambda e, n: e)


def test_deadline_and_backoff() -> None:
    clock = Clock()
    d = Deadline(2.0, clock)
    assert d.left == 2.0 and not d.expired
    clock.now = 3.0
    assert d.left == 0.0 and d.expired
    assert [backoff(k, base_s=0.2, cap_s=1.0) for k in (1, 2, 3)] == [0.4, 0.8, 1.0]
