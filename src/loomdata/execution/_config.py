"""Serving settings in one place: `ServeConfig` (what to serve with), `Autoscaling`, `Timings`.

Built once at the edge (`loom serve`, `serve()`, the demo, a library caller) and passed down to the
Executor and its control loop; nothing below reads a default of its own. Every field is validated
when the config is made: a bad value raises ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from loomdata.execution._window import step_bytes

__all__ = [
    "DEFAULT_BYTES_IN_FLIGHT",
    "DEFAULT_CONSTRUCTOR_BYTES",
    "DEFAULT_LOADER_MEMORY",
    "DEFAULT_LOADER_PREFETCH",
    "DEFAULT_WORKERS",
    "MAX_STEPS_AHEAD",
    "Autoscaling",
    "ServeConfig",
    "Timings",
]

DEFAULT_WORKERS = 2
"""Worker processes of the embedded LocalCluster (`loom index`, `loom serve`, the demo)."""

DEFAULT_LOADER_MEMORY = 256 * 1024 * 1024
"""The most bytes of decoded rows all Source Loaders of a plan on one worker keep together (`--loader-memory`).

A cap, not a fill target: loaders keep only the rows their next planned steps read (`_loader_cache`)."""

DEFAULT_BYTES_IN_FLIGHT = 8 * 1024 * 1024
"""Bytes of one rank's packed batches built ahead of it (`--bytes-in-flight`); a take moves up to half of them.

8 MiB (session 21; 4 before): 512 steps of 4096 tokens (4 bytes a token as held and moved) for a rank alone on its
constructor; ranks sharing one get less (`DEFAULT_CONSTRUCTOR_BYTES`)."""

DEFAULT_CONSTRUCTOR_BYTES = 16 * 1024 * 1024
"""Bytes of batches one constructor builds ahead for all its ranks together (`constructor_bytes`).

Shared by its ranks: at 4096 tokens a step (16 KiB thin) 1 or 2 ranks get `bytes_in_flight`'s 512 steps each,
4 ranks 256, 16 ranks 64 (what they held before session 21), so a wide window where few ranks share a constructor
costs no more memory where many do."""

MAX_STEPS_AHEAD = 512
"""The most steps the bytes bounds alone build ahead (tiny steps: per-call costs are amortized long before).

Each take and each build group costs the constructor's worker a fixed few ms of CPU and the rank ~0.5 ms (session
21): at 4096 tokens a step one rank made 182 takes of 3,000 steps with a 64-step window, 46 with 256, 23 with 512."""

SHARED_FLOOR_STEPS = 64
"""The fewest steps the per-constructor budget leaves each rank (when `bytes_in_flight` allows them): what every rank
held before session 21, so a constructor serving more than 16 ranks of 4096 tokens holds more than `constructor_bytes`
rather than making more calls a step (each take and build group costs a fixed few ms). Also the most steps a plan with
images builds ahead."""

DEFAULT_LOADER_PREFETCH = 8
"""Read units (row groups) each Source Loader reads ahead at once (`--loader-prefetch`): hides a GET's latency."""

LOCAL_READ_AHEAD = ("auto", "on", "off")
"""`--local-read-ahead`: whether loaders of local files read ahead. auto (default): not until their own reads are
measured to stall the steps (`_prefetch.ReadStall`); on: always, at `loader_prefetch` depth; off: never. A read ahead
of a file the page cache holds is double work (thread hand-offs, futures); a cold or networked disk needs it.
Object URLs always read ahead."""


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {getattr(obj, name)!r}")


def _at_least_one(obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if v is not None and v < 1:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= 1, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Timings:
    """Every wait, period and retry budget of serving, executor and client side (seconds unless said)."""

    call_timeout_s: float = 60.0  # creating an actor or a control call (set_routes); steps never wait on it
    close_timeout_s: float = 10.0  # stopping a constructor or closing a loader
    metrics_timeout_s: float = 30.0  # an actor's metrics() answer
    create_attempts: int = 3  # a loader lost while being created is submitted again, this many times in all
    recovery_every_s: float = 0.2  # how often the control loop looks for lost actors
    recovery_backoff_max_s: float = 5.0  # the longest pause after failed recoveries (doubles per failure)
    stop_timeout_s: float = 60.0  # how long stop() waits for the control loop to finish its current step
    serve_poll_s: float = 0.2  # how often `serve` checks for Ctrl-C/SIGTERM
    connect_timeout_s: float = 30.0  # connecting a Client to a scheduler
    client_retry_s: float = 60.0  # how long a StreamClient retries a step before failing
    client_retry_pause_s: float = 0.25  # between a StreamClient's attempts
    client_check_s: float = 2.0  # while a take waits this long, check its constructor is still published
    heartbeat_s: float = 1.0  # how often a serving executor refreshes serve.json's heartbeat_at
    dead_after_s: float = 4.0  # a heartbeat this old (or a gone pid): a client says the executor is dead

    def __post_init__(self) -> None:
        _positive(self, *(f.name for f in fields(self) if f.name.endswith("_s")))
        _at_least_one(self, "create_attempts")


@dataclass(frozen=True, slots=True, kw_only=True)
class Autoscaling:
    """Controller settings: period, how many coming steps set the demand, budget, target rate, hysteresis.

    Stability: a source's measured cost replaces the per-token prior only after `min_samples` samples
    and `min_busy_s` busy seconds (one slow cold read is not a cost); measurements are kept across
    loader replacement, older rounds weighted by `cost_decay` (1.0: cumulative). A source is resized
    at most once per `source_interval_s` and the fleet at most once per `resize_interval_s`
    (None: 4 and 2 periods).
    """

    every_s: float = 5.0
    horizon_steps: int = 32
    budget: int | None = None  # default: loaders_per_thread x the cluster's worker threads
    loaders_per_thread: int = 2
    step_rate: float | None = None  # steps/s to sustain; None: use the whole budget
    min_change: float = 0.25
    min_samples: int = 64
    min_busy_s: float = 0.25
    cost_decay: float = 0.8
    source_interval_s: float | None = None
    resize_interval_s: float | None = None

    def __post_init__(self) -> None:
        _positive(self, "every_s")
        _at_least_one(self, "horizon_steps", "budget", "loaders_per_thread", "min_samples")
        if self.min_change < 0:
            raise ValueError(f"Autoscaling.min_change must be >= 0, got {self.min_change!r}")
        if self.step_rate is not None and self.step_rate < 0:
            raise ValueError(f"Autoscaling.step_rate must be >= 0 steps/s, got {self.step_rate!r}")
        if self.min_busy_s < 0:
            raise ValueError(f"Autoscaling.min_busy_s must be >= 0 seconds, got {self.min_busy_s!r}")
        if not 0.0 < self.cost_decay <= 1.0:
            raise ValueError(f"Autoscaling.cost_decay must be in (0, 1] (1: cumulative), got {self.cost_decay!r}")
        for name in ("source_interval_s", "resize_interval_s"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"Autoscaling.{name} must be >= 0 seconds or None, got {v!r}")

    @property
    def source_gap_s(self) -> float:
        """The least time between two resizes of one source."""
        return 4 * self.every_s if self.source_interval_s is None else self.source_interval_s

    @property
    def fleet_gap_s(self) -> float:
        """The least time between two rounds that resize anything."""
        return 2 * self.every_s if self.resize_interval_s is None else self.resize_interval_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """How one plan is served: actor counts, window, peers, recovery, autoscaling, metrics, timings.

    `autoscale` None: loader counts stay as set (`loaders_per_source`, `Executor.set_loaders`).
    `loader_memory`: the most bytes of decoded rows of read units (row groups) the loaders on one worker
    keep together, each only until its last use in the next `window` + 2 steps (`_loader_cache`; 0: keep none).
    `bytes_in_flight`: bytes of one rank's batches built ahead of it; `constructor_bytes`: bytes one
    constructor builds ahead for all its ranks together. The window is `max(window, min(bytes_in_flight //
    step, max(constructor_bytes // (ranks x step), min(bytes_in_flight // step, SHARED_FLOOR_STEPS)),
    MAX_STEPS_AHEAD))` steps (`constructor_bytes` 0: `window` alone), `step` the bytes of a rank's step as held and
    moved (`_window.step_bytes`: 4 a token; one micro-batch at the long lane's length where the plan has one) and
    `ranks` the most a constructor serves (`steps_ahead`; a plan with images: `max(window, min(bytes_in_flight //
    (3 x step), SHARED_FLOOR_STEPS))`, no shared bound); a
    client takes up to half of it a call with prefetch on, all of it without (the `window` + 2 above is that
    window). Memory: a build group's block lives until its last step is taken, so a constructor may hold up to
    about twice its steps' bytes, and the loaders' horizon follows the window (more rows planned ahead at 1-4 ranks
    a constructor, within `loader_memory` for decoded units).
    `loader_prefetch`: read units each loader reads ahead at once for its next planned steps, within
    `loader_memory` (`_prefetch`; 0, or `loader_memory` 0: no read-ahead); for object URLs the floor: more are
    kept in flight as the measured step rate x the store's latency needs (`_prefetch.reads_in_flight`, at most 32).
    `local_read_ahead`: for local files, auto (read ahead at `loader_prefetch` only once the loader's own reads are
    measured to stall its steps, `_prefetch.ReadStall`), on (always) or off (never); object URLs always read ahead.
    `peers` None: the plan's tp*pp*cp. `loaders_per_source` is one count or a count per source name
    (1 for sources not named). `n_workers` sizes the embedded cluster only (no scheduler given).
    """

    constructors: int = 1
    window: int = 2  # steps built ahead of the slowest rank
    peers: int | None = None
    loaders_per_source: int | Mapping[str, int] = 1
    start_step: int = 0
    recover: bool = True
    autoscale: Autoscaling | None = None
    n_workers: int = DEFAULT_WORKERS
    loader_memory: int = DEFAULT_LOADER_MEMORY
    bytes_in_flight: int = DEFAULT_BYTES_IN_FLIGHT
    constructor_bytes: int = DEFAULT_CONSTRUCTOR_BYTES
    loader_prefetch: int = DEFAULT_LOADER_PREFETCH
    local_read_ahead: str = "auto"
    metrics_every_s: float = 10.0  # `serve`'s metrics lines
    timings: Timings = field(default_factory=Timings)

    def __post_init__(self) -> None:
        _at_least_one(self, "constructors", "window", "peers")
        if self.n_workers < 0:
            raise ValueError(
                f"ServeConfig.n_workers must be >= 0 (0: the worker in the serving process), got {self.n_workers!r}"
            )
        _positive(self, "metrics_every_s")
        if self.start_step < 0:
            raise ValueError(f"ServeConfig.start_step must be >= 0, got {self.start_step!r}")
        if self.bytes_in_flight < 0:
            raise ValueError(f"ServeConfig.bytes_in_flight must be >= 0 bytes, got {self.bytes_in_flight!r}")
        if self.constructor_bytes < 0:
            raise ValueError(f"ServeConfig.constructor_bytes must be >= 0 bytes, got {self.constructor_bytes!r}")
        if self.loader_memory < 0:
            raise ValueError(f"ServeConfig.loader_memory must be >= 0 bytes, got {self.loader_memory!r}")
        if self.loader_prefetch < 0:
            raise ValueError(f"ServeConfig.loader_prefetch must be >= 0 units in flight, got {self.loader_prefetch!r}")
        if self.local_read_ahead not in LOCAL_READ_AHEAD:
            raise ValueError(
                f"ServeConfig.local_read_ahead must be one of {LOCAL_READ_AHEAD}, got {self.local_read_ahead!r}"
            )
        n = self.loaders_per_source
        if isinstance(n, Mapping):
            bad = {k: v for k, v in n.items() if not isinstance(v, int) or v < 1}
            if bad:
                raise ValueError(f"ServeConfig.loaders_per_source must be >= 1 per source, got {bad}")
            object.__setattr__(self, "loaders_per_source", dict(n))  # a copy: later edits by the caller do not leak in
        elif n < 1:
            raise ValueError(f"ServeConfig.loaders_per_source must be >= 1, got {n!r}")
        if self.autoscale is not None and not isinstance(self.autoscale, Autoscaling):
            raise ValueError(f"ServeConfig.autoscale must be Autoscaling settings or None, got {self.autoscale!r}")

    def steps_ahead(self, step_bytes: int, ranks: int = 1) -> int:
        """Steps built ahead of each rank whose step is `step_bytes` bytes, `ranks` of them sharing a constructor:
        `window`, or more to hold `bytes_in_flight` a rank within `constructor_bytes` for all of them.

        What the bytes bounds add is capped at MAX_STEPS_AHEAD; `window` itself is never lowered.
        """
        if step_bytes < 1:
            raise ValueError(f"step_bytes must be >= 1, got {step_bytes!r}")
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks!r}")
        per_rank = self.bytes_in_flight // step_bytes
        shared = self.constructor_bytes // (ranks * step_bytes)
        if self.constructor_bytes > 0:  # many ranks on one constructor: never fewer steps each than before the budget
            shared = max(shared, min(per_rank, SHARED_FLOOR_STEPS))
        return max(self.window, min(per_rank, shared, MAX_STEPS_AHEAD))

    def for_plan(
        self,
        seq_len: int,
        micro_batches: int,
        dp_size: int = 1,
        *,
        long_seq_len: int | None = None,
        images: bool = False,
    ) -> ServeConfig:
        """This config with `window` widened to hold the bytes bounds of a plan's steps (what Executor uses); the
        largest group of its `dp_size` ranks one of `constructors` serves shares `constructor_bytes`.

        A step of a plan with a long lane is counted with one of its micro-batches at `long_seq_len` (an upper bound
        where long lanes are rarer), and a plan with images at three arrays a token and at most SHARED_FLOOR_STEPS
        steps, `bytes_in_flight` alone (image groups are held as whole batches and their pixels are not counted: the
        bound before session 21)."""
        step = step_bytes(seq_len, micro_batches) + 4 * max(0, (long_seq_len or 0) - seq_len)  # one long lane a step
        if images:
            return self.with_settings(
                window=max(self.window, min(self.bytes_in_flight // (3 * step), SHARED_FLOOR_STEPS))
            )
        ranks = -(-dp_size // max(1, min(self.constructors, dp_size)))
        return self.with_settings(window=self.steps_ahead(step, max(1, ranks)))

    def loaders_for(self, source: str) -> int:
        """The starting loader count of `source`."""
        n = self.loaders_per_source
        return int(n.get(source, 1)) if isinstance(n, Mapping) else int(n)

    def with_settings(self, **settings: Any) -> ServeConfig:
        """A copy with some fields changed; `autoscale=True` means default Autoscaling, False none."""
        if "autoscale" in settings and isinstance(settings["autoscale"], bool):
            settings["autoscale"] = Autoscaling() if settings["autoscale"] else None
        unknown = set(settings) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(
                f"unknown serving settings {sorted(unknown)}; ServeConfig has {[f.name for f in fields(self)]}"
            )
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return ServeConfig(**{**values, **settings})
