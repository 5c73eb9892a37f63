"""Recovery of actors lost with their worker: Dask never recreates an actor, so the serving process does.

When a worker dies, the scheduler errs the task of every actor it held ("Worker holding Actor was
lost") and tells each client holding its future within milliseconds, so `lost` is a local check of
future states, no RPC. `Watchdog` polls it in a daemon thread of the serving process and calls the
executor's `recover()`, which recreates each lost actor from (plan dir, partition or rank group) on a
live worker and re-publishes it. Plans are deterministic, so a recreated actor serves byte for byte
what the lost one would have; constructors retry reads on the new routes and clients retry the same
step on the re-published constructor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from distributed import Future

__all__ = ["RecoveryStats", "Watchdog", "is_lost", "lost_indices"]

logger = logging.getLogger(__name__)


def is_lost(future: Future) -> bool:
    """Whether the actor behind a finished actor future is gone (its worker died, or it was released)."""
    return future.status != "finished"


def lost_indices(futures: Iterable[Future]) -> list[int]:
    """Positions of the lost actors among `futures`."""
    return [i for i, f in enumerate(futures) if is_lost(f)]


@dataclass
class RecoveryStats:
    """What the watchdog has done: actors recreated, seconds spent recreating, the last failure."""

    recovered: int = 0
    rounds: int = 0
    seconds: float = 0.0
    last_s: float = 0.0
    last_error: str | None = None
    failures: int = 0
    history: list[tuple[float, int, float]] = field(default_factory=list)  # (when, actors, seconds)


class Watchdog:
    """Calls `recover()` (returns how many actors it recreated) every `every_s` in a daemon thread."""

    def __init__(self, recover: Callable[[], int], *, every_s: float = 0.2, name: str = "loom-recovery") -> None:
        self._recover = recover
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._streak = 0  # failed attempts in a row: the back-off grows with it
        self.stats = RecoveryStats()

    def start(self) -> Watchdog:
        """Start polling; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling and wait for a recovery in progress to finish."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def poll_once(self) -> float:
        """One recovery attempt: records what it did; returns the pause before the next (backs off on errors)."""
        t0 = time.monotonic()
        try:
            n = self._recover()
        except Exception as e:  # a worker died during recovery, no worker left...: try again later
            self._streak += 1
            self.stats.failures += 1
            self.stats.last_error = f"{type(e).__name__}: {e}"
            logger.warning("recovering lost loomdata actors failed (will retry): %s", self.stats.last_error)
            return min(self._every_s * 2**self._streak, 5.0)
        self._streak = 0
        if n:
            dt = time.monotonic() - t0
            s = self.stats
            s.recovered += n
            s.rounds += 1
            s.seconds += dt
            s.last_s = dt
            s.history.append((time.time(), n, dt))
            logger.warning("recreated %d lost loomdata actor(s) in %.2fs", n, dt)
        return self._every_s

    def _run(self) -> None:
        pause = self._every_s
        while not self._stop.wait(pause):
            pause = self.poll_once()
