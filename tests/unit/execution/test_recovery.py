"""The recovery watchdog's bookkeeping: which actors are lost, what a poll records, back-off on failure."""

from __future__ import annotations

from dataclasses import dataclass

from loomdata.execution._recovery import Watchdog, lost_indices
from loomdata.schemas import ExecutionError


@dataclass
class _Future:
    """Stands in for a distributed.Future: only `status` is read."""

    status: str


def test_lost_actors_are_those_whose_future_is_not_finished() -> None:
    futures = [_Future("finished"), _Future("error"), _Future("finished"), _Future("cancelled")]
    assert lost_indices(futures) == [1, 3]  # type: ignore[arg-type]
    assert lost_indices([]) == []


def test_a_poll_records_recreated_actors_and_nothing_when_none_were_lost() -> None:
    results = iter([0, 3, 0])
    dog = Watchdog(lambda: next(results), every_s=0.2)
    assert [dog.poll_once() for _ in range(3)] == [0.2, 0.2, 0.2]
    assert dog.stats.recovered == 3 and dog.stats.rounds == 1 and len(dog.stats.history) == 1
    assert dog.stats.failures == 0 and dog.stats.last_error is None


def test_a_failed_recovery_is_recorded_and_retried_later() -> None:
    def recover() -> int:
        raise ExecutionError("every worker of tcp://x is gone")

    dog = Watchdog(recover, every_s=0.2)
    pauses = [dog.poll_once() for _ in range(6)]
    assert pauses == sorted(pauses) and pauses[0] > 0.2 and pauses[-1] == 5.0  # backs off, capped
    assert dog.stats.failures == 6 and dog.stats.recovered == 0
    assert dog.stats.last_error == "ExecutionError: every worker of tcp://x is gone"


def test_the_back_off_restarts_after_a_successful_recovery() -> None:
    outcomes: list[int | None] = [None, None, 1, None]

    def recover() -> int:
        n = outcomes.pop(0)
        if n is None:
            raise ExecutionError("worker died during recovery")
        return n

    dog = Watchdog(recover, every_s=0.2)
    assert [dog.poll_once() for _ in range(4)] == [0.4, 0.8, 0.2, 0.4]
