"""StreamClient: a training rank's iterator over its micro-batches, from a running executor.

One actor call per step (all of the rank's micro-batches), with the next step requested while the
current one is consumed. The position is a `StreamState`; a new client loaded with a saved state
yields identical batches from there on, also against a restarted executor (constructors rebuild any
step from the plan). Transient failures (executor restarting, a worker and the constructor on it
lost) are retried by re-resolving the constructor through the published dataset / ServeInfo and
asking for the same step again, until `retry_s` runs out: every take names its (rank, step), so a
recreated constructor rebuilds exactly that step from the manifest, and nothing is lost or repeated.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from distributed import Client

from loomdata.client._state import StreamState
from loomdata.execution.protocol import (
    ExecutorUnavailable,
    ServeInfo,
    Timings,
    parse_serve_info,
    read_serve_info,
    retry_until,
    serve_dataset,
)
from loomdata.schemas.batch import Batch
from loomdata.schemas.errors import ContractError, ExecutionError, LoomError
from loomdata.schemas.plan import read_plan

__all__ = ["StreamClient"]


class StreamClient:
    """Iterate one dp rank's micro-batches of a plan, step by step, in order; usable from any process."""

    def __init__(
        self,
        plan_dir: str | Path,
        dp_rank: int,
        scheduler: str | None = None,
        *,
        start_step: int = 0,
        client: Client | None = None,
        prefetch: int = 1,
        retry_s: float | None = None,
        timings: Timings | None = None,
    ) -> None:
        """`retry_s` (default `timings.client_retry_s`): how long a step is retried while the executor is away."""
        self.plan_dir = Path(plan_dir)
        self.meta = read_plan(self.plan_dir)
        if not 0 <= dp_rank < self.meta.dp_size:
            raise ExecutionError(
                f"dp rank {dp_rank} is outside plan {self.meta.plan_id} (dp_size {self.meta.dp_size}); "
                f"pass a rank in 0..{self.meta.dp_size - 1}"
            )
        if not 0 <= start_step <= self.meta.steps:
            raise ExecutionError(f"start_step {start_step} is outside plan {self.meta.plan_id} (0..{self.meta.steps})")
        self.dp_rank = dp_rank
        self._scheduler = scheduler
        self._client = client
        self._owns_client = client is None
        self._prefetch = max(0, prefetch)
        self._timings = timings or Timings()
        self._retry_s = retry_s if retry_s is not None else self._timings.client_retry_s
        if self._retry_s <= 0:
            raise ValueError(f"retry_s must be > 0 seconds, got {self._retry_s}")
        self._step = start_step
        self._mb = 0
        self._actor: Any = None
        self._actor_name = ""
        self._current: list[Batch] | None = None
        self._ahead: dict[int, Any] = {}
        self.wait_s = 0.0
        """Seconds this client spent blocked waiting for batches."""
        self.batches = 0

    # ---- iteration ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._step >= self.meta.steps:
            raise StopIteration
        if self._current is None:
            self._current = self._fetch(self._step)
        batch = self._current[self._mb]
        self._mb += 1
        if self._mb == self.meta.micro_batches:
            self._mb = 0
            self._step += 1
            self._current = None
        self.batches += 1
        return batch

    def __len__(self) -> int:
        """Micro-batches left to yield."""
        return (self.meta.steps - self._step) * self.meta.micro_batches - self._mb

    @property
    def dask_client(self) -> Client | None:
        """The Dask client in use (None before the first batch); other StreamClients may share it."""
        return self._client

    # ---- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """{plan_id, dp_rank, step, micro_batch, version}: the next micro-batch this client yields."""
        return StreamState(
            plan_id=self.meta.plan_id, dp_rank=self.dp_rank, step=self._step, micro_batch=self._mb
        ).as_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved state (validated against this plan and rank)."""
        s = StreamState.parse(
            state, plan_id=self.meta.plan_id, dp_rank=self.dp_rank, micro_batches=self.meta.micro_batches
        )
        if s.step > self.meta.steps:
            raise ContractError(
                f"stream state step {s.step} is beyond plan {self.meta.plan_id} ({self.meta.steps} steps)"
            )
        self._step, self._mb = s.step, s.micro_batch
        self._current = None
        self._ahead.clear()

    # ---- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop pending requests and close the Dask client if this StreamClient made it."""
        self._ahead.clear()
        self._actor = None
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> StreamClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- transport ------------------------------------------------------------------------------

    def _fetch(self, step: int) -> list[Batch]:
        """The rank's micro-batches of `step`; requests the next `prefetch` steps before waiting.

        Retried (re-resolving the constructor) while the executor is unavailable or unreachable, for
        up to `retry_s`; a LoomError from the executor (bad data, a wrong rank) fails at once.
        """

        def attempt() -> list[Batch]:
            if self._actor is None:
                self._attach()
            fut = self._ahead.pop(step, None) or self._actor.take(self.dp_rank, step)
            for s in range(step + 1, min(step + 1 + self._prefetch, self.meta.steps)):
                if s not in self._ahead:
                    self._ahead[s] = self._actor.take(self.dp_rank, s)
            t0 = time.perf_counter()
            try:
                return self._wait(fut)
            finally:
                self.wait_s += time.perf_counter() - t0

        def give_up(e: Exception, attempts: int) -> Exception:
            if isinstance(e, ExecutorUnavailable):
                return ExecutionError(
                    f"plan {self.meta.plan_id}: the executor stayed unavailable for {self._retry_s:.0f}s "
                    f"(last: {e}); restart `loom serve`"
                )
            return ExecutionError(
                f"plan {self.meta.plan_id}, dp rank {self.dp_rank}: no executor answered for step {step} "
                f"within {self._retry_s:.0f}s ({type(e).__name__}: {e}); is `loom serve` running?"
            )

        def reset(_: Exception) -> None:
            self._actor = None  # re-resolve: the executor re-publishes a recreated constructor under the same name
            self._ahead.clear()

        batches = retry_until(
            attempt,
            # connection lost, actor lost with its worker, not published (yet): retry; a data error: do not
            retryable=lambda e: isinstance(e, ExecutorUnavailable) or not isinstance(e, LoomError),
            give_up=give_up,
            within_s=self._retry_s,
            pause_s=self._timings.client_retry_pause_s,
            on_retry=reset,
        )
        if len(batches) != self.meta.micro_batches or any(b.step != step for b in batches):
            raise ExecutionError(
                f"executor answered step {step} of rank {self.dp_rank} with {len(batches)} batches "
                f"(expected {self.meta.micro_batches}); the executor serves a different plan: restart it"
            )
        return batches

    def _wait(self, fut: Any) -> list[Batch]:
        """The take's result; a take from a constructor the executor has since replaced is abandoned.

        A call to a constructor lost with its worker may never answer (Dask waits on the lost actor),
        while the executor re-publishes a recreated one under the same name: ask that one instead.
        """
        while True:
            try:
                batches: list[Batch] = fut.result(timeout=self._timings.client_check_s)
                return batches
            except TimeoutError:
                if self._replaced():
                    raise ExecutorUnavailable(f"constructor {self._actor_name} was replaced (worker lost)") from None

    def _replaced(self) -> bool:
        """Whether the published constructor of this rank is no longer the one this client calls."""
        if self._client is None or self._actor is None:
            return True
        with self._client.as_current():
            published = self._client.get_dataset(self._actor_name, default=None)
        return published is None or published.key != self._actor.key

    def _attach(self) -> None:
        """Connect (once) and get the constructor that serves this rank."""
        if self._client is None:
            address = self._scheduler or read_serve_info(self.plan_dir).scheduler
            timeout = self._timings.connect_timeout_s
            self._client = Client(address, direct_to_workers=True, set_as_default=True, timeout=timeout)
        info = self._serve_info()
        if info.plan_id != self.meta.plan_id:
            raise ExecutionError(
                f"the executor serves plan {info.plan_id}, not {self.meta.plan_id}; start `loom serve "
                f"{self.plan_dir}` or point at the right scheduler"
            )
        self._prefetch = min(self._prefetch, max(info.window - 1, 0))  # deeper than the window gains nothing
        name = self._actor_name = info.constructor_for(self.dp_rank).name
        with self._client.as_current():
            self._actor = self._client.get_dataset(name, default=None)
        if self._actor is None:
            raise ExecutorUnavailable(f"constructor {name} is not published (yet)")

    def _serve_info(self) -> ServeInfo:
        """The running executor's ServeInfo: published on the scheduler, else serve.json."""
        if self._client is None:
            raise ExecutorUnavailable("not connected to a scheduler yet")
        raw = self._client.get_dataset(serve_dataset(self.meta.plan_id), default=None)
        if raw is not None:
            return parse_serve_info(str(raw), f"dataset {serve_dataset(self.meta.plan_id)}")
        return read_serve_info(self.plan_dir)
