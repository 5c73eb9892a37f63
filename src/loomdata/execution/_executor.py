"""The Executor: serves one plan from Source Loader and Data Constructor actors on a Dask cluster.

Every actor is rebuilt from (plan dir, partition or rank group, step): a restarted executor serves
the same batches, and a client reconnects to it through `serve.json` or the published ServeInfo.
The parts: the fleet as plain state (`_fleet`), the remote operations on it and their protocol
(`_actors`: create, route, retire, replace what is lost, publish), one control loop thread that
alone changes the fleet (`_loop`: recovery every 0.2 s, autoscaling at its period, callers'
commands), the pure autoscaling policy (`_autoscale`) and metrics gathered without blocking the loop
(`_metrics`). This class wires them and offers the public calls; none of them holds a lock.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from distributed import Client

from loomdata.execution._actors import FleetOps
from loomdata.execution._autoscale import Autoscaler
from loomdata.execution._config import ServeConfig
from loomdata.execution._loop import ControlLoop
from loomdata.execution._metrics import MetricsGather, summarize
from loomdata.execution._plan_meta import CheckedPlan, check_plan
from loomdata.execution._recovery import RecoveryStats
from loomdata.execution._storage_options import OptionsBySource, SourceOptions
from loomdata.execution._telemetry import drain_telemetry
from loomdata.execution.protocol import ServeInfo
from loomdata.schemas.errors import ExecutionError
from loomdata.schemas.metrics import ExecutorMetrics, StepTelemetry
from loomdata.schemas.plan_view import PlanView, SpecView

if TYPE_CHECKING:
    from loomdata.schemas.spec import Spec

__all__ = ["Executor"]


class Executor:
    """Serves one plan on a Dask cluster: loaders per source partition, constructors per rank group.

    Settings come in one `ServeConfig` (`config`); keyword `settings` override its fields (e.g.
    `constructors=2`, `autoscale=True`). With `recover` (the default) lost actors are recreated while
    serving; with `autoscale` a controller resizes each source's loaders to demand x measured cost
    (its decisions are in `metrics().autoscale`).

    Storage options (endpoints, credentials) are never in plan.json: give the spec the plan was made from
    (`spec`: a Spec or its file, checked by content hash: a ContractError names both when it is another
    spec) or `storage_options` (source name -> {protocol: options}). They stay in memory: every loader,
    also one recreated or added later, is given its own source's at creation. Without either, loaders
    reach the store with their workers' environment (AWS_*, profiles).

    plan.json, the spec or options and the index's build settings are validated in a child interpreter
    (`_plan_meta.check_plan`): this process reads the plan as a `PlanView` (`meta`) and never imports pydantic
    unless its caller did. `checked`: that check's result, made already for this plan dir (`serve` checks before
    it starts a cluster); then `spec` and `storage_options` are not given.
    """

    def __init__(
        self,
        plan_dir: str | Path,
        client: Client,
        config: ServeConfig | None = None,
        *,
        spec: Spec | str | Path | None = None,
        storage_options: SourceOptions | OptionsBySource | None = None,
        checked: CheckedPlan | None = None,
        **settings: Any,
    ) -> None:
        self.config = (config or ServeConfig()).with_settings(**settings) if settings else (config or ServeConfig())
        self.plan_dir = Path(plan_dir).resolve()
        self.client = client
        if checked is not None and (spec is not None or storage_options is not None):
            raise ValueError("give `checked` or the spec or storage_options it was checked with, not both")
        if checked is None:
            checked = check_plan(self.plan_dir, spec=spec, storage_options=storage_options)
        elif checked.plan_dir != self.plan_dir:
            raise ValueError(f"`checked` is the check of {checked.plan_dir}, not of {self.plan_dir}")
        self.meta: PlanView = checked.view
        images = any(src.image_field for src in self.meta.spec.sources)
        self.config = self.config.for_plan(  # the window widened to the bytes bounds
            self.meta.seq_len,
            self.meta.micro_batches,
            self.meta.dp_size,
            long_seq_len=self.meta.long_seq_len,
            images=images,
        )
        self.spec: SpecView = self.meta.spec
        peers = self.config.peers or checked.peers
        self._ops = FleetOps(self.plan_dir, client, self.meta, peers=peers, config=self.config, options=checked.options)
        self._loop: ControlLoop | None = None  # kept after stop(): its recovery stats stay readable
        self._serving = False

    @property
    def window(self) -> int:
        return self.config.window

    @property
    def peers(self) -> int:
        return self._ops.peers

    @property
    def info(self) -> ServeInfo | None:
        """The ServeInfo published last (None when not running)."""
        return self._loop.view.info if self._loop is not None and self._serving else None

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Executor:
        """Create the actors, start building the first window, publish, start the control loop; returns self.

        On failure everything created so far is released again before the error propagates.
        """
        if self._loop is not None:
            raise ExecutionError("an Executor starts once; make a new one to serve again")
        try:
            self._ops.start()
            scaler = None
            if self.config.autoscale is not None:
                scaler = Autoscaler(
                    self.config.autoscale, plan_dir=self.plan_dir, meta=self.meta, shards=self._ops.shard_counts()
                )
            self._loop = ControlLoop(self._ops, scaler, name=f"loom-control-{self.meta.plan_id[:8]}").start()
            self._serving = True
            return self
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the control loop, unpublish, stop and release the actors, remove our serve.json."""
        self._serving = False
        if self._loop is not None:
            self._loop.stop(self.config.timings.stop_timeout_s)
        self._ops.stop()

    def __enter__(self) -> Executor:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- control --------------------------------------------------------------------------------

    def set_loaders(self, source: str, n: int) -> int:
        """Re-partition `source` over `n` loaders (add or remove), re-route every constructor; returns n used."""
        if source not in self.meta.sources:
            raise ValueError(f"plan {self.meta.plan_id} has no source {source!r}; it has {list(self.meta.sources)}")
        if n < 1:
            raise ValueError(f"loaders per source must be >= 1, got {n}")
        return self._running().call(lambda: self._ops.resize(source, n))

    def recover(self) -> int:
        """Recreate every actor lost with its worker, re-route constructors, re-publish now; returns how many.

        The control loop does this by itself every `Timings.recovery_every_s` when `recover` is on.
        """
        loop = self._running()
        return loop.call(loop.recover_now)

    def loader_counts(self) -> dict[str, int]:
        """Loaders per source as the executor holds them (a lost one not yet recreated included)."""
        return dict(self._running().view.counts)

    @property
    def recovery(self) -> RecoveryStats:
        """What recovery has recreated so far (empty stats when not started)."""
        return self._loop.recovery.stats if self._loop is not None else RecoveryStats()

    def metrics(self) -> ExecutorMetrics:
        """Per-source samples/s, per-loader counters, constructor queue depth, per-rank wait, recovery, autoscale.

        Asked of the actors from the calling thread (the control loop goes on meanwhile); an actor
        lost with its worker (not yet recreated) is left out rather than failing the report.
        """
        loop = self._running()
        with self.client.as_current():
            got = MetricsGather(loop.view, self.config.timings.metrics_timeout_s).collect()
        scaler = loop.autoscaler
        report = scaler.report() if scaler is not None else None
        return summarize(self.meta.plan_id, got, recovery=loop.recovery.stats, autoscale=report)

    def telemetry(self) -> list[StepTelemetry]:
        """Step times the ranks recorded since the last call (drained from the constructors), by (step, rank)."""
        loop = self._running()
        with self.client.as_current():
            return drain_telemetry(loop.view, self.config.timings.metrics_timeout_s)

    def _running(self) -> ControlLoop:
        if self._loop is None or not self._serving:
            raise ExecutionError("the executor is not running; call start() first")
        return self._loop
