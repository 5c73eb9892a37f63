"""The windowed draw at dp 1 (`planning.draw_window: W`, default 0 = membership as drawn by planning._mixture).

Why. At dp 1 a step is one or a few packed rows. Membership draws each step from each source's *next* segments
only, so a row holds what the sources' next segments happen to add up to: ~90% real tokens on the delivery
benchmark's two sources (web ~350 tokens, code ~1,400, seq_len 4,096), against 100% for concat-and-cut. Taking
any of each source's next W segments (the least-ahead source first, first fit) fills rows to ~98% at W 4-8
(docs/planning.md, "What limits a dp-1 row's real tokens").

What (planning._window_kernel has the rule). Every step of the plan must be at dp 1 (a plan whose steps mix dp 1 and
dp > 1, e.g. a re-plan from or to another dp, is refused: a PlanError naming planning.draw_window). The budget is
the rows (slots x seq_len), not fill x rows: at dp 1 nothing balances between ranks, and a budget below seq_len
would never take a sequence-long piece of a split document. The result is what the look-ahead gives make_plan:
the stream pointers (each source's taken prefix before each step: every position below it placed at an earlier
step, so the pointer ranges' readers, the shuffle figures and a re-plan's carry, still hold) and a StepAssignment
(each taken position's step; the gather reads it). Positions skipped and pending at the last step are not drawn
(they are at or above the last pointer): a longer plan takes them later.

Contracts (tests/unit/planning/test_window.py): every position placed once, none below the last pointer left out;
a pending segment waits at most MAX_WAIT + sources x (W - 1) steps; each source's drawn tokens stay within
2 x seq_len of its target (sum of its weight x tokens drawn a step) on every prefix; deterministic and causal
(a plan of N steps is the first N steps of a longer one); a window reading past the stream this plan built is
refused (StreamRunOut naming the source), never filled from another source; only sources weighted at a step are
candidates of its greedy fill.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.planning._lookahead import StepAssignment
from loomdata.planning._mixture import StepWeights, Stream, StreamRunOut, pointer_dtype
from loomdata.planning._pointers import PointerChunk, Pointers, compress_rows
from loomdata.planning._window_kernel import DONE, FULL, by_source, window_steps

__all__ = ["MAX_WAIT", "window_membership"]

MAX_WAIT = 32
"""Steps a skipped segment may wait before a step takes it first (where it fits: the first one always does).
Measured (benchmarks/membership_fill.py's data, 500 steps, dp 1 x 1, W 8): 8 steps 5.69 points worst mixture error,
16 3.64, 32 and more 1.96 (a forced take puts its source ahead of the greedy rule's bound); W 2 and 4 alike at 16+."""
_BLOCK_CELLS = 1 << 20
"""(steps x sources) cells of weights and pointer rows worked out at a time."""


def window_membership(
    weights: StepWeights,
    streams: Sequence[Stream],
    seq_len: int,
    slots: np.ndarray,
    window: int,
    max_wait: int = MAX_WAIT,
) -> tuple[Pointers, StepAssignment]:
    """(Pointers, StepAssignment) of every step by the windowed draw (module docstring). `slots`: each step's rows
    (dp 1: its micro-batches). StreamRunOut where a window reads past a stream's end."""
    steps, n_src = len(weights), weights.n_sources
    lens = np.concatenate([np.diff(st.cum).astype(np.uint32) for st in streams]) if n_src else np.zeros(0, np.uint32)
    off = np.zeros(n_src + 1, dtype=np.int64)
    np.cumsum([len(st.cum) - 1 for st in streams], out=off[1:])
    huge = np.iinfo(np.int64).max
    # every epoch has the same segments; where the stream holds less than one, no epoch start is reached
    ends = [int(np.searchsorted(s.cum, s.epoch_tokens)) if s.cum[-1] >= s.epoch_tokens > 0 else huge for s in streams]
    epoch_segs = np.array(ends, dtype=np.int64)
    epoch_segs[epoch_segs <= 0] = huge
    slot_arr = np.ascontiguousarray(np.broadcast_to(np.asarray(slots, dtype=np.int64), (steps,)))
    state = (
        np.zeros(n_src, dtype=np.int64),
        np.zeros((n_src, window), dtype=np.int64),
        np.zeros((n_src, window), dtype=np.int64),
        np.zeros(n_src, dtype=np.int64),
        np.zeros(n_src),
        np.zeros(n_src),
    )
    dtype = pointer_dtype(streams)
    rows = max(64, _BLOCK_CELLS // max(n_src, 1))
    cap = rows * 64 + int(slot_arr.max(initial=1)) * seq_len + n_src * window
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (source, position, step) of runs of takes
    pos_dt = np.uint32 if int(off[-1]) < 2**32 else np.int64
    chunks: list[PointerChunk] = []
    prev = np.zeros(n_src, dtype=np.int64)
    for b0 in range(0, steps, rows):
        b1 = min(steps, b0 + rows)
        w = weights.rows(b0, b1)
        ptr_rows = np.empty((b1 - b0 + 1, n_src), dtype=np.int64)
        ptr_rows[0] = prev
        at = b0
        while at < b1:
            takes = (np.empty(cap, dtype=np.int32), np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int32))
            status, at, k, n = window_steps(
                lens, off, epoch_segs, w, at, b1, b0, slot_arr, seq_len, window, max_wait, state, ptr_rows, takes, 0
            )
            parts.append((takes[0][:n].copy(), takes[1][:n].astype(pos_dt), takes[2][:n].copy()))
            if status not in (DONE, FULL):
                raise StreamRunOut(at, k)
        prev = ptr_rows[-1].copy()
        chunks.append(compress_rows(ptr_rows, b0, dtype))
    if not chunks:
        chunks.append(compress_rows(np.zeros((1, n_src), dtype=dtype), 0))
    # each source's takes in step order, scattered part by part into one flat array of each (12 bytes a take in the
    # parts, 8 in the result: no concatenation of all takes, no int64 copy of them)
    indptr = np.zeros(n_src + 1, dtype=np.int64)
    for p in parts:
        indptr[1:] += np.bincount(p[0], minlength=n_src)
    np.cumsum(indptr, out=indptr)
    out_pos, out_step = np.empty(int(indptr[-1]), dtype=pos_dt), np.empty(int(indptr[-1]), dtype=np.int32)
    next_at = indptr[:-1].copy()
    while parts:
        by_source(*parts.pop(0), next_at, out_pos, out_step)
    pos_k = [out_pos[indptr[k] : indptr[k + 1]] for k in range(n_src)]
    step_k = [out_step[indptr[k] : indptr[k + 1]] for k in range(n_src)]
    return Pointers(chunks, steps), StepAssignment(pos_k, step_k)
