"""What a rank receives for one micro-batch: NumPy arrays, wrapped without copying by the torch adapter.

A context-parallel (CP) peer may receive only its shard of a micro-batch (`Batch.positions` names the
positions it holds, in the layout of `schemas.context_parallel`); `reassemble_cp` puts the shards of
all `cp_size` peers back into the whole micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from loomdata.schemas.context_parallel import cp_positions

__all__ = [
    "DERIVED_ARRAYS",
    "IGNORE_INDEX",
    "SEGMENT_DTYPE",
    "Batch",
    "BatchBlock",
    "derive_labels_positions",
    "reassemble_cp",
]

IGNORE_INDEX = -100
"""Label value across document boundaries and padding (ignored by cross-entropy)."""

SEGMENT_DTYPE = np.dtype([("source", np.uint16), ("sample", np.uint64), ("offset", np.uint32), ("length", np.uint32)])
"""Provenance of each document segment in a batch, in sequence order."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One packed micro-batch for one data-parallel rank, or one CP rank's shard of it.

    `input_ids`, `labels` and `position_ids` have the lane's sequence length (a shard: the length of
    the positions it holds); `cu_seqlens` has one entry more than there are documents (the last entry
    is the number of real tokens; padding follows). `images` holds decoded image arrays (HWC uint8)
    of multimodal samples, in sequence order, and `image_positions` the index of each image's first
    placeholder token in the sequence.

    A shard (cp_size > 1; `positions` not None) holds the sequence positions `positions` (int32, ascending: CP
    rank `cp_rank` of `cp_size` holds chunks cp_rank and 2*cp_size-1-cp_rank of 2*cp_size); its
    `input_ids[k]`, `labels[k]`, `position_ids[k]` are those of sequence position `positions[k]`.
    `cu_seqlens`, `segments` and `image_positions` stay in whole-sequence coordinates (ring attention
    needs every document boundary); `images` are those whose placeholder tokens it holds any of.
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
    cp_rank: int = 0
    """This batch's CP rank (0 for a whole micro-batch)."""
    cp_size: int = 1
    """How many CP shards the micro-batch was cut into (1: this is the whole micro-batch)."""
    sequence_len: int = 0
    """A shard: the whole sequence's length (its positions follow from it, so they never cross the wire)."""

    @property
    def positions(self) -> np.ndarray | None:
        """Sequence positions held (int32, ascending), None for a whole micro-batch."""
        if self.cp_size == 1:
            return None
        return cp_positions(self.sequence_len, self.cp_size, self.cp_rank).astype(np.int32)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch (in a shard: the real tokens it holds)."""
        real = int(self.cu_seqlens[-1]) if len(self.cu_seqlens) else 0
        pos = self.positions
        return real if pos is None else int(np.count_nonzero(pos < real))

    @property
    def is_shard(self) -> bool:
        """Whether this is one CP rank's shard of a micro-batch (not the whole of it)."""
        return self.cp_size > 1

    def held_positions(self) -> np.ndarray:
        """Sequence positions (int32) of this batch's entries: `positions`, or 0..len-1 for a whole batch."""
        pos = self.positions
        return np.arange(len(self.input_ids), dtype=np.int32) if pos is None else pos

    def segment_ids(self) -> np.ndarray:
        """Per entry, the index (int32) of its document in `segments` / `cu_seqlens`; -1 for padding."""
        pos = self.held_positions()
        cu = self.cu_seqlens
        if len(cu) < 2:
            return np.full(len(pos), -1, dtype=np.int32)
        ids = np.searchsorted(cu, pos, side="right").astype(np.int32) - 1
        ids[pos >= cu[-1]] = -1
        return ids


def reassemble_cp(shards: Sequence[Batch]) -> Batch:
    """The whole micro-batch from the shards of all its CP ranks (any order); raises ValueError if they do not fit.

    A whole batch (cp_size 1) is returned as it is.
    """
    if not shards:
        raise ValueError("reassemble_cp: no shards given")
    first = shards[0]
    key = (first.step, first.dp_rank, first.micro_batch, first.lane, first.cp_size)
    for s in shards:
        if (s.step, s.dp_rank, s.micro_batch, s.lane, s.cp_size) != key:
            raise ValueError(
                f"reassemble_cp: shards of different micro-batches: (step, dp_rank, micro_batch, lane, cp_size) "
                f"{key} and {(s.step, s.dp_rank, s.micro_batch, s.lane, s.cp_size)}"
            )
    if first.cp_size == 1 and len(shards) == 1:
        return first
    ranks = sorted(s.cp_rank for s in shards)
    if ranks != list(range(first.cp_size)) or len({s.sequence_len for s in shards}) != 1:
        raise ValueError(f"reassemble_cp: need one shard of each CP rank 0..{first.cp_size - 1}, got ranks {ranks}")
    for s in shards[1:]:
        if not (np.array_equal(s.cu_seqlens, first.cu_seqlens) and np.array_equal(s.segments, first.segments)):
            raise ValueError("reassemble_cp: shards disagree on the sequence's documents (cu_seqlens / segments)")
    pos = np.concatenate([s.held_positions() for s in shards]).astype(np.int64)
    n = len(pos)
    if not np.array_equal(np.bincount(pos, minlength=n), np.ones(n, dtype=np.int64)):
        raise ValueError(f"reassemble_cp: the shards' positions do not cover 0..{n - 1} exactly once")

    def whole(name: str) -> np.ndarray:
        parts = [getattr(s, name) for s in shards]
        out = np.empty(n, dtype=parts[0].dtype)
        out[pos] = np.concatenate(parts)
        return out

    img_pos = np.concatenate([s.image_positions for s in shards]).astype(np.int64)
    imgs = [im for s in shards for im in s.images]
    uniq, pick = np.unique(img_pos, return_index=True)  # an image a chunk boundary cuts is in two shards
    return Batch(
        step=first.step,
        dp_rank=first.dp_rank,
        micro_batch=first.micro_batch,
        lane=first.lane,
        input_ids=whole("input_ids"),
        labels=whole("labels"),
        position_ids=whole("position_ids"),
        cu_seqlens=first.cu_seqlens,
        segments=first.segments,
        images=[imgs[k] for k in pick.tolist()],
        image_positions=uniq.astype(np.int32),
    )


BLOCK_ARRAYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "segments", "image_positions")
BLOCK_SCALARS = ("step", "dp_rank", "micro_batch", "lane", "cp_rank", "cp_size", "sequence_len")
DERIVED_ARRAYS = ("labels", "position_ids")
"""What a text block of whole micro-batches may leave out (`BatchBlock.thin`): both follow from `input_ids` and
`cu_seqlens` (`derive_labels_positions`), so they need not cross the wire: a third of the bytes a rank receives."""


@dataclass(frozen=True, slots=True)
class BatchBlock:
    """Several consecutive steps' micro-batches laid end to end in a few arrays: what one take moves.

    Sent as a list of `Batch`es, every batch costs its own pickled object and six transport frames
    (and a socket write each); a block is one object of about a dozen arrays whatever the number of
    steps. `unpack` gives the same batches back (views into the block's arrays, no copy; a thin block's labels and
    position ids are built anew, `thin`).
    `steps[k]` is how many batches step k has; `scalars[i]` is batch i's `BLOCK_SCALARS`;
    `bounds[name][i]:bounds[name][i + 1]` is batch i's part of array `name`.

    A thin block (`thin`: text, whole micro-batches, as the constructor packs them) has no `DERIVED_ARRAYS`:
    `batches` builds labels and position ids from `input_ids` and `cu_seqlens` where they are used (on the
    rank), so the constructor neither writes nor sends them (12 bytes a token on the wire become 4).
    """

    steps: np.ndarray
    scalars: np.ndarray
    arrays: dict[str, np.ndarray]
    bounds: dict[str, np.ndarray]
    images: list[np.ndarray]
    image_bounds: np.ndarray

    @classmethod
    def of(cls, steps: Sequence[Sequence[Batch]]) -> BatchBlock:
        """The block of `steps` (each one step's batches, in order)."""
        flat = [b for step in steps for b in step]
        arrays: dict[str, np.ndarray] = {}
        bounds: dict[str, np.ndarray] = {}
        for name in BLOCK_ARRAYS:
            parts = [getattr(b, name) for b in flat]
            bounds[name] = _bounds([len(p) for p in parts])
            arrays[name] = _concat(parts)
        return cls(
            steps=np.array([len(s) for s in steps], dtype=np.int64),
            scalars=np.array([[getattr(b, f) for f in BLOCK_SCALARS] for b in flat], dtype=np.int64).reshape(
                len(flat), len(BLOCK_SCALARS)
            ),
            arrays=arrays,
            bounds=bounds,
            images=[im for b in flat for im in b.images],
            image_bounds=_bounds([len(b.images) for b in flat]),
        )

    @property
    def thin(self) -> bool:
        """Whether labels and position ids are left out (`DERIVED_ARRAYS`), to be derived by `batches`."""
        return "labels" not in self.arrays

    def unpack(self) -> list[list[Batch]]:
        """The steps' batches again (views into this block's arrays; a thin block's derived arrays are new)."""
        out = self.batches(0, len(self.scalars))
        per = np.concatenate([[0], np.cumsum(self.steps)]).tolist()
        return [out[per[k] : per[k + 1]] for k in range(len(self.steps))]

    def batches(self, first: int, stop: int) -> list[Batch]:
        """Batches `first..stop-1` of the block (in step order; views into this block's arrays, a thin block's derived
        arrays new)."""
        arrays, bounds, at = self.arrays, self.bounds, first
        if self.thin:  # the range's arrays alone, derived ones built: their bounds count from 0
            arrays, bounds, at = *self._derived(first, stop), 0
        cuts = {name: bounds[name][at : at + stop - first + 1].tolist() for name in BLOCK_ARRAYS}
        img = self.image_bounds[first : stop + 1].tolist()
        out: list[Batch] = []
        for i, (step, dp_rank, micro_batch, lane, cp_rank, cp_size, sequence_len) in enumerate(
            self.scalars[first:stop].tolist()
        ):
            part = {name: arrays[name][cuts[name][i] : cuts[name][i + 1]] for name in BLOCK_ARRAYS}
            out.append(
                Batch(
                    step=step,
                    dp_rank=dp_rank,
                    micro_batch=micro_batch,
                    lane=lane,
                    input_ids=part["input_ids"],
                    labels=part["labels"],
                    position_ids=part["position_ids"],
                    cu_seqlens=part["cu_seqlens"],
                    segments=part["segments"],
                    images=self.images[img[i] : img[i + 1]],
                    image_positions=part["image_positions"],
                    cp_rank=cp_rank,
                    cp_size=cp_size,
                    sequence_len=sequence_len,
                )
            )
        return out

    def _derived(self, first: int, stop: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Arrays and bounds of batches `first..stop-1` alone (bounds from 0), with the derived arrays built."""
        if np.any(self.scalars[first:stop, BLOCK_SCALARS.index("cp_size")] != 1):
            raise ValueError("a thin BatchBlock holds whole micro-batches only; a CP shard's labels cannot be derived")
        arrays, bounds = {}, {}
        for name in BLOCK_ARRAYS:
            if name in DERIVED_ARRAYS:
                continue
            b = self.bounds[name][first : stop + 1]
            arrays[name] = self.arrays[name][int(b[0]) : int(b[-1])]
            bounds[name] = b - b[0]
        arrays["labels"], arrays["position_ids"] = derive_labels_positions(
            arrays["input_ids"], bounds["input_ids"], arrays["cu_seqlens"], bounds["cu_seqlens"]
        )
        bounds["labels"] = bounds["position_ids"] = bounds["input_ids"]
        return arrays, bounds


def derive_labels_positions(
    input_ids: np.ndarray, id_bounds: np.ndarray, cu_seqlens: np.ndarray, cu_bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(labels, position_ids) of packed batches laid end to end, as packing defines them.

    Batch i holds `input_ids[id_bounds[i]:id_bounds[i + 1]]` and its `cu_seqlens[cu_bounds[i]:cu_bounds[i + 1]]`
    (offsets within the batch; the last is its real tokens, padding follows). A label is the next token inside
    a segment, IGNORE_INDEX on every segment's last token and on padding; a position counts from 0 in every
    segment and is 0 on padding. Vectorised over the batches: a shifted copy, one cumulative sum and a scatter
    at the pieces' starts, plus a slice per padded batch.
    """
    n = len(input_ids)
    labels = np.empty(n, dtype=np.int32)
    positions = np.ones(n, dtype=np.int32)
    if n == 0:
        return labels, positions
    labels[:-1] = input_ids[1:]
    labels[-1] = IGNORE_INDEX
    n_batches = len(id_bounds) - 1
    per = np.diff(cu_bounds)
    at = cu_seqlens.astype(np.int64) + np.repeat(id_bounds[:-1], per)  # every segment's start, and padding's
    bare = per == 0  # a batch without cu_seqlens entries (all padding) starts a piece too; the others' cu[0] does
    starts = np.concatenate([id_bounds[:-1][bare], at]) if bare.any() else at
    if bare.any():
        starts.sort()
    starts = starts[starts < n]
    starts = starts[np.concatenate([[True], starts[1:] != starts[:-1]])]  # not np.unique: it imports numpy.ma (8 ms)
    # Pieces (segments, paddings) end to end: every piece counts 0, 1, ... from its start.
    positions[0] = 0
    positions[starts[1:]] = 1 - np.diff(starts).astype(np.int32)
    np.cumsum(positions, dtype=np.int32, out=positions)
    labels[starts[1:] - 1] = IGNORE_INDEX  # every piece's last token (a segment's end; padding is IGNORE anyway)
    last = np.zeros(n_batches, dtype=np.int64)  # each batch's real tokens
    has = per > 0
    last[has] = cu_seqlens[cu_bounds[1:][has] - 1]
    pad_from = id_bounds[:-1] + last
    for lo, hi in zip(pad_from.tolist(), id_bounds[1:].tolist(), strict=True):
        if lo < hi:
            labels[lo:hi] = IGNORE_INDEX
            positions[lo:hi] = 0
    return labels, positions


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    """`np.concatenate`; structured arrays (segments) as raw records (numpy promotes their fields: ~5 us a part)."""
    if not parts:
        return np.zeros(0, dtype=np.int32)
    dtype = parts[0].dtype
    if dtype.names is None or any(p.dtype != dtype for p in parts):
        return np.concatenate(parts)
    raw = np.dtype((np.void, dtype.itemsize))
    return np.concatenate([p.view(raw) for p in parts]).view(dtype)


def _bounds(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out
