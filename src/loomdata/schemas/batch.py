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
        if self.thin:
            return self._thin_batches(first, stop)
        arrays, bounds = self.arrays, self.bounds
        cuts = {name: bounds[name][first : stop + 1].tolist() for name in BLOCK_ARRAYS}
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

    def _thin_batches(self, first: int, stop: int) -> list[Batch]:
        """`batches` of a thin block: the range's labels and position ids derived in one call, then sliced per batch.

        What a rank runs for every step it yields, so the per-batch part is plain slicing of precomputed bounds
        (one `tolist` an array, no dict a batch): 3 steps a call cost about half what the generic path did."""
        rows = self.scalars[first:stop].tolist()
        if any(row[_CP_SIZE] != 1 for row in rows):
            raise ValueError("a thin BatchBlock holds whole micro-batches only; a CP shard's labels cannot be derived")
        arrays, bounds = self.arrays, self.bounds
        ib, cb = bounds["input_ids"][first : stop + 1], bounds["cu_seqlens"][first : stop + 1]
        ids, cu = arrays["input_ids"], arrays["cu_seqlens"]
        i0, c0 = int(ib[0]), int(cb[0])
        labels, positions = derive_labels_positions(ids[i0 : int(ib[-1])], ib - i0, cu[c0 : int(cb[-1])], cb - c0)
        idl, cul = ib.tolist(), cb.tolist()
        segl, segs = bounds["segments"][first : stop + 1].tolist(), arrays["segments"]
        ipl, ips = bounds["image_positions"][first : stop + 1].tolist(), arrays["image_positions"]
        img, images = self.image_bounds[first : stop + 1].tolist(), self.images
        # Positional arguments in `Batch`'s field order (a quarter cheaper than keywords: this runs for every batch)
        return [
            Batch(
                step,
                dp_rank,
                micro_batch,
                lane,
                ids[lo:hi],
                labels[lo - i0 : hi - i0],
                positions[lo - i0 : hi - i0],
                cu[cul[i] : cul[i + 1]],
                segs[segl[i] : segl[i + 1]],
                images[img[i] : img[i + 1]],
                ips[ipl[i] : ipl[i + 1]],
                cp_rank,
                cp_size,
                sequence_len,
            )
            for i, (lo, hi, (step, dp_rank, micro_batch, lane, cp_rank, cp_size, sequence_len)) in enumerate(
                zip(idl[:-1], idl[1:], rows, strict=True)
            )
        ]


_CP_SIZE = BLOCK_SCALARS.index("cp_size")


def derive_labels_positions(
    input_ids: np.ndarray, id_bounds: np.ndarray, cu_seqlens: np.ndarray, cu_bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(labels, position_ids) of packed batches laid end to end, as packing defines them.

    Batch i holds `input_ids[id_bounds[i]:id_bounds[i + 1]]` and its `cu_seqlens[cu_bounds[i]:cu_bounds[i + 1]]`
    (offsets within the batch; the last is its real tokens, padding follows). A label is the next token inside
    a segment, IGNORE_INDEX on every segment's last token and on padding; a position counts from 0 in every
    segment and is 0 on padding. Vectorised over the batches: a shifted copy, `arange` less each piece's start
    (a repeat; no cumulative sum), a scatter at the pieces' ends, plus a slice per padded batch. Pieces (segments,
    paddings) may be empty or repeat a start: a repeat of zero and a second IGNORE at the same end change nothing.
    """
    n = len(input_ids)
    labels = np.empty(n, dtype=np.int32)
    if n == 0:
        return labels, np.ones(0, dtype=np.int32)
    labels[:-1] = input_ids[1:]
    labels[-1] = IGNORE_INDEX
    batch_at = id_bounds[:-1]
    per = cu_bounds[1:] - cu_bounds[:-1]
    per_list = per.tolist()
    bare = 0 in per_list  # a batch without cu_seqlens entries (all padding) starts a piece of its own
    starts = cu_seqlens + np.repeat(batch_at, per)  # every segment's start, and every padding's
    if bare:
        starts = np.sort(np.concatenate([batch_at[per == 0], starts]))
    if starts[0] != 0:  # the first piece starts at 0 whatever the first batch's cu_seqlens say
        starts = np.concatenate([np.zeros(1, dtype=starts.dtype), starts])
    lens = np.empty(len(starts), dtype=np.int64)
    np.subtract(starts[1:], starts[:-1], out=lens[:-1])
    lens[-1] = n - starts[-1]
    positions = np.arange(n, dtype=np.int32)
    positions -= np.repeat(starts.astype(np.int32), lens)  # every piece counts 0, 1, ... from its start
    labels[starts[1:] - 1] = IGNORE_INDEX  # every piece's last token (a segment's end; padding is IGNORE anyway)
    if bare:  # each batch's real tokens: its last cu_seqlens entry (a bare batch: none)
        cu_list = cu_seqlens.tolist()
        real = [cu_list[end - 1] if k else 0 for k, end in zip(per_list, cu_bounds[1:].tolist(), strict=True)]
    else:
        real = cu_seqlens[cu_bounds[1:] - 1].tolist()
    for at, hi, k in zip(batch_at.tolist(), id_bounds[1:].tolist(), real, strict=True):
        if at + k < hi:  # the batch's padding
            labels[at + k : hi] = IGNORE_INDEX
            positions[at + k : hi] = 0
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
