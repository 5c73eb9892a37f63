"""The serving control loop: one daemon thread that owns the fleet and is the only one to change it.

Each turn it runs the commands callers queued (`call`: resize, recover now, stop), then its step:
- every `Timings.recovery_every_s` (backing off while it fails) it replaces lost actors and brings
  every route up to date (`FleetOps.replace_lost`);
- at the autoscaling period it issues every actor's `metrics()` call and, on later turns, once the
  answers are in, asks the pure policy (`Autoscaler.decide`) and applies its resizes;
- after any change it publishes a fresh `FleetView` for other threads (metrics, loader counts).
No lock exists: only this thread touches the fleet, and the waits on actors happen here, in turn,
so an autoscale round's measurements never hold up recovery (a resize itself, which creates and
awaits loaders, does run as one step of the loop).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from loomdata.execution._actors import FleetOps
from loomdata.execution._autoscale import Autoscaler
from loomdata.execution._dask_client import live_workers
from loomdata.execution._metrics import FleetView, MetricsGather, current_step, measured_costs
from loomdata.execution._recovery import RecoveryLog

__all__ = ["ControlLoop"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_S = 0.02  # while metrics answers are awaited for an autoscale round


class ControlLoop:
    """Runs `FleetOps` recovery, autoscaling and queued commands in one daemon thread."""

    def __init__(self, ops: FleetOps, autoscaler: Autoscaler | None, *, name: str) -> None:
        t = ops.config.timings
        self._ops = ops
        self._recover = ops.config.recover
        self._autoscaler = autoscaler
        self.recovery = RecoveryLog(every_s=t.recovery_every_s, max_pause_s=t.recovery_backoff_max_s)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        now = time.monotonic()
        self._next_recovery = now + t.recovery_every_s
        self._next_round = now + (autoscaler.settings.every_s if autoscaler else float("inf"))
        self._gather: MetricsGather | None = None
        self.view = FleetView.of(ops.fleet, ops.info)

    @property
    def autoscaler(self) -> Autoscaler | None:
        return self._autoscaler

    # ---- for other threads ----------------------------------------------------------------------

    def start(self) -> ControlLoop:
        self.view = FleetView.of(self._ops.fleet, self._ops.info)
        self._thread.start()
        return self

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the loop between its steps and return its result (or raise its error)."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, fut))
        while True:
            if not self._thread.is_alive():  # stopped (or never started): nobody else touches the fleet
                self._drain()
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                continue  # still queued or running: look again whether the loop is alive

    def stop(self, timeout: float) -> None:
        """Finish the current step and end the thread (commands still queued run first)."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout)

    # ---- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        with self._ops.client.as_current():  # actor handles made on this thread bind to the executor's client
            self._turns()

    def _turns(self) -> None:
        while True:
            due = min(self._next_recovery if self._recover else float("inf"), self._next_round)
            pause = _POLL_S if self._gather is not None else max(0.0, due - time.monotonic())
            try:
                item = self._commands.get(timeout=min(pause, 1.0))
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            if item is None:
                self._drain()
                return
            if item:
                self._run_command(*item)
            self.step()

    def _drain(self) -> None:
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._run_command(*item)

    def _run_command(self, fn: Callable[[], Any], fut: concurrent.futures.Future[Any]) -> None:
        try:
            result = fn()
        except BaseException as e:  # handed to the caller's thread, which raises it
            self._publish()
            fut.set_exception(e)
            return
        self._publish()  # before the caller resumes: its next metrics() sees the fleet its command left
        fut.set_result(result)

    def step(self) -> None:
        """One turn: recovery when due, then the autoscale round's next phase when due."""
        now = time.monotonic()
        if self._recover and now >= self._next_recovery:
            self._next_recovery = time.monotonic() + self.recover_round()
        if self._autoscaler is not None:
            self._autoscale(now)

    def recover_round(self) -> float:
        """Replace what is lost; returns the pause before the next round (longer after a failure)."""
        t0 = time.monotonic()
        try:
            n = self._ops.replace_lost()
        except Exception as e:  # a worker died during recovery, no worker left...: try again later
            self._publish()
            return self.recovery.failed(e)
        self._publish()  # also after a round that only retired loaders: the view carries their counters from now on
        return self.recovery.succeeded(n, time.monotonic() - t0, time.time())

    def recover_now(self) -> int:
        """One recovery round, its error raised (`Executor.recover`)."""
        t0 = time.monotonic()
        n = self._ops.replace_lost()
        self.recovery.succeeded(n, time.monotonic() - t0, time.time())
        return n

    def _autoscale(self, now: float) -> None:
        scaler = self._autoscaler
        assert scaler is not None
        if self._gather is None:
            if now >= self._next_round:
                self._gather = MetricsGather(self.view, self._ops.config.timings.metrics_timeout_s)
            return
        if not self._gather.ready():
            return
        got, self._gather = self._gather.collect(), None
        try:
            threads = sum(int(w.get("nthreads", 1)) for w in live_workers(self._ops.client).values())
            resizes = scaler.decide(
                measured=measured_costs(got),
                step=current_step(got, self._ops.meta.steps),
                current=self._ops.fleet.counts(),  # a lost loader being recreated counts too
                threads=threads,
            )
            for r in resizes:
                scaler.record(r, self._ops.resize(r.source, r.new))
                self._publish()
        except Exception as e:  # a worker died mid-resize, the executor is stopping...: try next round
            scaler.failed(e)
        self._next_round = time.monotonic() + scaler.settings.every_s

    def _publish(self) -> None:
        self.view = FleetView.of(self._ops.fleet, self._ops.info)
