"""Compiled expansion of a source's permutation into its stream (planning._mixture.build_stream).

One pass over an epoch's permuted documents writes each segment's document, the pieces of split documents (where
they start, their offsets and lengths) and the running token counts (all, short-lane, long-lane segments). A
chunk's random reads of the documents' lengths run first, in a loop of their own (many in flight at once; behind
the branches on them a mispredicted branch would discard the loads in flight). The NumPy code it replaces made ~15
passes over every 64K-document chunk (a gather, repeats for the split ones, three cumulative sums); the arithmetic
is the same, so the stream is the same bytes.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["chunk_counts", "expand_stream", "split_sizes"]


@njit
def _pieces(dl: np.int64, seq_len: np.int64, long_len: np.int64, threshold: np.int64) -> tuple[np.int64, np.int64]:
    """(segments, capacity) of a document of dl tokens: split only past seq_len, into pieces of its lane's
    capacity (_packing.expand_units); threshold < 0: no long lane."""
    if dl <= seq_len:
        return np.int64(1), seq_len
    cap = long_len if threshold >= 0 and dl > threshold else seq_len
    return (dl + cap - 1) // cap, cap


@njit
def split_sizes(lengths: np.ndarray, seq_len: int, long_len: int, threshold: int) -> tuple[np.int64, np.int64]:
    """(segments split documents add, pieces of split documents) over every document of `lengths`, in any order."""
    extra = np.int64(0)
    pieces = np.int64(0)
    for i in range(len(lengths)):
        n, _ = _pieces(np.int64(lengths[i]), np.int64(seq_len), np.int64(long_len), np.int64(threshold))
        if n > 1:
            extra += n - 1
            pieces += n
    return extra, pieces


@njit
def expand_stream(
    perm: np.ndarray,
    lengths: np.ndarray,
    perm_lengths: np.ndarray,
    gathered: bool,
    seq_len: int,
    long_len: int,
    threshold: int,
    chunk: int,
    need: float,
    bounded: bool,
    doc: np.ndarray,
    cum: np.ndarray,
    cum_short: np.ndarray,
    cum_long: np.ndarray,
    split_pos: np.ndarray,
    split_off: np.ndarray,
    split_len: np.ndarray,
    at: int,
    n_split: int,
) -> tuple[int, int]:
    """Append `perm`'s documents' segments at stream position `at` (split pieces at `n_split`), a `chunk` of
    documents at a time; with `bounded`, stop after the first chunk whose count reaches `need`. Returns the new
    (at, n_split). `gathered`: perm_lengths[i] is lengths[perm[i]] (the permutation carried them), else they are
    read here. cum_short / cum_long are written where threshold >= 0 (a long lane), else left alone."""
    long_lane = threshold >= 0
    sl, ll, th = np.int64(seq_len), np.int64(long_len), np.int64(threshold)
    c = cum[at]
    cs = cum_short[at] if long_lane else np.int64(0)
    cl = cum_long[at] if long_lane else np.int64(0)
    n = len(perm)
    buf = np.empty(0 if gathered else min(n, chunk), dtype=lengths.dtype)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        if gathered:
            dls = perm_lengths[a:b]
        else:
            for i in range(a, b):  # the random reads first, in a loop of their own: many in flight at once
                buf[i - a] = lengths[perm[i]]
            dls = buf[: b - a]
        for i in range(a, b):
            d = perm[i]
            dl = np.int64(dls[i - a])
            lane = np.int64(1) if long_lane and dl > th else np.int64(0)
            pieces, cap = _pieces(dl, sl, ll, th)
            for k in range(pieces):  # (one piece: the whole document, not recorded as split)
                seg = dl if pieces == 1 else min(cap, dl - k * cap)
                doc[at] = d
                if pieces > 1:
                    split_pos[n_split] = at
                    split_off[n_split] = k * cap
                    split_len[n_split] = seg
                    n_split += 1
                c += seg
                cum[at + 1] = c
                if long_lane:
                    cs += seg * (1 - lane)
                    cl += lane
                    cum_short[at + 1] = cs
                    cum_long[at + 1] = cl
                at += 1
        if bounded and c >= need:
            break
    return at, n_split


@njit
def chunk_counts(perm_lengths: np.ndarray, seq_len: int, long_len: int, threshold: int, chunk: int) -> np.ndarray:
    """Per chunk of `chunk` documents (in permutation order, their lengths): (segments, split pieces, tokens,
    short-lane tokens, long-lane segments), int64 (chunks, 5): where each chunk's expansion starts and what it
    counts to, so chunks can be expanded apart (expand_stream from those starts)."""
    n = len(perm_lengths)
    out = np.zeros(((n + chunk - 1) // chunk, 5), dtype=np.int64)
    sl, ll, th = np.int64(seq_len), np.int64(long_len), np.int64(threshold)
    for i in range(n):
        c = i // chunk
        dl = np.int64(perm_lengths[i])
        pieces, _ = _pieces(dl, sl, ll, th)
        lane = th >= 0 and dl > th
        out[c, 0] += pieces
        if pieces > 1:
            out[c, 1] += pieces
        out[c, 2] += dl
        if lane:
            out[c, 4] += pieces
        else:
            out[c, 3] += dl
    return out
