"""StreamClient: a training rank's iterator over its micro-batches, from a running executor.

Delivery in bulk: one actor call (`take_block`: `take_steps` as one `BatchBlock`) answers the step asked
for and every following step the constructor already built, up to half the steps its window holds
(`ServeConfig.bytes_in_flight` a rank within `constructor_bytes` a constructor, or this client's own
`bytes_in_flight`); the next call is sent while
the steps received are consumed.
Steps received but not yet yielded stay in this client only: `state_dict` names the next micro-batch
yielded, so a resume asks for those steps again. The position is a `StreamState`; a new client loaded with a saved state
yields identical batches from there on, also against a restarted executor (constructors rebuild any
step from the plan). Transient failures (executor restarting, a worker and the constructor on it
lost) are retried by re-resolving the constructor through the published dataset / ServeInfo and
asking for the same step again, until `retry_s` runs out: every take names its (rank, step), so a
recreated constructor rebuilds exactly that step from the manifest, and nothing is lost or repeated.

A restarted `loom serve` (new address, new credentials): a client that made its own Dask client
drops it when serve.json names another executor, or names one whose pid is gone or whose heartbeat
stopped, waits for the new serve.json and connects again; a dead executor that nobody restarts is
an error within `Timings.dead_after_s` (`protocol.dead_server`). Connections use TLS, verifying the
scheduler against the CA that serve.json names (files of this user only) or the client's own
credentials (`security`, LOOM_TLS_*); a plain-TCP scheduler only with `insecure` (LOOM_INSECURE=1).
A rank on its constructor's host reaches the gateway through its Unix socket instead (serve.json names it
with the host's id; the socket's folder and server must be this user's), without TLS; elsewhere, or where
that socket cannot be used, over TLS; `local_gateway=False` (LOOM_TRANSPORT=tls) forces TLS.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from loomdata.client._direct import DirectConstructor, LocalRefused
from loomdata.client._state import StreamState
from loomdata.client._trim import RankTrim
from loomdata.execution._dask_client import new_client
from loomdata.execution.protocol import (
    ExecutorUnavailable,
    ServeInfo,
    Timings,
    client_security,
    client_ssl_context,
    dead_server,
    env_tls,
    host_id,
    parse_serve_info,
    pid_alive,
    read_lock,
    read_serve_info,
    retry_until,
    serve_dataset,
    serve_path,
)
from loomdata.schemas.batch import BLOCK_SCALARS, Batch, BatchBlock
from loomdata.schemas.context_parallel import cp_group_check
from loomdata.schemas.errors import ContractError, ExecutionError, LoomError
from loomdata.schemas.header import PlanHeader, read_plan_header

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["StreamClient"]

logger = logging.getLogger(__name__)

_MAX_PENDING_TELEMETRY = 1024

FIRST_CALL_STEPS = 4
"""Steps a stream's first call asks for (no step received yet): the first batch does not wait for half a window's
bytes to be packed into one answer, moved and decoded (256 steps, 4 MiB at 4096 tokens); the rest is asked for as soon
as it arrives (`_ask_ahead`). Not without prefetch: there a call asks the whole window and nothing is asked ahead."""

UNPACK_BYTES = 128 * 1024
"""About how many bytes of batches (arrays derived on the rank included) a rank makes from a received block at once,
one step at least (3 steps of one 4096-token micro-batch; one step of 3 or more). Few enough that the block is not
held three times over (8 steps a time kept 0.2 MiB a rank more at the warm step of `benchmarks/memory.py`), enough
to amortize the per-call NumPy work: 21-23 us a step made into batches, as for a whole 32-step block (23-24; 8
steps: 13-15; one 4096-token micro-batch a step)."""


class StreamClient:
    """Iterate one dp rank's micro-batches of a plan (or one CP peer's shards of them), step by step, in order."""

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
        security: Any = None,
        insecure: bool | None = None,
        cp_rank: int | None = None,
        bytes_in_flight: int | None = None,
        local_gateway: bool | None = None,
    ) -> None:
        """`retry_s` (default `timings.client_retry_s`): how long a step is retried while the executor is away.

        `security`: this client's own `distributed.Security` (default: LOOM_TLS_* if set, else the files
        serve.json names); `insecure` (default: LOOM_INSECURE=1): accept a plain-TCP scheduler.
        `cp_rank`: this process is that context-parallel peer of `dp_rank` (0..cp_group_size(meta)-1)
        and receives only its shard of each micro-batch (`Batch.positions`); None: whole micro-batches.
        `bytes_in_flight`: at most about this many bytes of batches requested and held ahead (at least
        one step; default: half the executor's window, which follows the executor's own bound).
        `prefetch` 0: no call is sent before the steps received are used up (else one call ahead).
        `local_gateway` (default: True unless LOOM_TRANSPORT=tls): on the constructor's host, use its gateway's
        Unix socket (no TLS); False: always TLS.
        """
        self.plan_dir = Path(plan_dir)
        self.meta = read_plan_header(self.plan_dir)
        if not 0 <= dp_rank < self.meta.dp_size:
            raise ExecutionError(
                f"dp rank {dp_rank} is outside plan {self.meta.plan_id} (dp_size {self.meta.dp_size}); "
                f"pass a rank in 0..{self.meta.dp_size - 1}"
            )
        if not 0 <= start_step <= self.meta.steps:
            raise ExecutionError(f"start_step {start_step} is outside plan {self.meta.plan_id} (0..{self.meta.steps})")
        _check_rank_exists(self.meta, dp_rank, start_step)
        if cp_rank is not None:
            cp_group_check(self.meta, cp_rank)
        self.cp_rank = cp_rank
        self._security = security if security is not None else env_tls()  # a Security, a TlsInfo or None
        # The rank gateway (no Dask client in this process) unless LOOM_TRANSPORT=dask, a scheduler or a
        # Dask client is given, or the executor publishes no gateway for this rank's constructor.
        transport = os.environ.get("LOOM_TRANSPORT", "direct")
        self._direct = transport != "dask"
        self._local_gateway = local_gateway if local_gateway is not None else transport != "tls"
        self._insecure = insecure if insecure is not None else os.environ.get("LOOM_INSECURE", "") == "1"
        self._attached: tuple[int, float] | None = None  # (pid, started_at) of the serve this client talks to
        self.dp_rank = dp_rank
        self._scheduler = scheduler
        self._client = client
        self._owns_client = client is None
        self._prefetch = max(0, prefetch)
        if bytes_in_flight is not None and bytes_in_flight < 0:
            raise ValueError(f"bytes_in_flight must be >= 0 bytes, got {bytes_in_flight!r}")
        self._bytes_in_flight = bytes_in_flight
        self._step_nbytes = 0  # bytes of one received step (measured on the first answer)
        self._per_call = 1  # steps asked per call: the executor's window (set on attach)
        self._timings = timings or Timings()
        self._retry_s = retry_s if retry_s is not None else self._timings.client_retry_s
        if self._retry_s <= 0:
            raise ValueError(f"retry_s must be > 0 seconds, got {self._retry_s}")
        self._step = start_step
        self._mb = 0
        self._actor: Any = None
        self._actor_name = ""
        self._current: list[Batch] | None = None
        # steps received, not yet yielded: their batches, or (block, first, stop) until the step is reached (`_steps`)
        self._got: dict[int, list[Batch] | tuple[BatchBlock, int, int]] = {}
        self._pending: tuple[int, Any] | None = None  # (first step, future) of the call sent ahead
        self.wait_s = 0.0
        """Seconds this client spent blocked waiting for batches."""
        self.batches = 0
        self.calls = 0
        """Calls this client made to its constructor for batches (each carries one or more steps)."""
        self._telemetry: list[tuple[int, float]] = []  # recorded step times not yet sent (ride on the next take)
        self._trim = RankTrim()  # freed C heap pages back to the OS after answers arrive, at most every 2 s

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
    def transport(self) -> str | None:
        """How this client reaches its constructor now: "local" (the gateway's Unix socket), "tls" or "tcp"
        (the gateway over TCP), "dask" (actor calls); None while not connected."""
        if isinstance(self._actor, DirectConstructor):
            return "local" if self._actor.local is not None else self._actor.address.partition("://")[0]
        return None if self._actor is None else "dask"

    @property
    def dask_client(self) -> Client | None:
        """The Dask client in use (None before the first batch); other StreamClients may share it."""
        return self._client

    # ---- telemetry ------------------------------------------------------------------------------

    def record_step_time(self, step: int, seconds: float) -> None:
        """Report this rank's measured time for `step` (e.g. its forward+backward seconds); no round trip.

        Sent with the next call for batches (one call carries several steps, so a report may wait a few
        steps), or on `close`; `loom serve` writes it with the step's predicted cost to
        PLAN_DIR/telemetry.jsonl, which `loom calibrate` reads. Best effort: a report on a take that
        fails over to a recreated constructor may be lost.
        """
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.meta.steps:
            raise ValueError(
                f"step must be a step of plan {self.meta.plan_id} (0..{self.meta.steps - 1}), got {step!r}"
            )
        number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        if not number or not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"seconds must be a positive finite number, got {seconds!r}")
        self._telemetry.append((step, float(seconds)))
        del self._telemetry[:-_MAX_PENDING_TELEMETRY]  # bounded: a client that never takes again keeps the newest

    def _take(self, step: int, count: int) -> Any:
        """Ask for `step` and up to `count - 1` more, carrying the step times recorded since the last take."""
        cp = {} if self.cp_rank is None else {"cp_rank": self.cp_rank}
        self.calls += 1
        if not self._telemetry:
            return self._actor.take_block(self.dp_rank, step, count, **cp)
        sent, self._telemetry = self._telemetry, []
        return self._actor.take_block(self.dp_rank, step, count, sent, **cp)

    def _flush_telemetry(self) -> None:
        """Send step times no take carried (the last steps), in one call; best effort, on close."""
        if not self._telemetry or (self._client is None and self._actor is None):
            return
        sent, self._telemetry = self._telemetry, []
        with contextlib.suppress(Exception):  # telemetry never fails a close
            if self._actor is None:
                self._attach()
            self._actor.record_telemetry(self.dp_rank, sent).result(timeout=self._timings.client_check_s)

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
        self._got.clear()
        self._pending = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Send unsent step times, drop pending requests, close the Dask client if this StreamClient made it."""
        self._flush_telemetry()
        self._got.clear()
        self._pending = None
        self._drop_actor()
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
        """The rank's micro-batches of `step`: received already, or asked for (with the steps after it).

        Then, while fewer than half a call's steps are left received, the next call is sent ahead.
        Retried (re-resolving the constructor) while the executor is unavailable or unreachable, for
        up to `retry_s`; a LoomError from the executor (bad data, a wrong rank) fails at once.
        A step already received while a call is in flight (or without prefetch) is taken at once: nothing
        there can fail or be sent, so the retry plumbing is not set up for it (most steps of a stream).
        """
        if step in self._got and self._actor is not None and (self._pending is not None or not self._prefetch):
            return self._steps(step)

        def attempt() -> None:
            if self._actor is None:
                self._attach()
            if step not in self._got:
                pending, self._pending = self._pending, None
                count = (
                    self._count() if self._step_nbytes or not self._prefetch else min(self._count(), FIRST_CALL_STEPS)
                )
                fut = pending[1] if pending is not None and pending[0] == step else self._take(step, count)
                t0 = time.perf_counter()
                try:
                    self._accept(step, self._wait(fut))
                finally:
                    self._wait_s(t0)
            self._ask_ahead(step)

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
            self._drop_actor()  # re-resolve: the executor re-publishes a recreated constructor under the same name
            self._pending = None
            if self._scheduler is None:
                dead = dead_server(self.plan_dir, self._timings)
                if dead is not None:
                    raise ExecutionError(f"plan {self.meta.plan_id}, dp rank {self.dp_rank}, step {step}: {dead}")
            if self._owns_client and self._client is not None and self._server_gone():
                self._drop_client()  # a restarted serve: reconnect to the address serve.json will name

        retry_until(
            attempt,
            # connection lost, actor lost with its worker, not published (yet): retry; a data error: do not
            retryable=lambda e: isinstance(e, ExecutorUnavailable) or not isinstance(e, LoomError),
            give_up=give_up,
            within_s=self._retry_s,
            pause_s=self._timings.client_retry_pause_s,
            on_retry=reset,
        )
        return self._steps(step)

    def _steps(self, step: int) -> list[Batch]:
        """Step `step`'s batches, taken from those received; a block's steps become batches only when reached.

        A thin block's labels and position ids (8 of every 12 bytes a token) are built here, a few steps at a
        time (`UNPACK_BYTES`), not for the whole block on arrival: a rank holds its received steps as the 4 bytes
        a token that came over the wire, not as 12 (at 4096 tokens a step, up to ~1 MiB less a rank).
        """
        got = self._got.pop(step)
        if isinstance(got, list):
            return got
        block, first, stop = got
        n = 1  # further steps of the same block made into batches with this one (each a dict lookup)
        per = max(1, (stop - first) * _unpack_cost(block, first, stop))
        while n * per < UNPACK_BYTES:
            nxt = self._got.get(step + n)
            if not (isinstance(nxt, tuple) and nxt[0] is block and nxt[1] == first + n * (stop - first)):
                break
            n += 1
        batches = block.batches(first, first + n * (stop - first))
        for k in range(1, n):
            self._got[step + k] = batches[k * (stop - first) : (k + 1) * (stop - first)]
        return batches[: stop - first]

    def _wait_s(self, t0: float) -> None:
        self.wait_s += time.perf_counter() - t0

    def _count(self) -> int:
        """Steps to ask for in one call: half the executor's window, fewer under this client's own bytes bound."""
        n = self._per_call
        if self._bytes_in_flight is not None:
            n = min(n, self._bytes_in_flight // self._step_nbytes) if self._step_nbytes else 1
        return max(1, n)

    def _ask_ahead(self, step: int) -> None:
        """Send the next call (from the first step not received) once at most half a call's steps are left."""
        end = step + 1 + len(self._got)  # received steps are one run from step + 1 (scanned only if not)
        if self._got and (step + 1 not in self._got or end - 1 not in self._got):
            end = step + 1
            while end in self._got:
                end += 1
        left, count = end - step - 1, self._count()
        if self._prefetch and self._pending is None and end < self.meta.steps and left <= count // 2:
            self._pending = (end, self._take(end, max(1, count - left)))

    def _accept(self, step: int, block: BatchBlock) -> None:
        """Check an answer (consecutive steps from `step`, each the rank's micro-batches) and keep its steps.

        A block's steps are kept as (block, first batch, stop) and become batches when reached (`_steps`)."""
        if isinstance(block, BatchBlock) and len(block.steps):
            self._check_block(step, block)
            per = np.concatenate([[0], np.cumsum(block.steps)]).tolist()
            if not self._step_nbytes:
                self._step_nbytes = max(1, sum(_nbytes(b, block.thin) for b in block.batches(0, per[1])))
            self._got.update((step + k, (block, per[k], per[k + 1])) for k in range(len(block.steps)))
            self._trim.maybe_trim()
            return
        answer = block
        if not isinstance(answer, list) or not answer:
            what = (
                f"a block of {block.steps.tolist()} batches a step" if isinstance(block, BatchBlock) else repr(answer)
            )
            raise ExecutionError(
                f"executor answered step {step} of rank {self.dp_rank} with {what}; restart `loom serve`"
            )
        for k, batches in enumerate(answer):
            self._check(step + k, batches)
        if not self._step_nbytes:
            self._step_nbytes = max(1, sum(_nbytes(b) for b in answer[0]))
        self._got.update((step + k, batches) for k, batches in enumerate(answer))
        self._trim.maybe_trim()

    def _check_block(self, step: int, block: BatchBlock) -> None:
        """`_check` over a block's scalars, every step at once (no batches built)."""
        batches = int(block.steps.sum())
        if block.scalars.shape != (batches, len(BLOCK_SCALARS)):
            raise ExecutionError(
                f"executor answered step {step} of rank {self.dp_rank} with a block of {batches} batches and "
                f"{block.scalars.shape} scalars: a malformed answer; restart `loom serve`"
            )
        col = {name: block.scalars[:, i] for i, name in enumerate(BLOCK_SCALARS)}
        expect = np.repeat(np.arange(step, step + len(block.steps)), block.steps)
        if (block.steps != self.meta.micro_batches).any() or (col["step"] != expect).any():
            raise ExecutionError(
                f"executor answered step {step} of rank {self.dp_rank} with {block.steps.tolist()} batches a step "
                f"(expected {self.meta.micro_batches}); the executor serves a different plan: restart it"
            )
        cp_rank, cp_size = col["cp_rank"], col["cp_size"]
        want_cp = self.cp_rank if self.cp_rank is not None else 0
        if (cp_rank != want_cp % cp_size).any() or (self.cp_rank is None and (cp_size > 1).any()):
            raise ExecutionError(
                f"executor answered step {step} of rank {self.dp_rank} with the shards of other CP ranks "
                f"({np.stack([cp_rank, cp_size], axis=1).tolist()}, asked cp rank {self.cp_rank}); restart `loom serve`"
            )
        if block.thin and (cp_size > 1).any():  # a shard's labels cannot be built on the rank: refused now, not later
            raise ExecutionError(
                f"executor answered step {step} of rank {self.dp_rank} with CP shards in a block without labels; "
                "restart `loom serve`"
            )

    def _check(self, step: int, batches: list[Batch]) -> None:
        if len(batches) != self.meta.micro_batches or any(b.step != step for b in batches):
            raise ExecutionError(
                f"executor answered step {step} of rank {self.dp_rank} with {len(batches)} batches "
                f"(expected {self.meta.micro_batches}); the executor serves a different plan: restart it"
            )
        want_cp = self.cp_rank if self.cp_rank is not None else 0
        if any(b.cp_rank != want_cp % b.cp_size or (self.cp_rank is None and b.cp_size > 1) for b in batches):
            raise ExecutionError(
                f"executor answered step {step} of rank {self.dp_rank} with the shards of other CP ranks "
                f"({[(b.cp_rank, b.cp_size) for b in batches]}, asked cp rank {self.cp_rank}); restart `loom serve`"
            )

    def _wait(self, fut: Any) -> BatchBlock:
        """The take's result; a take from a constructor the executor has since replaced is abandoned.

        A call to a constructor lost with its worker may never answer (Dask waits on the lost actor),
        while the executor re-publishes a recreated one under the same name: ask that one instead.
        """
        while True:
            try:
                answer: BatchBlock = fut.result(timeout=self._timings.client_check_s)
                return answer
            except TimeoutError:
                if self._server_gone():
                    raise ExecutorUnavailable("the executor this client talked to is gone (serve.json)") from None
                if self._replaced():
                    raise ExecutorUnavailable(f"constructor {self._actor_name} was replaced (worker lost)") from None

    def _replaced(self) -> bool:
        """Whether the published constructor of this rank is no longer the one this client calls."""
        if isinstance(self._actor, DirectConstructor):
            try:
                info = read_serve_info(self.plan_dir)
            except ExecutionError:
                return False  # being rewritten: the next check reads it again
            c = info.constructor_for(self.dp_rank)  # the same address may be another gateway now (its id differs)
            return (c.gateway, c.gateway_id) != (self._actor.address, self._actor.gateway_id)
        if self._client is None or self._actor is None:
            return True
        with self._client.as_current():
            published = self._client.get_dataset(self._actor_name, default=None)
        return published is None or published.key != self._actor.key

    def _server_gone(self) -> bool:
        """Whether serve.json now names another executor than ours, or ours has died (pid gone, no heartbeat)."""
        if self._scheduler is not None or self._attached is None:
            return False
        try:
            info = ServeInfo.model_validate_json(serve_path(self.plan_dir).read_text())
        except (OSError, ValueError):
            return False  # removed or being replaced: the next attempt reads it again
        if (info.pid, info.started_at) != self._attached:
            return True
        return not self._fresh(info)

    def _fresh(self, info: ServeInfo) -> bool:
        """Whether `info`'s executor looks alive: its pid runs (same host), else (another host) a recent heartbeat."""
        alive = pid_alive(info.host, info.pid)
        if alive is not None:
            return alive
        return time.time() - info.heartbeat_at <= self._timings.dead_after_s

    def _drop_client(self) -> None:
        client, self._client, self._attached = self._client, None, None
        if client is not None:
            with contextlib.suppress(Exception):  # its scheduler is gone: closing is best effort
                client.close(timeout=1)

    def _drop_actor(self) -> None:
        actor, self._actor = self._actor, None
        if isinstance(actor, DirectConstructor):
            actor.close()

    def _live_serve_info(self) -> ServeInfo:
        """serve.json's ServeInfo, once the executor it names looks alive (else ExecutorUnavailable)."""
        lock = read_lock(self.plan_dir)
        if not serve_path(self.plan_dir).exists() and lock is not None and pid_alive(lock.host, lock.pid):
            raise ExecutorUnavailable(f"`loom serve` pid {lock.pid} holds the plan and is starting")
        info = read_serve_info(self.plan_dir)
        if not self._fresh(info):
            raise ExecutorUnavailable(f"serve.json names executor pid {info.pid}, which is gone: waiting")
        return info

    def _attach_direct(self) -> bool:
        """Connect to this rank's constructor through its worker's gateway; False where none is published."""
        info = self._live_serve_info()
        self._check_plan(info)
        c = info.constructor_for(self.dp_rank)
        if c.gateway is None:
            return False
        timeout = self._timings.connect_timeout_s
        self._actor = None
        if self._local_gateway and c.local is not None and c.local.host_id == host_id():
            try:
                self._actor = DirectConstructor(
                    c.gateway, c.name, None, timeout=timeout, gateway_id=c.gateway_id, local=c.local.path
                )
            except LocalRefused as e:
                logger.warning("plan %s, dp rank %s: %s", self.meta.plan_id, self.dp_rank, e)
            except OSError as e:  # gone, or not reachable from here (another mount namespace): TLS reaches it
                logger.info("plan %s: gateway socket %s: %s; using TLS", self.meta.plan_id, c.local.path, e)
        if self._actor is None:
            ctx = client_ssl_context(
                c.gateway, info.tls, plan_id=self.meta.plan_id, own=self._security, insecure=self._insecure
            )
            self._actor = DirectConstructor(c.gateway, c.name, ctx, timeout=timeout, gateway_id=c.gateway_id)
        self._actor_name = c.name
        self._per_call = max(1, info.window // 2 if self._prefetch else info.window)
        self._attached = (info.pid, info.started_at)
        return True

    def _check_plan(self, info: ServeInfo) -> None:
        if info.plan_id != self.meta.plan_id:
            raise ExecutionError(
                f"the executor serves plan {info.plan_id}, not {self.meta.plan_id}; start `loom serve "
                f"{self.plan_dir}` or point at the right scheduler"
            )

    def _connect(self) -> Client:
        """A Dask client for the scheduler given, or the one serve.json names (only once it looks alive)."""
        if self._scheduler is not None:
            address, tls, info = self._scheduler, None, None
            with contextlib.suppress(ExecutionError):
                info = read_serve_info(self.plan_dir)
                tls = info.tls if info.scheduler == self._scheduler else None
            timeout = self._timings.connect_timeout_s
        else:
            info = self._live_serve_info()
            address, tls = info.scheduler, info.tls
            timeout = min(self._timings.connect_timeout_s, max(self._timings.dead_after_s, 5.0))
        security = client_security(address, tls, plan_id=self.meta.plan_id, own=self._security, insecure=self._insecure)
        client = new_client(address, direct_to_workers=True, set_as_default=True, timeout=timeout, security=security)
        self._attached = (info.pid, info.started_at) if info is not None and self._scheduler is None else None
        return client

    def _attach(self) -> None:
        """Connect (once per executor) and get the constructor that serves this rank."""
        if self._direct and self._client is None and self._scheduler is None and self._attach_direct():
            return
        if self._client is None:
            self._client = self._connect()
        info = self._serve_info()
        self._check_plan(info)
        # Half the window per call: the call sent ahead then asks for steps inside the window even while
        # this rank's peers (tp/pp/cp) are a call behind (a step outside it would be built again, on demand).
        self._per_call = max(1, info.window // 2 if self._prefetch else info.window)
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


def _unpack_cost(block: BatchBlock, first: int, stop: int) -> int:
    """Bytes a batch of `block` (batches `first..stop-1` one step) holds once made into batches, about."""
    b = block.bounds["input_ids"]
    tokens = int(b[stop] - b[first]) // max(1, stop - first)
    return tokens * block.arrays["input_ids"].itemsize * 3


def _nbytes(batch: Batch, thin: bool = False) -> int:
    """Bytes of a batch's arrays as moved and held (`thin`: from a thin block, whose labels and position ids are made
    on the rank a few steps at a time, so they are not held ahead)."""
    arrays = [batch.input_ids, batch.cu_seqlens, *batch.images]
    if not thin:
        arrays += [batch.labels, batch.position_ids]
    return sum(a.nbytes for a in arrays)


def _check_rank_exists(meta: PlanHeader, dp_rank: int, start_step: int) -> None:
    """An elastic re-plan's rank that has no batches at `start_step` must start where it first has some."""
    shapes = meta.shapes
    current = [sh for sh in shapes if sh.from_step <= start_step]
    if not current or dp_rank < current[-1].dp_size:
        return
    later = [sh.from_step for sh in shapes if sh.from_step > start_step and dp_rank < sh.dp_size]
    where = (
        f"its first step in this plan is {later[0]}: start it with start_step={later[0]}"
        if later
        else "it has no steps after that in this plan"
    )
    raise ExecutionError(
        f"dp rank {dp_rank} does not exist at step {start_step} of plan {meta.plan_id} (an elastic re-plan: "
        f"{current[-1].dp_size} rank(s) from step {current[-1].from_step}); {where}"
    )
