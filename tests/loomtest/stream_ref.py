"""planning._mixture.build_stream as it was before its expansion was compiled (session 32): the
chunked NumPy expansion, verbatim, for differential tests of planning._stream_kernel."""

from __future__ import annotations

import numpy as np

from loomdata.planning._mixture import Stream, source_key
from loomdata.planning._packing import Lanes, expand_with_lengths
from loomdata.planning._permute import uniform_permutation
from loomdata.planning._shuffle import BlockLayout


def build_stream_ref(
    name: str,
    seed: int,
    lengths: np.ndarray,
    lanes: Lanes,
    epochs: int,
    blocks: BlockLayout | None = None,
    need: float | None = None,
    chunk: int = 1 << 16,
) -> Stream:
    """The stream the NumPy code built (chunks of `chunk` documents)."""
    idx_dtype = np.uint32 if len(lengths) < 2**32 else np.int64
    nonempty = bool((lengths > 0).all())
    docs = None if nonempty or blocks is not None else np.flatnonzero(lengths > 0).astype(idx_dtype)
    n_docs = len(lengths) if nonempty else int(np.count_nonzero(lengths))
    n_ep = max(epochs, 1)
    per_epoch = n_docs + _extra_segments(lengths, lanes, chunk)
    total = n_ep * per_epoch
    doc = np.empty(total, dtype=idx_dtype)
    cum = np.zeros(total + 1, dtype=np.int64)
    cum_short = np.zeros_like(cum) if lanes.has_long else None
    cum_long = np.zeros_like(cum) if lanes.has_long else None
    split_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    at = 0
    for e in range(n_ep):
        rng = np.random.default_rng([*source_key(seed, name), e])
        if blocks is None:
            perm = uniform_permutation(rng, n_docs, src=docs, dtype=idx_dtype)
        else:
            rows = blocks.permutation(rng)
            perm = (rows if nonempty else rows[lengths[rows] > 0]).astype(idx_dtype)
            del rows
        for a in range(0, len(perm), chunk):
            piece, off, seg, dl = expand_with_lengths(perm[a : a + chunk], lengths, lanes)
            b = at + len(piece)
            doc[at:b] = piece
            if len(piece) != min(chunk, len(perm) - a):
                split = np.flatnonzero((off > 0) | (seg != dl))
                split_parts.append((split + at, off[split], seg[split]))
            np.cumsum(seg, out=cum[at + 1 : b + 1])
            cum[at + 1 : b + 1] += cum[at]
            if cum_short is not None and cum_long is not None:
                lane = lanes.lane_of(dl)
                np.cumsum(np.where(lane == 0, seg, 0), out=cum_short[at + 1 : b + 1])
                cum_short[at + 1 : b + 1] += cum_short[at]
                np.cumsum(lane, out=cum_long[at + 1 : b + 1])
                cum_long[at + 1 : b + 1] += cum_long[at]
            at = b
            if need is not None and cum[at] >= need:
                break
        del perm
        if need is not None and cum[at] >= need:
            break
    if at != total:
        doc, cum = doc[:at], cum[: at + 1]
        cum_short = None if cum_short is None else cum_short[: at + 1]
        cum_long = None if cum_long is None else cum_long[: at + 1]
    empty = np.zeros(0, dtype=np.int64)
    split_pos = np.concatenate([p[0] for p in split_parts]).astype(np.int64) if split_parts else empty
    split_off = (
        np.concatenate([p[1] for p in split_parts]).astype(np.uint32) if split_parts else empty.astype(np.uint32)
    )
    split_len = (
        np.concatenate([p[2] for p in split_parts]).astype(np.uint32) if split_parts else empty.astype(np.uint32)
    )
    return Stream(doc, split_pos, split_off, split_len, cum, cum_short, cum_long, int(lengths.sum(dtype=np.int64)))


def _extra_segments(lengths: np.ndarray, lanes: Lanes, chunk: int) -> int:
    extra = 0
    for a in range(0, len(lengths), chunk):
        dl = lengths[a : a + chunk]
        big = dl[dl > lanes.seq_len]
        if len(big):
            cap = lanes.capacity(lanes.lane_of(big))
            extra += int(((big.astype(np.int64) + cap - 1) // cap - 1).sum())
    return extra
