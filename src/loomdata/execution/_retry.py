"""Deadlines and retries, written once: `Deadline`, `backoff`, `retry_until`.

Serving retries in three places (a client asking for a step while a constructor is recreated, the
executor creating a loader whose worker died, a constructor reading from a loader being replaced);
each says what is worth retrying and what to raise when the time runs out, and this module does the
counting, the pausing and the clock. The clock and the sleep are parameters, so unit tests run it
without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["Deadline", "backoff", "retry_until"]

T = TypeVar("T")


@dataclass
class Deadline:
    """A point `seconds` from now on a monotonic clock."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    _end: float = field(init=False)

    def __post_init__(self) -> None:
        self._end = self.clock() + self.seconds

    @property
    def left(self) -> float:
        """Seconds until the deadline (0 once passed)."""
        return max(0.0, self._end - self.clock())

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.clock() >= self._end


def backoff(attempt: int, *, base_s: float, cap_s: float, factor: float = 2.0) -> float:
    """The pause before retry number `attempt` (1, 2, ...): base x factor^attempt, at most `cap_s`."""
    return float(min(base_s * factor**attempt, cap_s))


def retry_until(
    attempt: Callable[[], T],
    *,
    retryable: Callable[[Exception], bool],
    give_up: Callable[[Exception, int], Exception],
    within_s: float | None = None,
    attempts: int | None = None,
    pause_s: float | Callable[[int], float] = 0.0,
    on_retry: Callable[[Exception], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`attempt()`'s result, retried while it raises a `retryable` error, within a time and/or attempt budget.

    A non-retryable exception propagates at once. When the budget runs out, `give_up(last, tries)`
    is raised from the last error. `on_retry(error)` runs before each pause (reset a connection...);
    `pause_s` is fixed or a function of the retry number (1, 2, ...).
    """
    if within_s is None and attempts is None:
        raise ValueError("retry_until needs a budget: within_s, attempts or both")
    deadline = Deadline(within_s, clock) if within_s is not None else None
    tries = 0
    while True:
        tries += 1
        try:
            return attempt()
        except Exception as e:
            if not retryable(e):
                raise
            out_of_time = deadline is not None and deadline.expired
            if out_of_time or (attempts is not None and tries >= attempts):
                raise give_up(e, tries) from e
            if on_retry is not None:
                on_retry(e)
            sleep(pause_s(tries) if callable(pause_s) else pause_s)
