"""Packing primitives: lanes, splitting documents into segments, and next-fit packing (vectorised).

Lanes. Without `long_context` every document is planned into the short lane (lane 0): sequences of
`training.seq_len`. With `long_context`, a document longer than `threshold` goes to the long lane
(lane 1): sequences of `long_context.seq_len`, each split over `long_context.cp_size` context-parallel
ranks of the dp rank that holds it. The lane is decided per document, never per segment.

Segments. A document longer than its lane's sequence length is split into consecutive segments
(offset, length) of at most that length; nothing is dropped. A sample with image tokens is never split
(a cut could fall inside an image): if it exceeds its lane's capacity, planning stops with a PlanError.

next_fit packs items in order into sequences, starting a new one when the next item does not fit. It
is the baseline's packer (shuffled documents, as a user's loader packs them today) and, on segments
sorted by length, the long lane's (next-fit decreasing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning._segments import DenseIds
from loomdata.schemas.errors import PlanError
from loomdata.schemas.spec import Spec

__all__ = ["Lanes", "expand_units", "next_fit"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Lanes:
    """Sequence capacity and context-parallel size of each lane, and the long-lane threshold."""

    seq_len: int
    short_cp: int = 1
    long_seq_len: int | None = None
    long_cp: int = 1
    threshold: int | None = None

    @classmethod
    def of(cls, spec: Spec) -> Lanes:
        lc = spec.long_context
        if lc is None:
            return cls(seq_len=spec.training.seq_len, short_cp=spec.training.cp_size)
        return cls(
            seq_len=spec.training.seq_len,
            short_cp=spec.training.cp_size,
            long_seq_len=lc.seq_len,
            long_cp=lc.cp_size,
            threshold=lc.threshold,
        )

    @property
    def has_long(self) -> bool:
        return self.long_seq_len is not None

    def lane_of(self, lengths: np.ndarray) -> np.ndarray:
        """Lane (uint8: 0 short, 1 long) of documents of `lengths` tokens."""
        if self.threshold is None:
            return np.zeros(len(lengths), dtype=np.uint8)
        return (lengths > self.threshold).astype(np.uint8)

    def capacity(self, lanes: np.ndarray) -> np.ndarray:
        """Sequence capacity (int64) for each entry of `lanes`."""
        return np.where(lanes == 1, self.long_seq_len or 0, self.seq_len).astype(np.int64)

    def cp(self, lanes: np.ndarray) -> np.ndarray:
        """Context-parallel size (int64) for each entry of `lanes`."""
        return np.where(lanes == 1, self.long_cp, self.short_cp).astype(np.int64)

    def cp_sizes(self, lanes: np.ndarray) -> np.ndarray | int:
        """`cp(lanes)`, or the one size as an int where every lane has it (costs divide by it alike, bit for
        bit, without an array of it)."""
        if not self.has_long or self.long_cp == self.short_cp:
            return self.short_cp
        return self.cp(lanes)


def no_image_tokens(images: np.ndarray) -> bool:
    """Whether `images` is the planner's all-zero column of a text source: a broadcast of one zero (stride 0, as an
    index read keeps a column it found all zero), known without a pass over it (40M samples: ~50 ms a pass)."""
    return images.ndim == 1 and images.strides == (0,) and (len(images) == 0 or int(images[0]) == 0)


def has_image_tokens(images: np.ndarray) -> bool:
    """Whether any sample of `images` has image tokens (no pass over a text source's all-zero broadcast)."""
    return not no_image_tokens(images) and bool(images.any())


def check_unsplittable(
    source: str, samples: np.ndarray | DenseIds, lengths: np.ndarray, images: np.ndarray, lanes: Lanes
) -> None:
    """Raise PlanError when a sample with images exceeds its lane's capacity (it cannot be split)."""
    if no_image_tokens(images):
        return
    with_images = np.flatnonzero(images > 0)  # only these can fail: no per-sample 8-byte capacity array
    lane = lanes.lane_of(lengths[with_images])
    bad = with_images[lengths[with_images] > lanes.capacity(lane)]
    if len(bad):
        i = int(bad[0])
        lane = lanes.lane_of(lengths[i : i + 1])
        raise PlanError(
            f"source {source!r}, sample {int(samples[i])}: {int(lengths[i])} tokens with "
            f"{int(images[i])} image tokens exceed the lane capacity {int(lanes.capacity(lane)[0])} "
            f"and a sample with images cannot be split ({len(bad)} such sample(s)); no budget can hold it: "
            "raise training.seq_len or set long_context with a larger seq_len"
        )


def expand_units(docs: np.ndarray, lengths: np.ndarray, lanes: Lanes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments of `docs` (in that order): (doc, offset, length); long documents become consecutive segments.

    Only the documents that need splitting are expanded; the common case (nothing to split) allocates
    just the output columns (4 bytes each per document).
    """
    doc, offset, length, _ = expand_with_lengths(docs, lengths, lanes)
    return doc, offset, length


def expand_with_lengths(
    docs: np.ndarray, lengths: np.ndarray, lanes: Lanes
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """expand_units, and each segment's document length (`lengths` of its doc, its dtype), from the one gather of
    the documents' lengths (a stream's caller reads them at random: one read less a document)."""
    dl = lengths[docs]
    split = np.flatnonzero(dl > lanes.seq_len)
    if len(split):
        cap_s = lanes.capacity(lanes.lane_of(dl[split]))
        n_s = (dl[split].astype(np.int64) + cap_s - 1) // cap_s
        keep = n_s > 1
        split, cap_s, n_s = split[keep], cap_s[keep], n_s[keep]
    if len(split) == 0:
        return docs, np.zeros(len(docs), dtype=np.uint32), dl.astype(np.uint32, copy=False), dl
    counts: np.ndarray = np.ones(len(docs), dtype=np.uint32 if len(docs) + int(n_s.sum()) < 2**32 else np.int64)
    counts[split] = n_s
    doc = np.repeat(docs, counts)
    doc_len = np.repeat(dl, counts)
    length = doc_len.astype(np.uint32, copy=True)
    del counts
    offset = np.zeros(len(doc), dtype=np.uint32)
    first = split + np.concatenate([[0], np.cumsum(n_s - 1)[:-1]])  # output position of each split doc
    pos = np.repeat(first, n_s) + (np.arange(int(n_s.sum())) - np.repeat(np.cumsum(n_s) - n_s, n_s))
    off = (pos - np.repeat(first, n_s)) * np.repeat(cap_s, n_s)
    offset[pos] = off
    length[pos] = np.minimum(np.repeat(cap_s, n_s), np.repeat(dl[split].astype(np.int64), n_s) - off)
    return doc, offset, length, doc_len


def next_fit(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Sequence id of each item packed next-fit in the given order (no item exceeds `cap`); vectorised.

    A sequence starting at item i ends before the first item that would overflow it:
    nxt[i] = searchsorted(cum, cum[i] + cap). The sequence starts are the orbit of 0 under nxt,
    found by pointer doubling in O(n log n) NumPy work instead of a per-item loop.
    """
    n = len(lengths)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cum = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=cum[1:])
    jump = np.empty(n + 1, dtype=np.int64)
    jump[:n] = np.searchsorted(cum, cum[:-1] + cap, side="right") - 1
    jump[n] = n
    jump[:n] = np.maximum(jump[:n], np.arange(1, n + 1))  # progress even if an item exceeds cap
    orbit = np.zeros(1, dtype=np.int64)
    while jump[0] < n:
        orbit = np.concatenate([orbit, jump[orbit]])
        jump = jump[jump]
    seen = np.zeros(n, dtype=bool)  # the orbit's distinct starts, ascending (np.unique, without its hashing)
    seen[orbit[orbit < n]] = True
    starts = np.flatnonzero(seen)
    return np.searchsorted(starts, np.arange(n), side="right") - 1
