"""Compiled gathering of a look-ahead block's segments, all sources in one call (_items.StepItems._assigned).

With many sources and small dp a block draws a few hundred segments a source, and the per-source calls (a
search of the assignment, the compiled segment gather, the sample ids, the concatenation, then a stable sort
of the whole block by step) cost more than the gathering: 300 sources at dp 4, 10M samples, 11,700 such
calls were ~0.9 CPU-s. Here one call walks every source's assigned positions and writes each segment straight
to its step-major place (step, then source, then the assignment's order), the layout the sort gave.

The sources' columns are separate arrays of one dtype each; numba takes a list of them only as a typed
List, whose first use costs a process 0.2-0.4 s of compiling. So the kernel takes each column's data
addresses (an int64 table, source by source) and views them (`_view`); the caller holds the arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from loomdata.planning._jit import njit

__all__ = ["DOC", "IDS", "IMAGES", "POS", "SPLIT_LEN", "SPLIT_OFF", "SPLIT_POS", "STEP", "TOKENS", "gather_assigned"]

POS, STEP, DOC, TOKENS, SPLIT_POS, SPLIT_OFF, SPLIT_LEN, IDS, IMAGES = range(9)
"""Columns of the address table: the assignment's positions and steps, the stream's documents, the index's
token counts, the split pieces' positions, offsets and lengths, stored sample ids (or rows), image tokens."""


@intrinsic
def _void_ptr(typingctx: Any, addr: Any) -> Any:
    """The memory address `addr` (an integer) as a void pointer (numba's documented recipe for carray)."""
    sig = types.voidptr(addr)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@njit
def _view(addr: int, n: int, like: np.ndarray) -> np.ndarray:
    """The n values of `like`'s dtype at `addr` (a C-contiguous array the caller keeps alive)."""
    return carray(_void_ptr(addr), n, like.dtype)  # type: ignore[call-arg]


@njit
def gather_assigned(
    addr: np.ndarray,
    size: np.ndarray,
    like_pos: np.ndarray,
    like_step: np.ndarray,
    like_doc: np.ndarray,
    like_tok: np.ndarray,
    like_split_pos: np.ndarray,
    like_split_off: np.ndarray,
    like_split_len: np.ndarray,
    like_ids: np.ndarray,
    like_img: np.ndarray,
    id_mode: np.ndarray,
    has_img: np.ndarray,
    t0: int,
    t1: int,
    threshold: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(source id, sample, offset, length, lane, image tokens, step starts) of the segments every source is
    assigned in steps t0..t1-1, step-major (within a step source order, then the assignment's order).
    `addr`/`size`: (sources, 9) data addresses and lengths of the columns (POS..IMAGES; `like_*` an array of
    each column's dtype). `id_mode[k]`: 0 dense ids (the document row), 1 stored (the IDS column at the row).
    `has_img[k]`: 0 no images (zeros), 1 the IMAGES column where a segment is its whole document.
    A document longer than `threshold` is in the long lane (threshold < 0: none). Values and types are those
    of _lookahead_kernel.segments_of and _items.StepItems._image_tokens, source by source."""
    n_src = addr.shape[0]
    n_steps = t1 - t0
    lo = np.empty(n_src, dtype=np.int64)
    hi = np.empty(n_src, dtype=np.int64)
    bounds = np.zeros(n_steps + 1, dtype=np.int64)
    for k in range(n_src):
        step = _view(addr[k, STEP], size[k, STEP], like_step)
        a = np.searchsorted(step, t0)
        b = np.searchsorted(step, t1)
        lo[k], hi[k] = a, b
        for i in range(a, b):
            bounds[step[i] - t0 + 1] += 1
    for t in range(n_steps):
        bounds[t + 1] += bounds[t]
    total = bounds[n_steps]
    src_id = np.empty(total, dtype=np.uint16)
    sample = np.empty(total, dtype=np.uint64)
    offset = np.zeros(total, dtype=np.uint32)
    length = np.empty(total, dtype=np.int64)
    lane = np.zeros(total, dtype=np.uint8)
    img = np.zeros(total, dtype=like_img.dtype)
    # each source in turn, its segments written straight to their places (a step's start plus the segments of
    # the step written before): measured faster than gathering source-major and then reordering (a counting sort
    # and a gather), and than walking steps and sources step-major (300 sources, dp 4, 10M samples)
    cursor = bounds[:n_steps].copy()
    for k in range(n_src):
        a, b = lo[k], hi[k]
        if b <= a:
            continue
        pos = _view(addr[k, POS], size[k, POS], like_pos)
        step = _view(addr[k, STEP], size[k, STEP], like_step)
        doc_col = _view(addr[k, DOC], size[k, DOC], like_doc)
        tok = _view(addr[k, TOKENS], size[k, TOKENS], like_tok)
        split_pos = _view(addr[k, SPLIT_POS], size[k, SPLIT_POS], like_split_pos)
        split_off = _view(addr[k, SPLIT_OFF], size[k, SPLIT_OFF], like_split_off)
        split_len = _view(addr[k, SPLIT_LEN], size[k, SPLIT_LEN], like_split_len)
        ids = _view(addr[k, IDS], size[k, IDS], like_ids)
        images = _view(addr[k, IMAGES], size[k, IMAGES], like_img)
        stored, imaged = id_mode[k] == 1, has_img[k] == 1
        n_split = len(split_pos)
        last_p, last_i = np.int64(-1), 0  # as segments_of: increasing positions gallop on from the previous search
        for i in range(a, b):
            r = step[i] - t0
            j = cursor[r]
            cursor[r] = j + 1
            p = np.int64(pos[i])
            d = doc_col[p]
            src_id[j] = k
            sample[j] = np.uint64(ids[d]) if stored else np.uint64(d)
            dl = tok[d]
            seg_len = np.uint32(dl)
            if threshold >= 0 and dl > threshold:
                lane[j] = 1
            if n_split:
                s_lo, s_hi = 0, last_i  # the first split piece at or after p (searchsorted "left")
                if p >= last_p:
                    s_lo = s_hi = last_i
                    if s_lo < n_split and split_pos[s_lo] < p:
                        jump = 1
                        while s_lo + jump < n_split and split_pos[s_lo + jump] < p:
                            s_lo += jump
                            jump *= 2
                        s_hi = min(s_lo + jump, n_split)
                        s_lo += 1
                while s_lo < s_hi:
                    mid = (s_lo + s_hi) // 2
                    if split_pos[mid] < p:
                        s_lo = mid + 1
                    else:
                        s_hi = mid
                last_p, last_i = p, s_lo
                c = min(s_lo, n_split - 1)
                if split_pos[c] == p:
                    offset[j] = split_off[c]
                    seg_len = split_len[c]
            length[j] = seg_len
            if imaged and np.int64(seg_len) == np.int64(dl):
                img[j] = images[d]
    return src_id, sample, offset, length, lane, img, bounds
