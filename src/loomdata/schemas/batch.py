"""What a rank receives for one micro-batch: NumPy arrays, wrapped without copying by the torch adapter."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["IGNORE_INDEX", "SEGMENT_DTYPE", "Batch"]

IGNORE_INDEX = -100
"""Label value across document boundaries and padding (ignored by cross-entropy)."""

SEGMENT_DTYPE = np.dtype(
    [("source", np.uint16), ("sample", np.uint64), ("offset", np.uint32), ("length", np.uint32)]
)
"""Provenance of each document segment in a batch, in sequence order."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One packed micro-batch for one data-parallel rank.

    `input_ids`, `labels` and `position_ids` have the lane's sequence length; `cu_seqlens` has one
    entry more than there are documents (the last entry is the number of real tokens; padding follows).
    `images` holds decoded image arrays (HWC uint8) of multimodal samples, in sequence order, and
    `image_positions` the index of each image's first placeholder token in `input_ids`.
    """

    step: int
    dp_rank: int
    micro_batch: int
    lane: int
    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    segments: np.ndarray
    images: list[np.ndarray] = field(default_factory=list)
    image_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch."""
        return int(self.cu_seqlens[-1]) if len(self.cu_seqlens) else 0
