"""What an index build did, per source: the figures `loom index --json` prints."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["IndexSummary", "SourceSummary"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSummary:
    """One source's index: its size, what was skipped, and how much of it this run scanned."""

    shards: int  # shards in the index (whole skipped shards excluded)
    samples: int
    tokens: int  # sum of num_tokens (text plus image placeholder tokens)
    image_tokens: int
    skipped: int  # skipped shards plus skipped samples, each listed in errors.parquet
    rescanned: int  # shards scanned by this run
    reused: int  # shards taken from the cache of an earlier run
    removed: int  # shards of the previous index that are gone
    fingerprint: str  # content fingerprint of the index (samples.parquet metadata)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexSummary:
    """The result of `build_index`: a summary per source and the wall time of the whole build."""

    sources: Mapping[str, SourceSummary]
    elapsed_s: float

    def to_dict(self) -> dict[str, Any]:
        """`{"sources": {name: {...}}, "elapsed_s": ...}`: what `loom index --json` prints."""
        return {
            "sources": {name: s.to_dict() for name, s in self.sources.items()},
            "elapsed_s": round(self.elapsed_s, 3),
        }
