"""Pure batch building: a micro-batch's document segments and their tokens -> `Batch` arrays.

No Dask, no I/O: the Data Constructor calls `pack_batch` once per micro-batch with the tokens of its
segments laid end to end, in sequence order. Everything is vectorised over tokens; the only loop is
over images (multimodal segments).

Conventions (DESIGN.md, "Batch"):
- `input_ids[:n]` are the segments' tokens end to end, then padding with `PAD_TOKEN_ID`;
- `labels[i] = input_ids[i + 1]` inside a segment; the last token of every segment and all padding
  get `IGNORE_INDEX` (a model never learns to predict across a document boundary);
- `position_ids` restart at 0 at every segment (a continuation of a split document restarts too);
  padding positions are 0;
- `cu_seqlens = [0, l1, l1 + l2, ..., n]` (int32, one entry more than segments);
- with images, a label whose target is an image placeholder token is `IGNORE_INDEX` too (a model
  predicts text, never the placeholders that stand for image patches).
"""

from __future__ import annotations

import numpy as np

from loomdata.schemas.batch import IGNORE_INDEX, SEGMENT_DTYPE, Batch
from loomdata.schemas.errors import ExecutionError

__all__ = ["PAD_TOKEN_ID", "pack_arrays", "pack_batch"]

PAD_TOKEN_ID = 0
"""Token id written into padding positions (their labels are IGNORE_INDEX, so the value is inert)."""


def pack_arrays(
    tokens: np.ndarray, lengths: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, labels, position_ids, cu_seqlens) of segments of `lengths` whose tokens are `tokens`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if len(tokens) != total:
        raise ExecutionError(f"packing: {len(tokens)} tokens given for segments totalling {total} tokens")
    if total > seq_len:
        raise ExecutionError(
            f"packing: segments total {total} tokens, more than the sequence length {seq_len}; "
            "the plan is inconsistent with its seq_len, re-plan with `loom plan SPEC`"
        )
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    input_ids = np.full(seq_len, PAD_TOKEN_ID, dtype=np.int32)
    input_ids[:total] = tokens
    position_ids = np.zeros(seq_len, dtype=np.int32)
    position_ids[:total] = np.arange(total, dtype=np.int32) - np.repeat(cu[:-1], lengths)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
    if total > 1:
        labels[: total - 1] = input_ids[1:total]
    ends = cu[1:][lengths > 0] - 1
    labels[ends] = IGNORE_INDEX
    return input_ids, labels, position_ids, cu


def pack_batch(
    *,
    step: int,
    dp_rank: int,
    micro_batch: int,
    lane: int,
    seq_len: int,
    segments: np.ndarray,
    tokens: np.ndarray,
    images: list[np.ndarray] | None = None,
    image_positions: np.ndarray | None = None,
    image_token_id: int | None = None,
) -> Batch:
    """One `Batch` from its `segments` (SEGMENT_DTYPE, sequence order) and their tokens end to end."""
    if segments.dtype != SEGMENT_DTYPE:
        raise ExecutionError(f"packing: segments have dtype {segments.dtype}, expected SEGMENT_DTYPE")
    input_ids, labels, position_ids, cu = pack_arrays(tokens, segments["length"], seq_len)
    if images and image_token_id is not None:
        labels[labels == image_token_id] = IGNORE_INDEX
    return Batch(
        step=step,
        dp_rank=dp_rank,
        micro_batch=micro_batch,
        lane=lane,
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        cu_seqlens=cu,
        segments=segments,
        images=list(images or []),
        image_positions=(np.zeros(0, dtype=np.int32) if image_positions is None else image_positions.astype(np.int32)),
    )
