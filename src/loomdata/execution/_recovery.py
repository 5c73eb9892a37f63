"""Recovery bookkeeping for actors lost with their worker: Dask never recreates an actor, so the serving process does.

When a worker dies, the scheduler errs the task of every actor it held ("Worker holding Actor was
lost") and tells each client holding its future within milliseconds, so `is_lost` is a local check
of future states, no RPC. The control loop (`_loop`) checks every `Timings.recovery_every_s` and
replaces what is lost (`_actors.FleetOps.replace_lost`); `RecoveryLog` records what it did and
says how long to pause next (backing off while recovery fails, e.g. no worker is left). Plans are
deterministic, so a recreated actor serves byte for byte what the lost one would have; constructors
retry reads on the new routes and clients retry the same step on the re-published constructor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loomdata.execution._retry import backoff

__all__ = ["RecoveryLog", "RecoveryStats", "is_lost", "lost_indices"]

logger = logging.getLogger(__name__)


def is_lost(future: Any) -> bool:
    """Whether the actor behind a finished actor future is gone (its worker died, or it was released)."""
    return bool(future.status != "finished")


def lost_indices(futures: Iterable[Any]) -> list[int]:
    """Positions of the lost actors among `futures` (distributed Futures: only `status` is read)."""
    return [i for i, f in enumerate(futures) if is_lost(f)]


@dataclass
class RecoveryStats:
    """What recovery has done: actors recreated, seconds spent recreating, the last failure."""

    recovered: int = 0
    rounds: int = 0
    seconds: float = 0.0
    last_s: float = 0.0
    last_error: str | None = None
    failures: int = 0
    history: list[tuple[float, int, float]] = field(default_factory=list)  # (when, actors, seconds)


class RecoveryLog:
    """Records recovery rounds and picks the pause before the next: `every_s`, doubling per failure up to a cap."""

    def __init__(self, *, every_s: float, max_pause_s: float) -> None:
        self.every_s = every_s
        self.max_pause_s = max_pause_s
        self.stats = RecoveryStats()
        self._streak = 0  # failed rounds in a row

    def succeeded(self, actors: int, seconds: float, when: float) -> float:
        """A round that recreated `actors` (0: nothing was lost) in `seconds`; returns the next pause."""
        self._streak = 0
        if actors:
            s = self.stats
            s.recovered += actors
            s.rounds += 1
            s.seconds += seconds
            s.last_s = seconds
            s.history.append((when, actors, seconds))
            logger.warning("recreated %d lost loomdata actor(s) in %.2fs", actors, seconds)
        return self.every_s

    def failed(self, error: BaseException) -> float:
        """A round that raised (a worker died meanwhile, no worker left...); returns the longer next pause."""
        self._streak += 1
        self.stats.failures += 1
        self.stats.last_error = f"{type(error).__name__}: {error}"
        logger.warning("recovering lost loomdata actors failed (will retry): %s", self.stats.last_error)
        return backoff(self._streak, base_s=self.every_s, cap_s=self.max_pause_s)
