"""Pure batch building: a micro-batch's document segments and their tokens -> `Batch` arrays.

No Dask, no I/O: the Data Constructor calls `pack_step` with a step's manifest rows and its loaders'
answers, which scatters the tokens into manifest order and calls `pack_batch` once per micro-batch
with the tokens of its segments laid end to end, in sequence order. Everything is vectorised over
tokens; the only loops are over micro-batches and images (multimodal segments).

Conventions (DESIGN.md, "Batch"):
- `input_ids[:n]` are the segments' tokens end to end, then padding with the spec's
  `tokenizer.pad_token_id` (`PackRules`);
- `labels[i] = input_ids[i + 1]` inside a segment; the last token of every segment and all padding
  get `IGNORE_INDEX` (a model never learns to predict across a document boundary);
- `position_ids` restart at 0 at every segment (a continuation of a split document restarts too);
  padding positions are 0;
- `cu_seqlens = [0, l1, l1 + l2, ..., n]` (int32, one entry more than segments);
- with images, a label whose target is an image placeholder token is `IGNORE_INDEX` too (a model
  predicts text, never the placeholders that stand for image patches).

Context parallelism: `shard_batch` cuts a packed micro-batch into the shard one CP rank holds (the
layout of `schemas.context_parallel`: chunks i and 2cp-1-i of 2cp), after packing, so labels and
position ids are those of the whole sequence; `peer_batches` gives a CP peer the shards of its
step's micro-batches, each by its lane's cp size (a lane of cp 1 is served whole to every peer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loomdata.schemas.batch import IGNORE_INDEX, SEGMENT_DTYPE, Batch, derive_labels_positions
from loomdata.schemas.context_parallel import cp_group_check, cp_positions, lane_cp_sizes
from loomdata.schemas.errors import ExecutionError

if TYPE_CHECKING:  # annotations only: packing stays free of the loader's imports (formats, Arrow) and of pydantic
    from loomdata.execution._loader import SegmentData
    from loomdata.execution._manifest import ManifestRows
    from loomdata.schemas.plan import AnyPlan
    from loomdata.schemas.plan_view import SpecView
    from loomdata.schemas.spec import Spec

__all__ = ["PackRules", "pack_arrays", "pack_batch", "pack_step", "peer_batches", "scatter_answers", "shard_batch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PackRules:
    """The token ids packing writes or masks, from the plan's spec (the one place they are read)."""

    pad_token_id: int
    """Written into padding positions (their labels are IGNORE_INDEX, so the value is inert)."""
    image_token_id: int
    """The image placeholder token: a label that targets it is IGNORE_INDEX."""

    @classmethod
    def of(cls, spec: Spec | SpecView) -> PackRules:
        return cls(pad_token_id=spec.tokenizer.pad_token_id, image_token_id=spec.images.placeholder_token_id)


def pack_arrays(
    tokens: np.ndarray, lengths: np.ndarray, seq_len: int, *, pad_token_id: int
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
    input_ids = np.full(seq_len, pad_token_id, dtype=np.int32)
    input_ids[:total] = tokens
    one = np.array([0, seq_len], dtype=np.int64)  # one batch: the rule a thin block's batches are derived by
    labels, position_ids = derive_labels_positions(input_ids, one, cu, np.array([0, len(cu)], dtype=np.int64))
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
    pad_token_id: int,
    images: list[np.ndarray] | None = None,
    image_positions: np.ndarray | None = None,
    image_token_id: int | None = None,
) -> Batch:
    """One `Batch` from its `segments` (SEGMENT_DTYPE, sequence order) and their tokens end to end."""
    if segments.dtype != SEGMENT_DTYPE:
        raise ExecutionError(f"packing: segments have dtype {segments.dtype}, expected SEGMENT_DTYPE")
    input_ids, labels, position_ids, cu = pack_arrays(tokens, segments["length"], seq_len, pad_token_id=pad_token_id)
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


def scatter_answers(
    rows: ManifestRows, groups: list[np.ndarray], answers: list[SegmentData]
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]:
    """Loader answers laid out in manifest order: (row starts, tokens, images, each image's row and offset).

    `answers[k]` holds the tokens (and images) of rows `groups[k]`, in that order; `starts` has one more
    entry than `rows` (row i's tokens are `tokens[starts[i]:starts[i + 1]]`). Images end in sequence order
    (row, then offset in it) whatever the number of loaders (answers) they came from.
    """
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(rows.length, out=starts[1:])
    flat = np.empty(int(starts[-1]), dtype=np.int32)
    img_row: list[np.ndarray] = []
    img_off: list[np.ndarray] = []
    images: list[np.ndarray] = []
    for sel, ans in zip(groups, answers, strict=True):
        if len(sel) and int(sel[-1]) - int(sel[0]) == len(sel) - 1:  # consecutive rows: one slice copy
            flat[starts[sel[0]] : starts[sel[-1] + 1]] = ans.tokens
        else:
            lens = rows.length[sel].astype(np.int64)
            ans_starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            dst = np.repeat(starts[sel] - ans_starts, lens) + np.arange(int(lens.sum()), dtype=np.int64)
            flat[dst] = ans.tokens
        if ans.images:
            images.extend(ans.images)
            img_row.append(sel[ans.image_segment])
            img_off.append(ans.image_offset)
    all_img_row = np.concatenate(img_row) if img_row else np.zeros(0, dtype=np.int64)
    all_img_off = np.concatenate(img_off) if img_off else np.zeros(0, dtype=np.int64)
    if len(images) > 1:  # answers come per loader: put images in sequence order (row, then offset in it)
        order = np.lexsort((all_img_off, all_img_row))
        all_img_row, all_img_off = all_img_row[order], all_img_off[order]
        images = [images[k] for k in order.tolist()]
    return starts, flat, images, all_img_row, all_img_off


def pack_step(
    meta: AnyPlan,
    rules: PackRules,
    step: int,
    ranks: list[int],
    rows: ManifestRows,
    groups: list[np.ndarray],
    answers: list[SegmentData],
) -> dict[int, list[Batch]]:
    """Every micro-batch of `ranks` at `step`: scatter loader answers into manifest order, then pack.

    `rows` are the step's manifest rows ordered by (dp_rank, micro_batch); `answers[k]` holds the
    tokens (and images) of rows `groups[k]`, in that order. Images end in sequence order whatever the
    number of loaders (answers) they came from.
    """
    starts, flat, images, all_img_row, all_img_off = scatter_answers(rows, groups, answers)
    mbs = meta.micro_batches
    key = rows.dp_rank.astype(np.int64) * mbs + rows.micro_batch.astype(np.int64)
    firsts = np.array([r * mbs + mb for r in ranks for mb in range(mbs)], dtype=np.int64)
    edges = np.searchsorted(key, np.concatenate([firsts, firsts + 1])).tolist()  # one search per step
    seg_all = np.empty(len(rows), dtype=SEGMENT_DTYPE)  # the step's segments, each batch a slice of them
    seg_all["source"] = rows.source
    seg_all["sample"] = rows.sample
    seg_all["offset"] = rows.offset
    seg_all["length"] = rows.length
    lanes = rows.lane.tolist()
    bounds = starts.tolist()
    out: dict[int, list[Batch]] = {}
    k = 0
    for r in ranks:
        batches = []
        for mb in range(mbs):
            lo, hi = edges[k], edges[k + len(firsts)]
            k += 1
            lane = int(lanes[lo]) if hi > lo else 0
            imgs: list[np.ndarray] = []
            img_pos = None
            if images:
                in_mb = np.flatnonzero((all_img_row >= lo) & (all_img_row < hi))
                imgs = [images[j] for j in in_mb.tolist()]
                img_pos = starts[all_img_row[in_mb]] - starts[lo] + all_img_off[in_mb]
            batches.append(
                pack_batch(
                    step=step,
                    dp_rank=r,
                    micro_batch=mb,
                    lane=lane,
                    seq_len=meta.lane_seq_len(lane),
                    segments=seg_all[lo:hi],
                    tokens=flat[bounds[lo] : bounds[hi]],
                    pad_token_id=rules.pad_token_id,
                    images=imgs,
                    image_positions=img_pos,
                    image_token_id=rules.image_token_id,
                )
            )
        out[r] = batches
    return out


def shard_batch(batch: Batch, cp_rank: int, cp_size: int, *, image_token_id: int | None = None) -> Batch:
    """CP rank `cp_rank`'s shard of a whole micro-batch cut `cp_size` ways (the batch itself for cp_size 1).

    Images go to every shard that holds any of their placeholder tokens (`image_token_id` marks
    them; an image's run of placeholders ends at the next non-placeholder token or the next image).
    """
    if batch.is_shard:
        raise ValueError(f"shard_batch: step {batch.step} micro-batch {batch.micro_batch} is already a shard")
    if cp_size == 1:
        if cp_rank != 0:
            raise ValueError(f"cp_rank must be 0 for cp_size 1, got {cp_rank}")
        return batch
    n = len(batch.input_ids)
    pos = cp_positions(n, cp_size, cp_rank)
    images, img_pos = batch.images, batch.image_positions
    if images:
        held = np.zeros(n + 1, dtype=np.int64)
        held[pos + 1] = 1
        np.cumsum(held, out=held)  # held[k] = held positions before k
        start = img_pos.astype(np.int64)
        end = np.full(len(start), n, dtype=np.int64)
        other = np.flatnonzero(batch.input_ids != image_token_id) if image_token_id is not None else None
        if other is not None and len(other):
            at = np.searchsorted(other, start)
            end = np.where(at < len(other), other[np.minimum(at, len(other) - 1)], n)
        end = np.minimum(end, np.r_[start[1:], n])
        end = np.maximum(end, start + 1)  # an image holds at least its first position
        keep = np.flatnonzero(held[np.minimum(end, n)] - held[np.minimum(start, n)] > 0)
        images, img_pos = [images[k] for k in keep.tolist()], img_pos[keep]
    return Batch(
        step=batch.step,
        dp_rank=batch.dp_rank,
        micro_batch=batch.micro_batch,
        lane=batch.lane,
        input_ids=batch.input_ids[pos],
        labels=batch.labels[pos],
        position_ids=batch.position_ids[pos],
        cu_seqlens=batch.cu_seqlens,
        segments=batch.segments,
        images=list(images),
        image_positions=img_pos,
        cp_rank=cp_rank,
        cp_size=cp_size,
        sequence_len=n,
    )


def peer_batches(meta: AnyPlan, rules: PackRules, batches: list[Batch], cp_rank: int) -> list[Batch]:
    """What CP peer `cp_rank` of a dp rank receives of its micro-batches: each one's shard by its lane's cp size.

    A lane of cp size k < cp_group_size is sharded k ways and peer c takes shard c % k (cp 1: whole).
    """
    cp_group_check(meta, cp_rank)
    cps = lane_cp_sizes(meta)
    out = []
    for b in batches:
        k = cps[b.lane] if b.lane < len(cps) else 1
        out.append(shard_batch(b, cp_rank % k, k, image_token_id=rules.image_token_id))
    return out
