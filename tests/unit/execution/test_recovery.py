"""Recovery bookkeeping: which actors are lost, what a round records, back-off on failure."""

from __future__ import annotations

from dataclasses import dataclass

from loomdata.execution._recovery import RecoveryLog, lost_indices
from loomdata.schemas import ExecutionError


@dataclass
class _Future:
    """Stands in for a distributed.Future: only `status` is read."""

    status: str


def test_lost_actors_are_those_whose_future_is_not_finished() -> None:
    futures = [_Future("finished"), _Future("error"), _Future("finished"), _Future("cancelled")]
    assert lost_indices(futures) == [1, 3]
    assert lost_indices([]) == []


def test_a_round_records_recreated_actors_and_nothing_when_none_were_lost() -> None:
    log = RecoveryLog(every_s=0.2, max_pause_s=5.0)
    assert [log.succeeded(n, 0.1, when=1.0) for n in (0, 3, 0)] == [0.2, 0.2, 0.2]
    assert log.stats.recovered == 3 and log.stats.rounds == 1 and log.stats.history == [(1.0, 3, 0.1)]
    assert log.stats.failures == 0 and log.stats.last_error is None


def test_a_failed_recovery_is_recorded_and_retried_later() -> None:
    log = RecoveryLog(every_s=0.2, max_pause_s=5.0)
    pauses = [log.failed(ExecutionError("every worker of tcp://x is gone")) for _ in range(6)]
    assert pauses == sorted(pauses) and pauses[0] > 0.2 and pauses[-1] == 5.0  # backs off, capped
    assert log.stats.failures == 6 and log.stats.recovered == 0
    assert log.stats.last_error == "ExecutionError: every worker of tcp://x is gone"


def test_the_back_off_restarts_after_a_successful_recovery() -> None:
    log = RecoveryLog(every_s=0.2, max_pause_s=5.0)
    err = ExecutionError("worker died during recovery")
    pauses = [log.failed(err), log.failed(err), log.succeeded(1, 0.1, 2.0), log.failed(err)]
    assert pauses == [0.4, 0.8, 0.2, 0.4]
