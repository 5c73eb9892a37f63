"""Segments: the pieces of documents a step holds, as named columns (one entry per segment)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DenseIds", "RowIds", "SampleIds", "Segments"]

_COLUMNS = ("source", "sample", "offset", "length", "lane", "image_tokens")


class DenseIds:
    """The sample ids 0..n-1 of an index whose `sample` column is dense (as `loom index` writes it), without
    storing them: `ids[rows]` is `rows` as uint64, so planning keeps no 8-byte id per indexed sample."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, rows: np.ndarray | int) -> np.ndarray:
        return np.asarray(rows).astype(np.uint64)


class RowIds:
    """The sample ids of chosen rows of a dense index (a range's window, planning._ranges.window): `ids[i]` is
    `rows[i]` as uint64, as DenseIds gives them, without storing 8 bytes a row."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: np.ndarray | int) -> np.ndarray:
        return np.asarray(self.rows[i]).astype(np.uint64)

    def __reduce__(self) -> tuple[type[RowIds], tuple[np.ndarray]]:
        return RowIds, (self.rows,)


SampleIds = np.ndarray | DenseIds
"""A source's sample id of each index row: stored, or dense (0..n-1) and not stored."""


@dataclass(frozen=True, slots=True)
class Segments:
    """Columns of a run of segments: which source and sample, where in the sample, how long, which lane,
    and the sample's image tokens (non-zero only for a whole sample with images, which is never split)."""

    source: np.ndarray  # uint16 source id (index into the plan's sources)
    sample: np.ndarray  # uint64 sample id
    offset: np.ndarray  # uint32 first token of the segment within the sample
    length: np.ndarray  # int64 tokens
    lane: np.ndarray  # uint8: 0 short, 1 long
    image_tokens: np.ndarray  # uint32

    def __len__(self) -> int:
        return len(self.source)

    @classmethod
    def concat(cls, parts: Sequence[Segments]) -> Segments:
        """The parts one after the other (column by column)."""
        return cls(*(np.concatenate([getattr(p, c) for p in parts]) for c in _COLUMNS))

    def take(self, idx: np.ndarray | slice) -> Segments:
        """The segments at `idx` (an index array, a mask or a slice), in that order."""
        return Segments(*(getattr(self, c)[idx] for c in _COLUMNS))
