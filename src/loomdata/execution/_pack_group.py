"""A build group packed at once: all its (rank, step) micro-batches in one vectorised pass, into one block.

`pack_step` (the reference, and the path for images) builds every micro-batch alone: a dozen NumPy calls
and fresh arrays per batch, which a take then copies into a `BatchBlock`. Here a group's text batches are
laid out rank by rank, step by step, micro-batch by micro-batch, in the arrays of one `BatchBlock`; what
the window holds per (rank, step) is a `StepPack` naming its batches in that block, and a take of
consecutive steps of one group is a slice of it (`block_of`: no copy; steps of two groups: one copy of
their pieces). The block's `input_ids` is the loaders' answers' rows and each batch's padding joined in block order
by one `concatenate` of views (`_join`; no pad fill first, no scatter into manifest order). The block is thin
(`BatchBlock.thin`): labels and position ids follow from `input_ids` and `cu_seqlens`, so they are built where
batches are made of it (on the rank, `BatchBlock.batches`), never here and never sent (session 18: a third of
the bytes a take moves). Rows no answer covers (never in serving) are padding, placed by `place_tokens`. The
batches are those of `pack_step` (tests compare them batch by batch).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from loomdata.execution._packing import PackRules, pack_step
from loomdata.schemas.batch import BLOCK_ARRAYS, DERIVED_ARRAYS, SEGMENT_DTYPE, Batch, BatchBlock
from loomdata.schemas.errors import ExecutionError

if TYPE_CHECKING:  # annotations only (packing stays free of the loader's imports and of pydantic)
    from loomdata.execution._loader import SegmentData
    from loomdata.execution._manifest import ManifestRows
    from loomdata.schemas.plan import AnyPlan

__all__ = ["StepPack", "block_of", "pack_joined", "place_tokens", "split_answers"]

Work = list[tuple[int, list[int]]]  # (step, ranks) of a build group
Answers = tuple[list[np.ndarray], list["SegmentData"]]  # as `_reads.Answers`: row indices and answer per request


class StepPack:
    """One rank's micro-batches of one step: batches `[first, stop)` of `block`, or plain `Batch`es (no block)."""

    __slots__ = ("_batches", "block", "first", "stop")

    def __init__(
        self, *, block: BatchBlock | None = None, first: int = 0, stop: int = 0, batches: list[Batch] | None = None
    ) -> None:
        self.block, self.first, self.stop = block, first, stop
        self._batches = batches

    @property
    def batches(self) -> list[Batch]:
        """The micro-batches, made on first use (views into the block; labels and position ids derived: it is thin)."""
        if self._batches is None:
            assert self.block is not None
            self._batches = self.block.batches(self.first, self.stop)
        return self._batches

    def made(self) -> list[Batch]:
        """The micro-batches, made without keeping them: a held pack stays thin (4 bytes a token, as `step_bytes`
        counts it) when a CP peer's shards are cut from it."""
        if self._batches is not None or self.block is None:
            return self.batches
        return self.block.batches(self.first, self.stop)

    def __len__(self) -> int:
        return self.stop - self.first if self.block is not None else len(self.batches)


def pack_joined(
    meta: AnyPlan, rules: PackRules, work: Work, rows: ManifestRows, bounds: np.ndarray, joined: Answers
) -> list[dict[int, StepPack]]:
    """Every (step, ranks) of `work` packed, as `pack_step` would, into one block, from the steps' rows end to end
    (step i's are `bounds[i]:bounds[i + 1]`: `ManifestSlice.rows_of`) and the answers for them (`_reads.Reads.
    read_steps`): used whole, never cut per step, except where images send each step through `pack_step`
    (`split_answers`)."""
    if any(a.images for a in joined[1]):
        cuts = bounds.tolist()
        per_step = [rows.take(slice(a, b)) for a, b in itertools.pairwise(cuts)]
        return _per_step(meta, rules, work, per_step, split_answers(rows.length, cuts, joined))
    return _packs(meta, work, *_block(meta, rules, work, rows, bounds, joined))


def split_answers(lengths: np.ndarray, bounds: Sequence[int], answers: Answers) -> list[Answers]:
    """Cut the answers for rows laid end to end into the answers of each part `[bounds[i], bounds[i+1])`.

    `lengths`: every row's token count. A request's row indices ascend, so each part's rows are one
    contiguous slice of it, and their tokens one contiguous slice of its answer (a view, no copy).
    """
    groups, datas = answers
    out: list[Answers] = [([], []) for _ in range(len(bounds) - 1)]
    for sel, data in zip(groups, datas, strict=True):
        cuts = np.searchsorted(sel, bounds)
        tok = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(lengths[sel], out=tok[1:])
        for i in range(len(bounds) - 1):
            a, b = int(cuts[i]), int(cuts[i + 1])
            if a == b:
                continue
            if data.images:
                pick = np.flatnonzero((data.image_segment >= a) & (data.image_segment < b))
                images = [data.images[k] for k in pick.tolist()]
                image_segment, image_offset = data.image_segment[pick] - a, data.image_offset[pick]
            else:
                images, image_segment, image_offset = [], data.image_segment[:0], data.image_offset[:0]
            part = dataclasses.replace(
                data,
                tokens=data.tokens[tok[a] : tok[b]],
                images=images,
                image_segment=image_segment,
                image_offset=image_offset,
            )
            out[i][0].append(sel[a:b] - bounds[i])
            out[i][1].append(part)
    return out


def _per_step(
    meta: AnyPlan, rules: PackRules, work: Work, rows: Sequence[ManifestRows], answers: Sequence[Answers]
) -> list[dict[int, StepPack]]:
    """Each step packed alone by `pack_step` (the path for images)."""
    return [
        {r: StepPack(batches=b) for r, b in pack_step(meta, rules, step, ranks, rw, g, a).items()}
        for (step, ranks), rw, (g, a) in zip(work, rows, answers, strict=True)
    ]


def _packs(
    meta: AnyPlan, work: Work, block: BatchBlock, first: dict[tuple[int, int], int]
) -> list[dict[int, StepPack]]:
    """Each (step, rank)'s pack: its micro-batches in the group's block."""
    mbs = meta.micro_batches
    return [
        {r: StepPack(block=block, first=first[(r, i)], stop=first[(r, i)] + mbs) for r in ranks}
        for i, (_, ranks) in enumerate(work)
    ]


def _block(
    meta: AnyPlan,
    rules: PackRules,
    work: Work,
    rows: ManifestRows,
    step_at: np.ndarray,
    joined: Answers,
) -> tuple[BatchBlock, dict[tuple[int, int], int]]:
    """The group's block (batches by rank, then step, then micro-batch) and each (rank, work index)'s first batch,
    from the steps' rows end to end (`step_at`: where each step's start, one more: the end) and the answers for them."""
    mbs = meta.micro_batches
    order = sorted({r for _, ranks in work for r in ranks})
    pairs = [(r, i) for r in order for i, (_, ranks) in enumerate(work) if r in ranks]
    first = {p: k * mbs for k, p in enumerate(pairs)}
    n_batches = len(pairs) * mbs
    table = np.full((max(order) + 1, len(work)), -1, dtype=np.int64)  # (rank, work index) -> first batch
    for (r, i), b in first.items():
        table[r, i] = b
    # Every row of the group (the steps' rows end to end) with its batch.
    widx = np.repeat(np.arange(len(work), dtype=np.int64), np.diff(step_at))
    col = {c: getattr(rows, c) for c in ("dp_rank", "micro_batch", "lane", "length")}
    bidx = table[col["dp_rank"].astype(np.int64), widx]
    if len(bidx) and (bidx < 0).any():
        raise ExecutionError("packing: manifest rows of a rank that was not asked for in their step")
    bidx = bidx + col["micro_batch"].astype(np.int64)
    perm = np.argsort(bidx, kind="stable")  # sequence order within a batch is the rows' order
    row_length = col["length"].astype(np.int64)
    bidx, length = bidx[perm], row_length[perm]
    lane = np.zeros(n_batches, dtype=np.int64)
    lane[bidx] = col["lane"][perm]
    lane_len = np.array([meta.lane_seq_len(k) for k in range(int(lane.max(initial=0)) + 1)], dtype=np.int64)
    seq = lane_len[lane]
    out_at = np.zeros(n_batches + 1, dtype=np.int64)
    np.cumsum(seq, out=out_at[1:])
    # Within a batch: each row's first token position; per batch: real tokens.
    incl = np.cumsum(length)
    excl = incl - length
    per_batch = np.bincount(bidx, weights=length, minlength=n_batches).astype(np.int64)
    batch_excl = np.zeros(n_batches + 1, dtype=np.int64)
    np.cumsum(per_batch, out=batch_excl[1:])
    pos_in_batch = excl - batch_excl[bidx]
    over = np.flatnonzero(per_batch > seq)
    if len(over):
        raise ExecutionError(
            f"packing: segments total {int(per_batch[over[0]])} tokens, more than the sequence length "
            f"{int(seq[over[0]])}; the plan is inconsistent with its seq_len, re-plan with `loom plan SPEC`"
        )
    rows_per = np.bincount(bidx, minlength=n_batches)
    seg_at = np.zeros(n_batches + 1, dtype=np.int64)  # each batch's first row (rows in batch order)
    np.cumsum(rows_per, out=seg_at[1:])
    size = int(out_at[-1])
    seg_start = out_at[:-1][bidx] + pos_in_batch  # each row's first token in the block (rows in batch order)
    # Each batch's rows, then its padding: the block's pieces in order (`_pieces`), each array joined from views.
    slot, pad_slot, pad = _pieces(bidx, seg_at, per_batch, seq)
    top = int(lane_len.max(initial=0))
    input_ids = _input_ids(rules, joined, row_length, perm, seg_start, (slot, pad_slot, pad), top, size)
    cu_at = np.zeros(n_batches + 1, dtype=np.int64)
    np.cumsum(rows_per + 1, out=cu_at[1:])
    cu = np.zeros(int(cu_at[-1]), dtype=np.int32)
    cu[cu_at[bidx] + (np.arange(len(bidx)) - seg_at[bidx]) + 1] = pos_in_batch + length
    seg = np.empty(len(bidx), dtype=SEGMENT_DTYPE)
    for c in ("source", "sample", "offset", "length"):
        seg[c] = getattr(rows, c)[perm]
    steps = np.array([work[i][0] for _, i in pairs], dtype=np.int64)
    scalars = np.zeros((n_batches, 7), dtype=np.int64)  # BLOCK_SCALARS: step, dp_rank, micro_batch, lane, 0, 1, 0
    scalars[:, 0] = np.repeat(steps, mbs)
    scalars[:, 1] = np.repeat(np.array([r for r, _ in pairs], dtype=np.int64), mbs)
    scalars[:, 2] = np.tile(np.arange(mbs), len(pairs))
    scalars[:, 3] = lane
    scalars[:, 5] = 1
    arrays = {"input_ids": input_ids, "cu_seqlens": cu, "segments": seg, "image_positions": np.zeros(0, dtype=np.int32)}
    bounds = {"input_ids": out_at, "cu_seqlens": cu_at, "segments": seg_at}
    bounds["image_positions"] = np.zeros(n_batches + 1, dtype=np.int64)
    block = BatchBlock(
        steps=np.full(len(pairs), mbs, dtype=np.int64),
        scalars=scalars,
        arrays=arrays,
        bounds=bounds,
        images=[],
        image_bounds=np.zeros(n_batches + 1, dtype=np.int64),
    )
    return block, first


def _pieces(bidx: np.ndarray, seg_at: np.ndarray, per_batch: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, ...]:
    """The block as pieces in order, every batch's rows (block order) then its padding: each row's piece (`slot`),
    each batch's padding piece (`pad_slot`) and the padding's length (`pad`)."""
    slot = np.arange(len(bidx), dtype=np.int64) + bidx  # the paddings of the batches before a row's come before it
    pad_slot = seg_at[1:] + np.arange(len(per_batch), dtype=np.int64)
    return slot, pad_slot, seq - per_batch


def _input_ids(
    rules: PackRules,
    joined: Answers,
    row_length: np.ndarray,
    perm: np.ndarray,
    seg_start: np.ndarray,
    pieces: tuple[np.ndarray, ...],
    top: int,
    size: int,
) -> np.ndarray:
    """The block's `input_ids`: the answers' rows and each batch's padding as views joined in block order (one
    `concatenate`: tokens copied once, padding written with them, no Python step per row or batch).

    `joined`: the answers, row indices into the steps' rows end to end; `row_length`: every row's length (in that
    order); `perm`: the rows in block order, `seg_start` their first token in the block; `pieces`: `_pieces`; `top`:
    the longest lane.
    """
    answered = [np.asarray(sel, dtype=np.int64) for sel in joined[0]]
    answer_tokens = [ans.tokens for ans in joined[1]]
    n = len(row_length)
    at = np.concatenate(answered) if answered else np.zeros(0, dtype=np.int64)
    at_length = row_length[at]
    count = np.array([len(a) for a in answered], dtype=np.int64)
    answer_at = np.zeros(len(answered) + 1, dtype=np.int64)  # each answer's first row in `at`
    np.cumsum(count, out=answer_at[1:])
    before = np.zeros(len(at) + 1, dtype=np.int64)  # tokens of the rows before each in `at`
    np.cumsum(at_length, out=before[1:])
    got = np.array([len(t) for t in answer_tokens], dtype=np.int64)
    asked = before[answer_at[1:]] - before[answer_at[:-1]]  # tokens each answer must hold
    if not np.array_equal(asked, got):
        k = int(np.flatnonzero(asked != got)[0])
        raise ExecutionError(f"packing: a loader answered {int(got[k])} tokens for segments totalling {int(asked[k])}")
    if len(at) != n or not bool((np.bincount(at, minlength=n) == 1).all()):  # a row no answer covers: padding
        ids = np.full(size, rules.pad_token_id, dtype=np.int32)
        if len(at):
            dest = np.empty(n, dtype=np.int64)
            dest[perm] = seg_start
            place_tokens(ids, np.concatenate(answer_tokens), dest[at], at_length)
        return ids
    slot, pad_slot, pad = pieces
    of = np.empty(n, dtype=np.int64)  # per row: its answer, and its first token there
    first = np.empty(n, dtype=np.int64)
    of[at] = np.repeat(np.arange(len(answered), dtype=np.int64), count)
    first[at] = before[:-1] - np.repeat(before[answer_at[:-1]], count)
    src = np.empty(len(slot) + len(pad_slot), dtype=np.int64)
    lo = np.zeros(len(src), dtype=np.int64)
    hi = np.empty(len(src), dtype=np.int64)
    src[slot], src[pad_slot] = of[perm], len(answer_tokens)
    lo[slot] = first[perm]
    hi[slot], hi[pad_slot] = lo[slot] + row_length[perm], pad
    return _join([*answer_tokens, np.full(top, rules.pad_token_id, dtype=np.int32)], src, lo, hi, size)


_cut: Callable[[np.ndarray, slice], np.ndarray] = operator.getitem  # type: ignore[assignment]
"""`a[s]`, typed for a C-level `map` over many arrays and slices."""


def _join(sources: list[np.ndarray], src: np.ndarray, lo: np.ndarray, hi: np.ndarray, size: int) -> np.ndarray:
    """`sources[src[k]][lo[k]:hi[k]]` for every k, end to end, in one new int32 array of `size` (views made by a
    C-level `map`, copied by one `concatenate`).

    Empty pieces (a full batch's padding) are dropped and pieces that continue the one before in the same source
    (neighbouring rows of one answer) merged first: a view costs ~1 us whatever its length, one a document.
    """
    out = np.empty(size, dtype=np.int32)
    src, lo, hi = _runs(src, lo, hi)
    if not len(src) and size:
        raise ExecutionError(f"a packed group of {size} tokens was given only empty pieces (a packing bug)")
    if len(src):
        views = map(_cut, map(sources.__getitem__, src.tolist()), map(slice, lo.tolist(), hi.tolist()))
        np.concatenate(list(views), out=out)
    return out


def _runs(src: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same pieces (`_join`'s) as fewer: empty ones dropped, each run continuing in one source merged."""
    keep = hi > lo
    if not keep.all():
        src, lo, hi = src[keep], lo[keep], hi[keep]
    if len(src) < 2:
        return src, lo, hi
    start = np.empty(len(src), dtype=bool)  # a piece that does not continue the one before starts a run
    start[0] = True
    np.not_equal(src[1:], src[:-1], out=start[1:])
    start[1:] |= lo[1:] != hi[:-1]
    if start.all():
        return src, lo, hi
    first = np.flatnonzero(start)
    last = np.append(first[1:], len(src)) - 1
    return src[first], lo[first], hi[last]


_RUN_COPIES = 16  # runs an answer is placed by, a slice copy each, before one index array pays (+1 per 128 tokens)


def place_tokens(out: np.ndarray, tokens: np.ndarray, dest: np.ndarray, lengths: np.ndarray) -> None:
    """Write a loader's answer (`tokens`: its rows' tokens end to end) into `out`: row k at `dest[k]`, `lengths[k]`.

    Rows that lie end to end in `out` too (a run: neighbours of one micro-batch) move with one slice copy; an answer
    cut into more runs than `_RUN_COPIES` (+1 per 128 tokens) goes through one index array instead (by index arrays
    every token costs ~10x a slice copy's, by slices every run a Python step).
    """
    total = int(lengths.sum())
    if len(tokens) != total:
        raise ExecutionError(f"packing: a loader answered {len(tokens)} tokens for segments totalling {total}")
    if total == 0:
        return
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)  # each row's first token in `tokens`
    np.cumsum(lengths, out=starts[1:])
    breaks = np.flatnonzero(dest[1:] != dest[:-1] + lengths[:-1]) + 1
    if len(breaks) >= _RUN_COPIES + total // 128:
        out[np.repeat(dest - starts[:-1], lengths) + np.arange(total, dtype=np.int64)] = tokens
        return
    firsts = [0, *breaks.tolist()]
    cuts = starts[[*firsts, len(dest)]].tolist()
    for d, lo, hi in zip(dest[firsts].tolist(), cuts[:-1], cuts[1:], strict=True):
        out[d : d + hi - lo] = tokens[lo:hi]


def block_of(packs: Sequence[StepPack]) -> BatchBlock:
    """The `BatchBlock` of consecutive steps' packs: slices of their blocks (a copy only across blocks)."""
    if any(p.block is None for p in packs):  # shards, images, on-demand builds: the batches themselves
        return BatchBlock.of([p.batches for p in packs])
    pieces: list[tuple[BatchBlock, int, int]] = []  # runs of adjacent batches of one block
    for p in packs:
        assert p.block is not None
        if pieces and pieces[-1][0] is p.block and pieces[-1][2] == p.first:
            pieces[-1] = (p.block, pieces[-1][1], p.stop)
        else:
            pieces.append((p.block, p.first, p.stop))
    arrays, bounds = {}, {}
    thin = pieces[0][0].thin
    if any(blk.thin != thin for blk, _, _ in pieces):  # pragma: no cover - every group block is thin
        raise ExecutionError("packing: a take joins thin and full blocks")
    for name in BLOCK_ARRAYS:
        if thin and name in DERIVED_ARRAYS:
            continue
        parts, cuts, base = [], [np.zeros(1, dtype=np.int64)], 0
        for blk, a, b in pieces:
            lo, hi = int(blk.bounds[name][a]), int(blk.bounds[name][b])
            parts.append(blk.arrays[name][lo:hi])
            cuts.append(blk.bounds[name][a + 1 : b + 1] - lo + base)
            base += hi - lo
        arrays[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        bounds[name] = np.concatenate(cuts)
    scalars = [blk.scalars[a:b] for blk, a, b in pieces]
    n = sum(len(s) for s in scalars)
    return BatchBlock(
        steps=np.array([len(p) for p in packs], dtype=np.int64),
        scalars=scalars[0] if len(scalars) == 1 else np.concatenate(scalars),
        arrays=arrays,
        bounds=bounds,
        images=[],
        image_bounds=np.zeros(n + 1, dtype=np.int64),
    )
