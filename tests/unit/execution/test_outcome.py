"""Sorting an actor call's outcome: ok, lost (its worker died), refused (at once, or stopping), error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loomdata.execution._outcome import best_effort, issue
from loomdata.execution.protocol import ExecutorUnavailable


@dataclass
class _Future:
    status: str = "finished"


class _Pending:
    """Stands in for an ActorFuture: `result` returns or raises what it was given."""

    def __init__(self, value: Any = None, error: Exception | None = None) -> None:
        self.value, self.error = value, error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Handle:
    def __init__(self, **methods: _Pending) -> None:
        self._methods = methods

    def __getattr__(self, name: str) -> Any:
        if name not in self._methods:
            raise RuntimeError("Worker holding Actor was lost.  Status: error")
        return lambda *args: self._methods[name]


def test_ok_error_and_stopping() -> None:
    live = _Future()
    h = _Handle(
        metrics=_Pending({"a": 1}),
        set_route=_Pending(error=TimeoutError()),
        take=_Pending(error=ExecutorUnavailable("stopping")),
    )
    assert issue(live, h, "metrics").outcome(1.0).value == {"a": 1}
    assert issue(live, h, "set_route", 0, None).outcome(1.0).kind == "error"  # alive and did not answer
    assert issue(live, h, "take", 0, 1).outcome(1.0).kind == "refused"


def test_lost_wins_over_any_error_and_a_refusal_at_once() -> None:
    dead = _Future("error")
    h = _Handle(metrics=_Pending(error=OSError("Unable to contact Actor's worker")))
    assert issue(dead, h, "metrics").outcome(1.0).kind == "lost"
    call = issue(_Future(), h, "close")  # the handle refuses before sending
    assert call.done() and call.outcome(1.0).kind == "refused"
    assert issue(dead, h, "close").outcome(1.0).kind == "lost"


def test_best_effort_reports_whether_it_ran() -> None:
    assert best_effort("nothing", lambda: None) is True
    assert best_effort("unpublish", lambda: {}["missing"]) is False
