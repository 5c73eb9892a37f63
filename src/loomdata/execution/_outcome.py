"""What became of a call to an actor: `ok`, `lost` (its worker died), `refused` or `error`, sorted in one place.

A call to a Dask actor fails in three different ways that callers must tell apart:
- lost: the actor's worker died. The scheduler errs the actor's future within milliseconds, so this
  is a local check (`is_lost`); the control loop recreates the actor, nobody else needs to act.
- refused: the handle refused the call before sending it (a handle whose actor was lost a moment ago
  raises at once), or the actor answered that it is stopping or retired; the actor is alive or
  about to be known lost, so the caller retries on the next round.
- error: the actor is alive and the call failed or timed out: a real failure to report.
Callers issue many calls first (`issue`, non-blocking: actor methods return futures) and then wait
for each (`Call.outcome`), so a round of calls to N actors costs one round trip, not N.

Inside an actor (a Data Constructor reading from loaders) there is no actor future to ask, so
`sort_read_failure` sorts a failed read with the same kinds from what it raised and whether it was
issued on a route that has been replaced since (`stale`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from distributed import Future

from loomdata.execution._loader import LoaderRetired
from loomdata.execution._recovery import is_lost
from loomdata.execution.protocol import ExecutorUnavailable
from loomdata.schemas.errors import LoomError

__all__ = ["Call", "Kind", "Outcome", "best_effort", "issue", "sort_read_failure"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Kind(str, enum.Enum):
    """What became of an actor call (a str enum: compares equal to its value)."""

    OK = "ok"
    LOST = "lost"
    """The actor is unreachable (its worker died or the link broke): wait for its replacement, retry."""
    REFUSED = "refused"
    """The actor or its handle refused the call (stopping, retired, a replaced route): retry on the current one."""
    ERROR = "error"
    """A real error (bad data, a bad request, a timeout of a live actor): report it, do not retry."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """One call's fate: its kind, its value (kind "ok") or the exception (the other kinds)."""

    kind: Kind
    value: T | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.kind is Kind.OK


def _sort(future: Future | None, error: BaseException, *, refused: bool) -> Kind:
    if future is not None and is_lost(future):
        return Kind.LOST
    if refused or isinstance(error, ExecutorUnavailable):
        return Kind.REFUSED
    return Kind.ERROR


def sort_read_failure(error: Exception, *, stale: bool = False) -> Kind:
    """Sort a failed read issued from inside an actor; `stale`: issued before the latest re-route.

    A stale call is refused whatever it raised (a retired or released actor answers with assorted
    errors, even a LoomError wrapping them); otherwise LoomErrors are data errors and anything else
    (OSError, CommClosedError, a cancelled or released Dask future) means the actor is unreachable.
    """
    if stale or isinstance(error, LoaderRetired):
        return Kind.REFUSED
    if isinstance(error, LoomError):
        return Kind.ERROR
    return Kind.LOST


class Call(Generic[T]):
    """A call in flight to an actor whose actor future is `future` (None: no liveness check)."""

    def __init__(self, future: Future | None, pending: Any = None, refused: BaseException | None = None) -> None:
        self._future = future
        self._pending = pending
        self._refused = refused

    def done(self) -> bool:
        """Whether waiting for the outcome would return at once."""
        return (
            self._pending is None or bool(self._pending.done()) or (self._future is not None and is_lost(self._future))
        )

    def outcome(self, timeout: float) -> Outcome[T]:
        """Wait at most `timeout` s for the answer and sort it."""
        if self._refused is not None:
            return Outcome(_sort(self._future, self._refused, refused=True), error=self._refused)
        try:
            return Outcome(Kind.OK, value=self._pending.result(timeout=timeout))
        except Exception as e:  # the one place an actor call's failure is sorted: see the module docstring
            return Outcome(_sort(self._future, e, refused=False), error=e)


def issue(future: Future | None, handle: Any, method: str, *args: Any) -> Call[Any]:
    """Start `handle.method(*args)` (an actor call; `future` is the actor's task future) without waiting."""
    try:
        return Call(future, getattr(handle, method)(*args))
    except Exception as e:  # the handle of an actor lost a moment ago refuses calls (even the attribute) at once
        return Call(future, refused=e)


def best_effort(what: str, fn: Callable[[], object]) -> bool:
    """Run a clean-up step whose failure changes nothing (the scheduler or actor is already gone); True if it ran."""
    try:
        fn()
        return True
    except Exception as e:  # clean-up only: what it would undo is already undone
        logger.debug("loomdata: %s skipped (%s: %s)", what, type(e).__name__, e)
        return False
