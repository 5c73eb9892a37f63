"""Typed metrics of serving: what a Source Loader, a Data Constructor and the Executor report.

Frozen, slotted, keyword-only dataclasses: they cross processes by pickle (Dask actor calls) and are
read by attribute in the executor and the autoscaler. `to_dict()` gives the JSON-ready shape that
`loom serve --json` prints (string keys for per-rank maps, rounded seconds), the same as before these
types existed. `ExecutorMetrics` is what `Executor.metrics()` returns: the actors' answers, the
per-source sums, recovery and autoscaling (`AutoscaleReport` of `AutoscaleDecision`s and the last
`AutoscaleRound`'s inputs); `to_dict()` is called only at the JSON edge (`loom serve --json`, the demo).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "LOADER_COUNTERS",
    "AutoscaleDecision",
    "AutoscaleReport",
    "AutoscaleRound",
    "BuildPhases",
    "ConstructorMetrics",
    "ExecutorMetrics",
    "LoaderMetrics",
    "LoaderReport",
    "RecoveryReport",
    "RetiredLoaders",
    "SourceMetrics",
    "StepTelemetry",
]


def _r4(x: float) -> float:
    return round(x, 4)


def _total(counts: list[int | None]) -> int | None:
    """The sum of counts, None if any is unknown (or there are none)."""
    return None if not counts or any(c is None for c in counts) else sum(c for c in counts if c is not None)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderMetrics:
    """Counters and rates of one Source Loader (one partition of one source)."""

    source: str
    part: int
    calls: int = 0
    samples: int = 0
    """Samples served: the distinct samples of each read, summed (a sample two reads serve segments of counts twice)."""
    segments: int = 0
    tokens: int = 0
    """Tokens served: the segments' tokens (compare `tokens_decoded`)."""
    busy_s: float = 0.0
    """Seconds spent reading (in the actor's thread or inline)."""
    samples_per_s: float | None = None
    """Samples over the wall time from the first read's start to the last read's end; None before any read."""
    samples_per_busy_s: float | None = None
    state_bytes: int = 0
    """Memory of the loader's index arrays (sample -> shard, row)."""
    rss_bytes: int = 0
    """Resident memory of the worker process the loader lives in (0 where psutil cannot tell)."""
    prefetched: int = 0
    """Read units (row groups) read ahead of need and kept; `prefetch_hits` of them were then asked for."""
    prefetch_hits: int = 0
    prefetch_errors: int = 0
    """Reads ahead that failed (the read that needed the unit read it again and reported any error)."""
    prefetch_waits: int = 0
    """Reads that waited for a unit still being read ahead (storage latency the read-ahead did not hide)."""
    unit_misses: int = 0
    """Units a read had to fetch itself (neither held nor in flight): each a storage wait on the read path."""
    get_latency_s: float | None = None
    """The storage latency the read-ahead sized its reach for (object URLs: the median recent range GET to the store;
    local files: the read's own duration); None without read-ahead."""
    prefetch_reach_steps: int | None = None
    """Steps beyond the newest served that the read-ahead keeps and reads units for (horizon + latency); None
    without read-ahead."""
    checksums_held: int | None = None
    """Samples whose index checksum a planned loader with `verify: sample` holds now (None: not such a loader, which
    holds every checksum if it verifies samples at all)."""
    checksum_loads: int = 0
    """Times it read its partition's checksums again from samples.parquet: once a manifest span planned with samples
    new to it, and each read of a sample outside the steps held (`checksum_rereads`)."""
    checksum_rereads: int = 0
    """Of them, by a read: a sample outside the steps held (a rank behind the cache's floor); ~0 going forward."""
    plan_errors: int = 0
    """Manifest spans, shards or chunks its plan-driven cache could not plan (unreadable manifest or checksums, a
    failure on a planning thread, logged): their units are read when asked instead of kept ahead; 0 when healthy."""
    units_decoded: int | None = None
    """Read units (Parquet row groups) the loader decoded, on its reads and its reads ahead, each decode counted (a unit
    decoded again counts again); None: the format has no read units (it decodes what it serves)."""
    samples_decoded: int | None = None
    """Rows (samples) of those units: every sample of a unit decoded, served or not."""
    tokens_decoded: int | None = None
    """Token ids of those units. `tokens_decoded - tokens` were decoded and not (yet) served: rows of units read for a
    few samples (a shuffle's last window part-reads row groups), units decoded again, units read ahead and not used;
    None where not known (no read units, or a text column: its tokens exist only once a row is tokenized). A unit held
    across its uses serves samples again from one decode (a plan of several epochs over a small source): `tokens`
    can then exceed it."""

    @property
    def tokens_unserved(self) -> int | None:
        """Tokens decoded and not (yet) served, at least: `tokens_decoded - tokens`, 0 where more was served than
        decoded (samples served again from a held unit; the difference nets repeats against waste, so it is a lower
        bound). None where decodes are not counted."""
        return None if self.tokens_decoded is None else max(self.tokens_decoded - self.tokens, 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: rates to 0.1, seconds to 1e-4."""
        return {
            "source": self.source,
            "part": self.part,
            "calls": self.calls,
            "samples": self.samples,
            "segments": self.segments,
            "tokens": self.tokens,
            "busy_s": _r4(self.busy_s),
            "samples_per_s": None if self.samples_per_s is None else round(self.samples_per_s, 1),
            "samples_per_busy_s": None if self.samples_per_busy_s is None else round(self.samples_per_busy_s, 1),
            "state_bytes": self.state_bytes,
            "rss_bytes": self.rss_bytes,
            "prefetched": self.prefetched,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_errors": self.prefetch_errors,
            "prefetch_waits": self.prefetch_waits,
            "unit_misses": self.unit_misses,
            "get_latency_s": None if self.get_latency_s is None else _r4(self.get_latency_s),
            "prefetch_reach_steps": self.prefetch_reach_steps,
            "checksums_held": self.checksums_held,
            "checksum_loads": self.checksum_loads,
            "checksum_rereads": self.checksum_rereads,
            "plan_errors": self.plan_errors,
            "units_decoded": self.units_decoded,
            "samples_decoded": self.samples_decoded,
            "tokens_decoded": self.tokens_decoded,
            "tokens_unserved": self.tokens_unserved,
        }


LOADER_COUNTERS = (
    "calls",
    "samples",
    "segments",
    "tokens",
    "busy_s",
    "prefetched",
    "prefetch_hits",
    "prefetch_errors",
    "prefetch_waits",
    "unit_misses",
    "checksum_loads",
    "checksum_rereads",
    "plan_errors",
    "units_decoded",
    "samples_decoded",
    "tokens_decoded",
)
"""The `LoaderMetrics` fields that only grow over a loader's life (totals: a source's sum includes its retired
loaders'). The others are rates or gauges of the moment (`samples_per_s`, `samples_per_busy_s`, `state_bytes`,
`rss_bytes`, `get_latency_s`, `prefetch_reach_steps`, `checksums_held`): live loaders only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetiredLoaders:
    """The counters of a source's loaders that left the fleet (resized away, or lost with their worker), summed.

    A retired loader is asked for its metrics once it is closed (final then); a lost one cannot answer, so
    what the executor last received from it counts (what it did after that is not known: `unanswered`
    counts the loaders of which nothing was known). `totals` holds `LOADER_COUNTERS` only (rates and
    gauges left at their defaults); an optional counter (`tokens_decoded`...) is None once any loader
    did not count it. Immutable: `add` returns a new one (the control loop's views share them).
    """

    source: str
    loaders: int = 0
    """Loaders retired, lost ones included."""
    unanswered: int = 0
    """Of them, loaders whose counters are not known at all (lost before any metrics came from them)."""
    totals: LoaderMetrics | None = None
    """The counters summed over the loaders known (None: none known yet)."""

    def add(self, m: LoaderMetrics | None) -> RetiredLoaders:
        """This plus one more retired loader with its last metrics (None: nothing known of it)."""
        if m is None:
            return replace(self, loaders=self.loaders + 1, unanswered=self.unanswered + 1)
        mine = {k: getattr(m, k) for k in LOADER_COUNTERS}
        if self.totals is not None:
            mine = {k: _plus(getattr(self.totals, k), v) for k, v in mine.items()}
        return replace(self, loaders=self.loaders + 1, totals=LoaderMetrics(source=self.source, part=-1, **mine))

    def count(self, name: str) -> Any:
        """The retired total of counter `name` (0 when none is known; None where a loader did not count it)."""
        if name not in LOADER_COUNTERS:
            raise KeyError(f"{name!r} is not a loader counter (rates and gauges are not summed over retired loaders)")
        return 0 if self.totals is None else getattr(self.totals, name)

    def to_dict(self) -> dict[str, Any]:
        counts = {k: self.count(k) for k in LOADER_COUNTERS}
        return {"loaders": self.loaders, "unanswered": self.unanswered, **counts, "busy_s": _r4(counts["busy_s"])}


def _plus(a: Any, b: Any) -> Any:
    """A counter's sum; None (not counted) wins, as in `_total`."""
    return None if a is None or b is None else a + b


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildPhases:
    """Where a constructor's build time went: reading the manifest, waiting on loaders, packing."""

    manifest: float = 0.0
    loaders: float = 0.0
    pack: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"manifest": _r4(self.manifest), "loaders": _r4(self.loaders), "pack": _r4(self.pack)}


@dataclass(frozen=True, slots=True, kw_only=True)
class ConstructorMetrics:
    """Window state and counters of one Data Constructor (a group of dp ranks)."""

    ranks: list[int]
    queue_depth: int = 0
    """Micro-batches held, built and not yet released."""
    held_steps: int = 0
    building_steps: int = 0
    want: dict[int, int] = field(default_factory=dict)
    """Per rank, the first step not yet taken by all its peers (the window starts there)."""
    built_steps: int = 0
    on_demand_steps: int = 0
    loader_calls: int = 0
    read_retries: int = 0
    batches_taken: int = 0
    build_s: float = 0.0
    build_phases_s: BuildPhases = field(default_factory=BuildPhases)
    rank_wait_s: dict[int, float] = field(default_factory=dict)
    """Per rank, seconds its takes waited in total."""
    rank_takes: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: per-rank maps keyed by the rank as a string, seconds to 1e-4."""
        return {
            "ranks": list(self.ranks),
            "queue_depth": self.queue_depth,
            "held_steps": self.held_steps,
            "building_steps": self.building_steps,
            "want": {str(r): w for r, w in self.want.items()},
            "built_steps": self.built_steps,
            "on_demand_steps": self.on_demand_steps,
            "loader_calls": self.loader_calls,
            "read_retries": self.read_retries,
            "batches_taken": self.batches_taken,
            "build_s": _r4(self.build_s),
            "build_phases_s": self.build_phases_s.to_dict(),
            "rank_wait_s": {str(r): _r4(w) for r, w in self.rank_wait_s.items()},
            "rank_takes": {str(r): n for r, n in self.rank_takes.items()},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderReport:
    """One loader's answer as the executor received it: its source id and worker, and its metrics."""

    source_id: int
    worker: str
    metrics: LoaderMetrics

    def to_dict(self) -> dict[str, Any]:
        return {**self.metrics.to_dict(), "source_id": self.source_id}


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceMetrics:
    """One source summed over its loaders that answered."""

    loaders: int = 0
    samples: int = 0
    tokens: int = 0
    samples_per_s: float = 0.0
    busy_s: float = 0.0
    samples_decoded: int | None = None
    """`LoaderMetrics.samples_decoded` summed; None where a loader does not count them."""
    tokens_decoded: int | None = None
    """`LoaderMetrics.tokens_decoded` summed (against `tokens` served); None where a loader does not count them."""

    retired_loaders: int = 0
    """Loaders of the source retired so far (resized away or lost): the counters above include theirs."""

    @staticmethod
    def of(loaders: list[LoaderMetrics], retired: RetiredLoaders | None = None) -> SourceMetrics:
        """Counters (`samples`, `tokens`, `busy_s`, decodes) summed over the live loaders and the `retired` ones, so
        they never go back when the source is resized or a loader replaced; `loaders`, `samples_per_s`: live only."""
        r = retired or RetiredLoaders(source="")

        def decoded(name: str) -> int | None:  # None where any loader (live or retired) did not count, or none is known
            return _total([getattr(m, name) for m in loaders] + ([r.count(name)] if r.totals is not None else []))

        return SourceMetrics(
            loaders=len(loaders),
            samples=sum(m.samples for m in loaders) + r.count("samples"),
            tokens=sum(m.tokens for m in loaders) + r.count("tokens"),
            samples_per_s=sum(m.samples_per_s or 0.0 for m in loaders),
            busy_s=sum(m.busy_s for m in loaders) + r.count("busy_s"),
            samples_decoded=decoded("samples_decoded"),
            tokens_decoded=decoded("tokens_decoded"),
            retired_loaders=r.loaders,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "loaders": self.loaders,
            "samples": self.samples,
            "tokens": self.tokens,
            "samples_per_s": round(self.samples_per_s, 1),
            "busy_s": _r4(self.busy_s),
            "samples_decoded": self.samples_decoded,
            "tokens_decoded": self.tokens_decoded,
            "retired_loaders": self.retired_loaders,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoscaleDecision:
    """One applied resize: when, at which consumer step, the source, loaders before and after, and why."""

    time: float
    step: int
    source: str
    old: int
    new: int
    why: str
    demand: float | None = None  # the inputs behind it: samples per step over the horizon
    cost_ms: float | None = None  # milliseconds per sample the policy used
    cost_samples: float | None = None  # weighted samples behind that cost (0: the per-token prior)
    ideal: float | None = None  # real-valued loaders
    budget: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The original six keys, then each input that was recorded (absent when None)."""
        inputs = {
            "demand": self.demand,
            "cost_ms": self.cost_ms,
            "cost_samples": self.cost_samples,
            "ideal": self.ideal,
            "budget": self.budget,
        }
        return {
            "time": self.time,
            "step": self.step,
            "source": self.source,
            "old": self.old,
            "new": self.new,
            "why": self.why,
            **{k: v for k, v in inputs.items() if v is not None},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoscaleRound:
    """The inputs of one autoscaling round: consumer step, loader budget, per-source demand, cost and ideal."""

    time: float
    step: int
    budget: int
    demand: dict[str, float]  # samples per step over the horizon
    cost_ms: dict[str, float]  # milliseconds per sample
    ideal: dict[str, float]  # real-valued loaders
    cost_samples: dict[str, float] = field(default_factory=dict)  # weighted samples behind each cost (0: prior)
    held: dict[str, str] = field(default_factory=dict)  # sources whose change waits, and why

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "step": self.step,
            "budget": self.budget,
            "demand": {s: round(v, 3) for s, v in self.demand.items()},
            "cost_ms": {s: round(v, 4) for s, v in self.cost_ms.items()},
            "ideal": {s: round(v, 2) for s, v in self.ideal.items()},
            "cost_samples": {s: round(v, 1) for s, v in self.cost_samples.items()},
            "held": dict(self.held),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoscaleReport:
    """The autoscaler's record: rounds run, decisions applied, the last round's inputs, the last failure."""

    enabled: bool = False
    rounds: int = 0
    decisions: tuple[AutoscaleDecision, ...] = ()
    last: AutoscaleRound | None = None
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False}
        return {
            "enabled": True,
            "rounds": self.rounds,
            "decisions": [d.to_dict() for d in self.decisions],
            "last": self.last.to_dict() if self.last is not None else {},
            "last_error": self.last_error,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryReport:
    """Recovery so far: actors recreated, rounds that recreated any, seconds spent, failed rounds."""

    recovered: int = 0
    rounds: int = 0
    seconds: float = 0.0
    last_s: float = 0.0
    failures: int = 0
    last_error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorMetrics:
    """What `Executor.metrics()` reports: every answering actor, per-source sums, recovery, autoscaling.

    `loaders` are the live loaders that answered; `retired` (per source name) the counters of the loaders
    that left the fleet. Per-source and executor counters (`sources`, `loader_samples`, `loader_calls`) are
    live + retired, so they only grow (a time series of them is monotonic, as monitoring expects), while
    rates and gauges (`samples_per_s`, memory) are the live loaders' only.
    """

    plan_id: str
    loaders: tuple[LoaderReport, ...] = ()
    constructors: tuple[ConstructorMetrics, ...] = ()
    recovery: RecoveryReport = field(default_factory=RecoveryReport)
    autoscale: AutoscaleReport = field(default_factory=AutoscaleReport)
    retired: dict[str, RetiredLoaders] = field(default_factory=dict)

    @property
    def sources(self) -> dict[str, SourceMetrics]:
        """Per source name (in the order loaders answered, then sources with only retired loaders), summed over its
        loaders: counters over live and retired ones."""
        by: dict[str, list[LoaderMetrics]] = {}
        for lo in self.loaders:
            by.setdefault(lo.metrics.source, []).append(lo.metrics)
        for s in self.retired:
            by.setdefault(s, [])
        return {s: SourceMetrics.of(ms, self.retired.get(s)) for s, ms in by.items()}

    @property
    def loader_samples(self) -> int:
        return sum(lo.metrics.samples for lo in self.loaders) + sum(r.count("samples") for r in self.retired.values())

    @property
    def loader_calls(self) -> int:
        return sum(lo.metrics.calls for lo in self.loaders) + sum(r.count("calls") for r in self.retired.values())

    @property
    def loader_memory_bytes(self) -> int:
        """Memory of every loader's index arrays."""
        return sum(lo.metrics.state_bytes for lo in self.loaders)

    @property
    def loader_rss_bytes(self) -> int:
        """Resident memory of the worker processes holding loaders (each worker once)."""
        return sum({lo.worker: lo.metrics.rss_bytes for lo in self.loaders}.values())

    @property
    def queue_depth(self) -> int:
        return sum(c.queue_depth for c in self.constructors)

    @property
    def rank_wait_s(self) -> dict[int, float]:
        """Per dp rank, seconds its takes waited."""
        out: dict[int, float] = {}
        for c in self.constructors:
            out.update(c.rank_wait_s)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `loom serve --json` (keys and rounding as before typed metrics)."""
        return {
            "plan_id": self.plan_id,
            "sources": {k: v.to_dict() for k, v in self.sources.items()},
            "loader_samples": self.loader_samples,
            "loader_calls": self.loader_calls,
            "loader_memory_bytes": self.loader_memory_bytes,
            "loader_rss_bytes": self.loader_rss_bytes,
            "queue_depth": self.queue_depth,
            "rank_wait_s": {str(r): _r4(w) for r, w in self.rank_wait_s.items()},
            "constructors": [c.to_dict() for c in self.constructors],
            "loaders": [lo.to_dict() for lo in self.loaders],
            "recovered_actors": self.recovery.recovered,
            "recovery_s": round(self.recovery.seconds, 3),
            "autoscale": self.autoscale.to_dict(),
            "retired": {s: r.to_dict() for s, r in self.retired.items()},  # counted in "sources" (session 30)
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTelemetry:
    """One rank's step as trained: the segment lengths it held, the plan's predicted cost, the measured seconds.

    `predicted` is in the plan's cost units (`parameters.cost`, divided by the lane's cp size); `seconds`
    is what the rank measured (`StreamClient.record_step_time`). `to_json` is a `loom calibrate`
    measurement line (`lengths`, `seconds`) with `step`, `rank` and `predicted` as extra keys.
    """

    step: int
    dp_rank: int
    lengths: list[int]
    predicted: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the calibrate measurement keys first, then where it came from."""
        return {
            "lengths": list(self.lengths),
            "seconds": self.seconds,
            "step": self.step,
            "rank": self.dp_rank,
            "predicted": self.predicted,
        }
