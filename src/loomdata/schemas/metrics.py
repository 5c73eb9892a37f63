"""Typed metrics of the serving actors: what a Source Loader and a Data Constructor report.

Frozen, slotted, keyword-only dataclasses: they cross processes by pickle (Dask actor calls) and are
read by attribute in the executor and the autoscaler. `to_dict()` gives the JSON-ready shape that
`loom serve --json` prints (string keys for per-rank maps, rounded seconds), the same as before these
types existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BuildPhases", "ConstructorMetrics", "LoaderMetrics"]


def _r4(x: float) -> float:
    return round(x, 4)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderMetrics:
    """Counters and rates of one Source Loader (one partition of one source)."""

    source: str
    part: int
    calls: int = 0
    samples: int = 0
    segments: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    """Seconds spent reading (in the actor's thread or inline)."""
    samples_per_s: float | None = None
    """Samples over the wall time from the first read's start to the last read's end; None before any read."""
    samples_per_busy_s: float | None = None
    state_bytes: int = 0
    """Memory of the loader's index arrays (sample -> shard, row)."""
    rss_bytes: int = 0
    """Resident memory of the worker process the loader lives in (0 where psutil cannot tell)."""

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
        }


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
