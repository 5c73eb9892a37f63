"""Step membership: how many segments of each source every step draws, from the mixture and seeded streams.

Targets. Every step has the same token budget B = dp_size * micro_batches * seq_len * fill (fill < 1
leaves the balancer room to trade tokens for cost). The weights w[t, k] of step t are the milestones'
weights interpolated linearly (held before the first milestone and after the last), normalised to sum 1
(weights are token shares). Target cumulative tokens of source k through step t:
T[t, k] = B * sum_{s <= t} w[s, k].

Streams. Source k yields its non-empty documents in a seeded permutation
(seed, crc32(source name), epoch), a new permutation every epoch, epochs concatenated (uniform, or with
spec `shuffle: block` the block shuffle of planning._shuffle, whose reads are mostly sequential); documents longer
than their lane are expanded into consecutive segments (see _packing). cum_k is the stream's cumulative
token count.

Credit accumulator. Through step t, source k has consumed the stream prefix whose cumulative token
count is nearest to T[t, k]: one compiled walk per source over all steps (_mixture_kernel), no per-document
Python loop.
Each source's realized cumulative tokens stay within half a segment of its target on every prefix without a
fill (below), so
cumulative shares converge on the targets (after step 20 within 1 percentage point once a step holds a
few dozen documents). A step whose segments would not fit its slots defers the segments of the source
most ahead of its target to the next step (a sequential repair, compiled: _mixture_kernel), then, at dp 1 (the
caller's per-step give-back room), draws back deferred segments that fit again up to its budget, the source least
ahead first (a long segment deferred last no longer leaves the step part empty); a step that draws
nothing (its sources' targets all short of half their next segment: many sources, few slots) draws the next segment
of the weighted source that leaves least ahead of its target (the fill, the repair's mirror; a step's pointer is
then the greater of its nearest and the step before's).

The mixture's own rules (known sources, weights, milestone steps) are the spec's (parse_spec); planning
trusts a validated Spec and checks only what needs the data. Errors (PlanError): a source with a
positive weight but no tokens; a source whose cumulative target exceeds max_epochs epochs (names the
source and the first such step); StreamRunOut where a fill meets a weighted source with no segment left in the
stream the plan built (budgets below the documents' lengths draw fills past the targets: refused, not filled from
another source, so a plan does not depend on how far its streams were built). A step that draws no segment even so
(no weighted source's next segment fits its sequences) is refused by make_plan.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loomdata.planning import _permute, _threads
from loomdata.planning._mixture_kernel import held_membership, held_rows, held_targets, nearest_run, repair_rows
from loomdata.planning._packing import Lanes
from loomdata.planning._permute import PrefixPermutation
from loomdata.planning._pointers import PointerChunk, Pointers, chunk_of_changes, compress_rows
from loomdata.planning._shuffle import BlockLayout
from loomdata.planning._stream_kernel import chunk_counts, expand_stream, split_sizes
from loomdata.planning._transpose_kernel import transpose_into, transposed
from loomdata.schemas.errors import PlanError
from loomdata.schemas.spec import Spec

__all__ = [
    "CumulativeTargets",
    "StepWeights",
    "Stream",
    "build_stream",
    "check_epochs",
    "give_back_room",
    "membership",
    "pointer_dtype",
    "step_weights",
]


def step_weights(spec: Spec) -> StepWeights:
    """The (steps, sources) float64 token shares of every step, interpolated between milestones, rows summing to
    1, as a StepWeights that works out any block of rows or sources when asked.

    The spec is validated (parse_spec): known sources, finite weights >= 0, a positive weight in every
    milestone, milestone steps increasing and within training.steps; so every row has a positive sum.
    """
    names = spec.source_names
    ms = spec.mixture.milestones()
    xs = np.array([m.step for m in ms], dtype=np.float64)
    ys = np.array([[float(m.weights.get(n, 0.0)) for n in names] for m in ms], dtype=np.float64)
    steps = spec.training.steps
    # from the last milestone on every row is that milestone's weights (np.interp holds its last value there):
    # one row normalised once (a row's sum is the same pairwise sum as in the grid) and repeated
    held = int(min(max(np.ceil(xs[-1]), 0), steps))
    last = ys[-1:] / ys[-1:].sum(axis=1)[:, None]
    sums = np.empty(held)
    for a in range(0, held, _WEIGHT_ROWS):  # each row's own sum: the same whatever rows share the block
        b = min(held, a + _WEIGHT_ROWS)
        sums[a:b] = _interpolated(xs, ys, a, b).sum(axis=1)
    return StepWeights(xs, ys, last[0], sums, held, 0, steps)


_WEIGHT_ROWS = 1 << 16
"""Steps of interpolated weights worked out at a time."""


def _interpolated(xs: np.ndarray, ys: np.ndarray, a: int, b: int) -> np.ndarray:
    """(b - a, sources) C-ordered: the milestones' weights interpolated at steps a..b-1 (not normalised)."""
    t = np.arange(a, b, dtype=np.float64)
    return np.stack([np.interp(t, xs, ys[:, k]) for k in range(ys.shape[1])], 1)


@dataclass(frozen=True, slots=True)
class StepWeights:
    """Token shares of steps first..first+steps-1, bit for bit the rows of the normalised (steps, sources) grid,
    worked out a block of rows or of sources at a time instead of held: with hundreds of sources and millions
    of steps (dp 4 at a billion samples) the grid alone would be 8 bytes x steps x sources."""

    xs: np.ndarray  # float64 milestone steps
    ys: np.ndarray  # (milestones, sources) float64 raw milestone weights
    last: np.ndarray  # (sources,) float64 the last milestone's weights normalised: every row from `held` on
    row_sums: np.ndarray  # float64 the interpolated rows' sums, for steps first..held-1
    held: int  # the first step whose row is `last`
    first: int  # the step of row 0
    steps: int  # rows

    def __len__(self) -> int:
        return self.steps

    @property
    def n_sources(self) -> int:
        """Columns (sources)."""
        return len(self.last)

    def window(self, a: int, b: int) -> StepWeights:
        """Rows a..b-1 as StepWeights of their own (what a step range sends a worker)."""
        lo, hi = min(a, len(self.row_sums)), min(b, len(self.row_sums))
        return StepWeights(self.xs, self.ys, self.last, self.row_sums[lo:hi].copy(), self.held, self.first + a, b - a)

    def rows(self, a: int, b: int) -> np.ndarray:
        """(b - a, sources) C-ordered float64: rows a..b-1."""
        out = np.empty((max(b - a, 0), self.n_sources))
        mid = min(max(self.held - self.first, a), b)  # rows before `mid` are interpolated
        if mid > a:
            w = _interpolated(self.xs, self.ys, self.first + a, self.first + mid)
            out[: mid - a] = w / self.row_sums[a:mid][:, None]
        out[mid - a :] = self.last
        return out

    def columns(self, k0: int, k1: int) -> np.ndarray:
        """(k1 - k0, steps) C-ordered float64: the columns of sources k0..k1-1, as rows."""
        out = np.empty((k1 - k0, self.steps))
        mid = min(max(self.held - self.first, 0), self.steps)
        if mid:
            t = np.arange(self.first, self.first + mid, dtype=np.float64)
            sums = self.row_sums[:mid]
            for k in range(k0, k1):
                out[k - k0, :mid] = np.interp(t, self.xs, self.ys[:, k]) / sums
        out[:, mid:] = self.last[k0:k1, None]
        return out

    def grid(self) -> np.ndarray:
        """The whole (steps, sources) grid (tests and small plans; the planner works a block at a time)."""
        return self.rows(0, self.steps)


@dataclass(frozen=True, slots=True)
class CumulativeTargets:
    """Target tokens of each source through each step, np.cumsum(weights * budget[:, None], axis=0) bit for bit,
    worked out for a block of sources (all steps) or a run of steps (the row before it given) when asked."""

    weights: StepWeights
    budget: np.ndarray  # int64 token budget of every step

    @property
    def shape(self) -> tuple[int, int]:
        """(steps, sources)."""
        return (len(self.weights), self.weights.n_sources)

    def columns(self, k0: int, k1: int) -> np.ndarray:
        """(k1 - k0, steps) C-ordered: sources k0..k1-1's targets, as rows (each a running sum down the steps)."""
        v = self.weights.columns(k0, k1)
        v *= self.budget.astype(np.float64)[None, :]
        return np.cumsum(v, axis=1, out=v)

    def rows(self, a: int, b: int, before: np.ndarray | None) -> np.ndarray:
        """(b - a, sources) C-ordered: steps a..b-1's targets; `before`: step a-1's row (None when a is 0)."""
        v = self.weights.rows(a, b)
        v *= self.budget[a:b].astype(np.float64)[:, None]
        if before is not None and len(v):
            v[0] += before
        return np.cumsum(v, axis=0, out=v)

    def rows_and_columns(self, a: int, b: int, before: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(rows(a, b, before), the same block transposed: sources as C-ordered rows); steps whose weights are all
        the held last row in one compiled pass (_mixture_kernel.held_rows: the same floats)."""
        if a < self.weights.held - self.weights.first or b <= a:
            v = self.rows(a, b, before)
            return v, transposed(v)
        n = self.weights.n_sources
        acc = np.zeros(n) if before is None else np.array(before, dtype=np.float64)
        rows, cols = np.empty((b - a, n)), np.empty((n, b - a))
        held_rows(self.weights.last, np.ascontiguousarray(self.budget[a:b], dtype=np.int64), acc, rows, cols)
        return rows, cols

    def final(self) -> np.ndarray:
        """(sources,) the targets through the last step: the rows worked out a chunk of steps at a time; where a
        chunk's weights are all the held last row, only its running sum (_mixture_kernel.held_targets: the same
        floats, without the chunk's block of rows)."""
        steps, n = self.shape
        rows = max(64, REPAIR_CHUNK_CELLS // max(n, 1))
        held = self.weights.held - self.weights.first  # rows from here on are the held row
        before: np.ndarray | None = None
        for a in range(0, steps, rows):
            b = min(steps, a + rows)
            if a >= held:
                acc = np.zeros(n) if before is None else before
                held_targets(self.weights.last, np.ascontiguousarray(self.budget[a:b], dtype=np.int64), acc)
                before = acc
            else:
                before = self.rows(a, b, before)[-1].copy()
        return np.zeros(n) if before is None else before.copy()


@dataclass(frozen=True, slots=True)
class Stream:
    """One source's segments, epoch after epoch: the document row of each, where split ones start, counts.

    Most segments are whole documents, so offsets and lengths are stored only for pieces of split
    documents (`split_pos` sorted); a whole document's length is its index length. The cumulative
    counts are needed for membership only and dropped after it (`without_counts`).
    """

    doc: np.ndarray  # uint32/int64 row into the source's index table
    split_pos: np.ndarray  # int64 stream positions of pieces of split documents
    split_off: np.ndarray  # uint32 their offsets
    split_len: np.ndarray  # uint32 their lengths
    cum: np.ndarray  # int64, len n+1: tokens of the first j segments
    cum_short: np.ndarray | None  # int64: short-lane tokens of the first j segments (None: no long lane)
    cum_long: np.ndarray | None  # int64: long-lane segments among the first j
    epoch_tokens: int

    def segments(
        self, a: int, b: int, lengths: np.ndarray, lanes: Lanes
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(doc, offset, length, lane) of stream positions [a, b)."""
        doc = self.doc[a:b]
        dl = lengths[doc]
        length = dl.astype(np.uint32, copy=True)
        offset = np.zeros(len(doc), dtype=np.uint32)
        i, j = np.searchsorted(self.split_pos, [a, b])
        if j > i:
            pos = self.split_pos[i:j] - a
            offset[pos] = self.split_off[i:j]
            length[pos] = self.split_len[i:j]
        return doc, offset, length, lanes.lane_of(dl)

    def without_counts(self) -> Stream:
        """The same stream without its cumulative counts (frees 8+ bytes a segment once membership is done)."""
        empty = np.zeros(0, dtype=np.int64)
        return Stream(self.doc, self.split_pos, self.split_off, self.split_len, empty, None, None, self.epoch_tokens)


def source_key(seed: int, name: str) -> list[int]:
    """Seed material of a source's permutations: stable under adding, removing or reordering sources."""
    return [int(seed) & 0xFFFFFFFFFFFFFFFF, zlib.crc32(name.encode())]


def build_stream(
    name: str,
    seed: int,
    lengths: np.ndarray,
    lanes: Lanes,
    epochs: int,
    blocks: BlockLayout | None = None,
    need: float | None = None,
    parts: int = 1,
) -> Stream:
    """The first `epochs` epochs of a source's seeded segment stream (one fresh permutation per epoch); with
    `need`, only its prefix through the chunk where the tokens reach `need` (a plan drawing 1.1 epochs does not
    expand and count the rest of the second: the prefix is the same segments and counts).

    `blocks` (spec `shuffle: block`): each epoch's permutation is the block shuffle of planning._shuffle
    (block order permuted, documents shuffled within windows of blocks) from the same per-epoch generator;
    None: a uniform permutation of all documents. Either way every non-empty document once per epoch.
    Memory: the stream keeps 4 bytes (doc) + 8 (cum) a segment and 16 a piece of a split document, allocated once
    at their final size (how many segments the split documents add does not depend on their order); while an epoch
    is expanded, its permutation (4 bytes a document) and its documents' lengths (their dtype's bytes) are held
    too. Each epoch's permutation carries its
    documents' lengths (planning._permute: no random gather of them, which was most of this function's time at
    scale) and is expanded into segments and counted in one compiled pass (planning._stream_kernel), checking
    `need` every `_CHUNK` documents.
    """
    idx_dtype = np.uint32 if len(lengths) < 2**32 else np.int64
    nonempty = bool((lengths > 0).all())
    docs = None if nonempty or blocks is not None else np.flatnonzero(lengths > 0).astype(idx_dtype)
    n_docs = len(lengths) if nonempty else int(np.count_nonzero(lengths))
    n_ep = max(epochs, 1)
    out = _Expansion(lengths, lanes, need, n_ep, n_docs, idx_dtype)
    for e in range(n_ep):
        rng = np.random.default_rng([*source_key(seed, name), e])
        if blocks is None:  # 4-byte ids, bucketed then shuffled in cache, their lengths carried (planning._permute)
            _expand_epoch(PrefixPermutation(rng, n_docs, lengths, src=docs, dtype=idx_dtype, parts=parts), out, parts)
        else:  # (a block shuffle's reads are mostly local: its lengths are read in the expansion)
            rows = blocks.permutation(rng)
            perm = (rows if nonempty else rows[lengths[rows] > 0]).astype(idx_dtype)
            del rows
            if len(perm) != n_docs:
                raise AssertionError(f"epoch {e} of source {name!r} permutes {len(perm)} documents, not {n_docs}")
            out.expand(perm, lengths[:0], False, 1)
            del perm
        if out.reached():
            break
    del docs
    return out.stream(name)


class _Expansion:
    """A stream's arrays as they are written (allocated once at their final size: how many segments split
    documents add does not depend on their order) and how far: expand_stream over permuted documents, in one
    pass or in parts on threads."""

    def __init__(
        self, lengths: np.ndarray, lanes: Lanes, need: float | None, epochs: int, n_docs: int, idx: type[np.integer]
    ) -> None:
        self.lengths, self.lanes, self.need = lengths, lanes, need
        # the kernels' lane rule: -1 no long lane; a long lane without a threshold holds no document (Lanes.lane_of)
        self.threshold = -1 if not lanes.has_long else (2**62 if lanes.threshold is None else int(lanes.threshold))
        self.long_len = int(lanes.long_seq_len or 0)
        extra, pieces = (int(x) for x in split_sizes(lengths, lanes.seq_len, self.long_len, self.threshold))
        self.total = epochs * (n_docs + extra)
        self.epoch_tokens = int(lengths.sum(dtype=np.int64))
        self.doc = np.empty(self.total, dtype=idx)
        self.cum = np.zeros(self.total + 1, dtype=np.int64)
        unused = np.zeros(1, dtype=np.int64)  # the kernel's long-lane counts where there is no long lane
        self.cum_short = np.zeros_like(self.cum) if lanes.has_long else unused
        self.cum_long = np.zeros_like(self.cum) if lanes.has_long else unused
        self.split_pos = np.empty(epochs * pieces, dtype=np.int64)
        self.split_off = np.empty(epochs * pieces, dtype=np.uint32)
        self.split_len = np.empty(epochs * pieces, dtype=np.uint32)
        self.at = self.n_split = 0  # segments and split pieces written

    def reached(self) -> bool:
        """Whether the tokens written reach `need`."""
        return self.need is not None and self.cum[self.at] >= self.need

    def tokens_short(self) -> float:
        """Tokens `need` asks beyond those written (0 without a need)."""
        return 0.0 if self.need is None else float(self.need) - float(self.cum[self.at])

    def expand(self, perm: np.ndarray, perm_lengths: np.ndarray, gathered: bool, parts: int) -> None:
        """Append perm's documents' segments (`need` checked every _CHUNK documents from perm's start); with
        `gathered`, perm_lengths are their lengths; with parts > 1 and enough documents, groups of chunks on threads."""
        if not gathered or parts < 2 or len(perm) < 2 * _permute.PART_ITEMS:
            self.at, self.n_split = self._run(
                perm, perm_lengths, gathered, self.at, self.n_split, self.need is not None
            )
        else:
            self._apart(perm, perm_lengths, parts)

    def _run(
        self, perm: np.ndarray, perm_lengths: np.ndarray, gathered: bool, at: int, n_split: int, bounded: bool
    ) -> tuple[int, int]:
        return expand_stream(
            perm,
            self.lengths,
            perm_lengths,
            gathered,
            self.lanes.seq_len,
            self.long_len,
            self.threshold,
            _CHUNK,
            float(self.need) if self.need is not None else 0.0,
            bounded,
            self.doc,
            self.cum,
            self.cum_short,
            self.cum_long,
            self.split_pos,
            self.split_off,
            self.split_len,
            at,
            n_split,
        )

    def _apart(self, perm: np.ndarray, perm_lengths: np.ndarray, parts: int) -> None:
        """expand in groups of chunks on threads, each from where the chunks before it end (chunk_counts first)."""
        long_lane = self.lanes.has_long
        chunks = (len(perm_lengths) + _CHUNK - 1) // _CHUNK  # counted in parts too: each chunk's alone
        bounds = np.unique(np.arange(parts + 1) * chunks // parts).tolist()
        counted = _threads.parallel(
            [
                functools.partial(
                    chunk_counts,
                    perm_lengths[a * _CHUNK : b * _CHUNK],
                    self.lanes.seq_len,
                    self.long_len,
                    self.threshold,
                    _CHUNK,
                )
                for a, b in itertools.pairwise(bounds)
            ]
        )
        counts = counted[0] if len(counted) == 1 else np.concatenate(counted)
        starts = np.zeros((len(counts) + 1, 5), dtype=np.int64)
        np.cumsum(counts, axis=0, out=starts[1:])
        at = self.at
        lane_counts = (self.cum_short[at], self.cum_long[at]) if long_lane else (0, 0)
        starts += np.array([at, self.n_split, self.cum[at], *lane_counts])
        last = len(counts)
        if self.need is not None:  # through the first chunk whose count reaches need, as one pass would stop
            hit = np.flatnonzero(starts[1:, 2] >= self.need)
            last = int(hit[0]) + 1 if len(hit) else last
        groups = np.unique(np.arange(parts + 1) * last // parts)
        for g in groups[1:-1].tolist():  # each group's first counts (the group before writes the same values)
            self.cum[starts[g, 0]] = starts[g, 2]
            if long_lane:
                self.cum_short[starts[g, 0]] = starts[g, 3]
                self.cum_long[starts[g, 0]] = starts[g, 4]
        ends = _threads.parallel(
            [
                functools.partial(
                    self._run,
                    perm[a * _CHUNK : b * _CHUNK],
                    perm_lengths[a * _CHUNK : b * _CHUNK],
                    True,
                    int(starts[a, 0]),
                    int(starts[a, 1]),
                    False,
                )
                for a, b in zip(groups[:-1].tolist(), groups[1:].tolist(), strict=True)
            ]
        )
        want = [(int(starts[b, 0]), int(starts[b, 1])) for b in groups[1:].tolist()]
        if ends != want:  # every group ends where the next was counted to start
            raise AssertionError(f"chunks expanded apart end at {ends}, counted {want}")
        self.at, self.n_split = want[-1]

    def stream(self, name: str) -> Stream:
        """The stream written: views of the prefix where `need` stopped it early (the rest never written, so
        never resident)."""
        at, n_split = self.at, self.n_split
        if at != self.total and not self.reached():
            raise AssertionError(f"source {name!r}: {at} segments expanded, {self.total} expected")
        long_lane = self.lanes.has_long
        return Stream(
            self.doc[:at],
            self.split_pos[:n_split],
            self.split_off[:n_split],
            self.split_len[:n_split],
            self.cum[: at + 1],
            self.cum_short[: at + 1] if long_lane else None,
            self.cum_long[: at + 1] if long_lane else None,
            self.epoch_tokens,
        )


_CHUNK = 1 << 16
"""Documents of a permutation expanded and counted at a time (what a stream built to a need expands beyond it,
at most)."""


def _expand_epoch(perm: PrefixPermutation, out: _Expansion, parts: int) -> None:
    """Expand an epoch's permutation a prefix at a time until `need` is reached or the epoch ends: first about the
    documents the tokens still needed take (their mean length, 10% and a chunk more), then twice as many, and so
    on; every expansion but the epoch's last ends at a multiple of _CHUNK documents, so the chunks (where `need`
    is checked) fall where they would in one pass over the whole permutation."""
    n = len(perm.out)
    done = 0
    short = out.tokens_short()
    want = n if out.need is None or out.epoch_tokens == 0 else _CHUNK + max(0, int(short * 1.1 * n / out.epoch_tokens))
    while True:
        ready = perm.extend(min(n, max(want, done + 1)))
        stop = ready if ready == n else ready - ready % _CHUNK
        if stop > done:
            out.expand(perm.out[done:stop], perm.values[done:stop], True, parts)
            done = stop
        if done == n or (done > 0 and out.reached()):  # (one pass expands an epoch's first chunk whatever the need)
            return
        want = max(2 * want, done + _CHUNK)


def check_epochs(
    names: Sequence[str],
    targets: np.ndarray | CumulativeTargets,
    epoch_tokens: Sequence[int],
    max_epochs: Sequence[float | None],
) -> np.ndarray:
    """Each source's target through the last step; PlanError for a source with positive weight but no tokens,
    or whose target exceeds its max_epochs. A source's targets never decrease (weights >= 0), so the last one
    decides; the whole column is worked out only to name the first step in the error."""
    tg = _as_targets(targets)
    final = tg.final()
    for k, name in enumerate(names):
        if epoch_tokens[k] == 0:
            if final[k] > 0:
                col = tg.columns(k, k + 1)[0]
                pos = np.flatnonzero(np.diff(col, prepend=0.0) > 0)
                raise PlanError(
                    f"source {name!r} is empty (its index has no samples with tokens) but has a positive "
                    f"weight from step {int(pos[0])}; index it with `loom index` or set its weight to 0"
                )
            continue
        cap = max_epochs[k]
        if cap is None or not final[k] > cap * epoch_tokens[k]:
            continue
        col = tg.columns(k, k + 1)[0]
        over = np.flatnonzero(col > cap * epoch_tokens[k])
        need = float(col[-1]) / epoch_tokens[k]
        raise PlanError(
            f"source {name!r} would exceed max_epochs={cap:g} at step {int(over[0])} "
            f"({epoch_tokens[k]} tokens per epoch; the plan needs {need:.2f} epochs); lower its weight, "
            "raise max_epochs, add data or plan fewer steps"
        )
    return final


@dataclass(frozen=True, slots=True)
class _GridTargets:
    """A whole (steps, sources) targets grid behind CumulativeTargets' interface (tests, small plans)."""

    grid: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.grid.shape[0]), int(self.grid.shape[1]))

    def columns(self, k0: int, k1: int) -> np.ndarray:
        return transposed(np.ascontiguousarray(self.grid[:, k0:k1], dtype=np.float64))

    def rows(self, a: int, b: int, before: np.ndarray | None) -> np.ndarray:
        return np.ascontiguousarray(self.grid[a:b], dtype=np.float64)

    def rows_and_columns(self, a: int, b: int, before: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        v = self.rows(a, b, before)
        return v, transposed(v)

    def final(self) -> np.ndarray:
        return np.array(self.grid[-1], dtype=np.float64) if len(self.grid) else np.zeros(self.grid.shape[1])


def _as_targets(targets: np.ndarray | CumulativeTargets) -> CumulativeTargets | _GridTargets:
    return targets if isinstance(targets, CumulativeTargets) else _GridTargets(np.asarray(targets))


def _nearest(cum: np.ndarray, x: np.ndarray) -> np.ndarray:
    """For each target x, the prefix length j whose cum[j] is nearest to x (ties go to the shorter prefix).

    The NumPy reference of _mixture_kernel.nearest_column (the tests hold the two equal; membership runs its
    chunked form, `nearest_run`). Float targets are searched as their ceilings (for integer counts c < x exactly
    when c < ceil(x)): a float needle would make NumPy search a float64 copy of all of cum (8 bytes a segment)."""
    needle = np.ceil(x).astype(np.int64) if np.issubdtype(np.asarray(x).dtype, np.floating) else x
    j = np.searchsorted(cum, needle, side="left")
    j = np.minimum(j, len(cum) - 1)
    lower = np.maximum(j - 1, 0)
    take_lower = (j > 0) & ((x - cum[lower]) <= (cum[j] - x))
    return np.where(take_lower, lower, j).astype(np.int64)


def give_back_room(step_dp: np.ndarray, step_budget: np.ndarray) -> np.ndarray:
    """The planner's give-back room a step (`membership`'s `budget`): the step's token budget at dp 1, none at dp > 1,
    where the look-ahead evens heavy segments out by moving lights through the steps' spare room, which steps filled
    to the budget would not leave it (session 25: given back at dp 2 the excess ran to the last step)."""
    return np.where(np.asarray(step_dp) == 1, np.asarray(step_budget, dtype=np.int64), 0)


def membership(
    targets: np.ndarray | CumulativeTargets,
    streams: Sequence[Stream],
    lanes: Lanes,
    slots: int | np.ndarray,
    budget: int | np.ndarray,
) -> Pointers:
    """(steps+1, sources) stream pointers: segments of each source consumed before step t (row 0 is zeros), as
    sparse Pointers (planning._pointers: per chunk of steps, the steps each source draws at).

    `targets`: CumulativeTargets (worked out a chunk of steps at a time) or the whole grid. `slots` is the step's
    dp_size * micro_batches, one number or one per step (an elastic re-plan changes it from its resume step
    on); pointers of steps < t depend only on targets and slots of steps < t (StreamRunOut where that would not
    hold: a fill that needs a segment past a stream's end). `budget`: the tokens up to which a step whose deferrals
    left room gives deferred segments back (one number or one per step; 0: none). Required, so that no caller gets
    the give-back by default: the planner's rule is `give_back_room` (dp 1 only).

    A chunk of steps at a time (REPAIR_CHUNK_CELLS cells): each source's nearest pointers carried on from the
    chunk before (_mixture_kernel.nearest_run, its search state kept), the repair over them, and the repaired
    rows compressed into a chunk of the Pointers; no (steps x sources) table exists whole.
    """
    tg = _as_targets(targets)
    steps, n_src = tg.shape
    slot_arr = np.broadcast_to(np.asarray(slots, dtype=np.int64), (steps,))
    give = np.ascontiguousarray(np.broadcast_to(np.asarray(budget, dtype=np.int64), (steps,)))
    dtype = pointer_dtype(streams)
    rows = max(64, REPAIR_CHUNK_CELLS // max(n_src, 1))
    state = np.zeros((n_src, 2), dtype=np.int64)  # each source's nearest search: last answer, running maximum
    prev = np.zeros(n_src, dtype=dtype)  # the repaired row before the chunk
    near_before = np.zeros(n_src, dtype=dtype)  # the nearest row before the block (row 0: zeros)
    before: np.ndarray | None = None  # the targets of the step before the block
    chunks: list[PointerChunk] = []
    held = _held_from(tg, streams)
    b0 = 0
    while b0 < steps:
        windows = None
        if b0 >= held:  # the held pass, over HELD_CHUNKS chunks at once, where its windows stay bounded
            b1 = min(steps, b0 + rows * HELD_CHUNKS)
            windows = _held_windows(tg, streams, b0, b1, before, state, prev)
        if windows is not None and isinstance(tg, CumulativeTargets):  # the held pass: no (steps x sources) block
            acc = np.zeros(n_src) if before is None else before
            cur = prev.astype(np.int64)
            e_step, e_src, e_val = _held_run(
                tg, streams, windows, (b0, b1), acc, state, cur, (slot_arr, give), lanes.seq_len
            )
            del windows
            before = acc
            chunks.append(chunk_of_changes(prev.copy(), b1 - b0, b0, e_step, e_src, e_val))
            prev = cur.astype(dtype)
            near_before = state[:, 1].astype(dtype)
            b0 = b1
            continue
        b1 = min(steps, b0 + rows)
        tg_rows, by_source = tg.rows_and_columns(b0, b1, before)  # (b1 - b0, sources), and as (sources, b1 - b0)
        prior = np.zeros(n_src) if before is None else before  # (step b0 - 1's targets: the fill's weighted sources)
        before = tg_rows[-1].copy()
        near = _nearest_rows(streams, by_source, state, near_before, dtype)  # rows b0..b1 (row 0: near_before)
        del by_source
        near_before = near[-1].copy()
        chunks.extend(_repair(near, b0, prev, tg_rows, streams, lanes, (slot_arr, give), prior))
        prev = chunks[-1].row(chunks[-1].rows)
        del near, tg_rows
        b0 = b1
    if not chunks:
        chunks.append(compress_rows(np.zeros((1, n_src), dtype=dtype), 0))
    return Pointers(chunks, steps)


def _held_from(tg: CumulativeTargets | _GridTargets, streams: Sequence[Stream]) -> int:
    """The first step membership may work out by the held pass (_mixture_kernel.held_membership): where the
    weights are all the held last row, for sources without a long lane (no step where there is one)."""
    if not isinstance(tg, CumulativeTargets) or any(s.cum_short is not None or s.cum_long is not None for s in streams):
        return np.iinfo(np.int64).max
    return max(tg.weights.held - tg.weights.first, 0)


def _held_run(
    tg: CumulativeTargets,
    streams: Sequence[Stream],
    windows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    steps: tuple[int, int],
    acc: np.ndarray,
    state: np.ndarray,
    cur: np.ndarray,
    room: tuple[np.ndarray, np.ndarray],
    seq_len: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """held_membership over steps b0..b1-1 (acc, state, cur updated), its changes in step order; where a fill would
    read past a source's window, the windows are widened (through every source's repaired pointer plus a segment a
    step left: a fill draws one a step) and the run goes on from that step."""
    b0, b1 = steps
    budget = np.ascontiguousarray(tg.budget[b0:b1], dtype=np.int64)
    slots = np.ascontiguousarray(room[0][b0:b1])
    give = np.ascontiguousarray(room[1][b0:b1], dtype=np.int64)
    prior = np.zeros(len(acc))
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    s, resume = 0, False
    while True:
        e_step, e_src, e_val, done = held_membership(
            windows, tg.weights.last, (budget[s:], give[s:]), acc, prior, state, cur, slots[s:], seq_len, resume
        )
        parts.append((e_step + np.int32(s), e_src, e_val))
        if s + done >= b1 - b0:
            break
        s += done  # step b0 + s: its targets are in acc; the windows from there to b1, through the fills' reach
        _refuse_run_out(b0 + s, cur, acc > prior, streams)
        # (a segment a step for the steps left, bounded as the windows are: a later fill past it widens again)
        reach = cur + 1 + min(b1 - b0 - s, max(1, REPAIR_WINDOW // len(streams)))
        windows_or_none = _held_windows(tg, streams, b0 + s + 1, b1, acc, state, cur, reach)
        assert windows_or_none is not None  # (given a reach, always windows)
        windows, resume = windows_or_none, True
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


class StreamRunOut(PlanError):
    """A step that draws nothing found a source weighted at it with no segment left in its stream: its draws ran
    past the data its targets need (fills at a budget below its documents' lengths). Refused rather than filled
    from another source, so a plan never depends on how far its streams were built (a fresh plan builds each to
    its final target and a segment, a re-plan whole epochs): `step`, `source` (its index; make_plan names it)."""

    def __init__(self, step: int, source: int):
        super().__init__(f"step {step}: source #{source} has no segment left for the step's fill")
        self.step, self.source = step, source


def _refuse_run_out(step: int, row: np.ndarray, weighted: np.ndarray, streams: Sequence[Stream]) -> None:
    """StreamRunOut where a source weighted at `step` (its pointer before it: `row`) has no next segment."""
    for k in np.flatnonzero(weighted).tolist():
        if int(row[k]) + 1 >= len(streams[k].cum):
            raise StreamRunOut(step, k)


def _held_windows(
    tg: CumulativeTargets | _GridTargets,
    streams: Sequence[Stream],
    b0: int,
    b1: int,
    before: np.ndarray | None,
    state: np.ndarray,
    prev: np.ndarray,
    reach: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The windows of the sources' cumulative tokens that the held pass over steps b0..b1-1 reads, laid end to end
    (held_membership's `windows`): from the repaired pointer before the run (or the nearest search's last answer
    less one, if lower) through where the search ends at the run's last targets (held_targets' floats; targets
    do not decrease), and through the repaired pointer (a fill may have drawn past the search). None where they would
    hold more than REPAIR_WINDOW counts (the chunked pass then, whose repair windows are bounded so): a copy, except
    for one source (its stream's counts themselves). `reach`: positions each window reaches at least (a run widened
    for its fills, _held_run; never None then)."""
    if not isinstance(tg, CumulativeTargets):
        return None
    n_src = len(streams)
    end = np.zeros(n_src) if before is None else np.array(before, dtype=np.float64)
    held_targets(tg.weights.last, np.ascontiguousarray(tg.budget[b0:b1], dtype=np.int64), end)
    needle = np.ceil(end).astype(np.int64)
    lo = np.minimum(prev.astype(np.int64), np.maximum(state[:, 0] - 1, 0))
    n = np.array([len(s.cum) for s in streams], dtype=np.int64)
    # (each source's search its one NumPy call, the rest on all sources at once: per-source Python cost the 300-source
    # plan's 12 runs ~20 ms)
    found = np.array([s.cum.searchsorted(x) for s, x in zip(streams, needle.tolist(), strict=True)], dtype=np.int64)
    top = np.maximum(np.maximum(state[:, 0], found), prev.astype(np.int64))
    hi = np.minimum(top if reach is None else np.maximum(top, reach), n - 1) + 1
    off = np.zeros(n_src + 1, dtype=np.int64)
    np.cumsum(hi - lo, out=off[1:])
    if n_src == 1:
        return streams[0].cum, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), n
    if int(off[-1]) > REPAIR_WINDOW and reach is None:
        return None
    cw = np.concatenate([s.cum[a:b] for s, a, b in zip(streams, lo.tolist(), hi.tolist(), strict=True)], dtype=np.int64)
    return cw, off[:-1].copy(), lo, n


def _nearest_rows(
    streams: Sequence[Stream], by_source: np.ndarray, state: np.ndarray, first: np.ndarray, dtype: type
) -> np.ndarray:
    """(steps + 1, sources) C-ordered: `first`, then the nearest pointers of the block's steps, each source's
    search carried on from `state` (updated). Worked out source by source over the block's targets laid out as
    rows (`by_source`: (sources, steps), the block transposed; a tiled transpose back: a column of the C-ordered
    block is one cache line a step)."""
    n_src, r = by_source.shape
    out_t: np.ndarray = np.empty((n_src, r), dtype=dtype)
    for k in range(n_src):
        nearest_run(streams[k].cum, by_source[k], out_t[k], state[k])
    out = np.empty((r + 1, n_src), dtype=dtype)
    out[0] = first
    transpose_into(out_t, out[1:])
    return out


def pointer_dtype(streams: Sequence[Stream]) -> type[np.int32] | type[np.int64]:
    """int32 for the pointers while every stream is shorter than 2^31 segments (half the bytes of the (steps+1,
    sources) table, which with hundreds of sources and a small dp is the planner's largest), else int64."""
    return np.int32 if max((len(s.cum) for s in streams), default=0) < 2**31 else np.int64


def _laid_end_to_end(windows: list[np.ndarray], room: list[np.ndarray] | None = None) -> np.ndarray:
    """The windows concatenated (a single window as it is: no copy of a whole stream's counts); into room[0] where
    given, grown as needed (a repair's windows one after another reuse one buffer: each fresh one of up to
    REPAIR_WINDOW counts was page-faulted in anew, 0.18 CPU-s of a 50M-sample plan's 13 windows)."""
    if len(windows) == 1:
        return windows[0]
    if not room:
        return np.concatenate(windows)
    n = sum(len(w) for w in windows)
    if len(room[0]) < n:
        room[0] = np.empty(max(n, 2 * len(room[0])), dtype=np.result_type(*windows))
    out = room[0][:n]
    np.concatenate(windows, out=out)
    return out


REPAIR_CHUNK_CELLS = 1 << 20
"""(steps x sources) cells repaired at once (bounds the windows of the streams' counts gathered for them)."""
HELD_CHUNKS = 4
"""The held pass works out this many chunks of REPAIR_CHUNK_CELLS cells at once (it keeps no block of them)."""
REPAIR_WINDOW = 1 << 22
"""Most segments of several sources' counts laid end to end for one chunk of the repair (8 bytes each a count)."""


def _repair(
    near: np.ndarray,
    b0: int,
    prev: np.ndarray,
    tg_rows: np.ndarray,
    streams: Sequence[Stream],
    lanes: Lanes,
    room: tuple[np.ndarray, np.ndarray],
    prior: np.ndarray,
) -> list[PointerChunk]:
    """Defer segments of the source most ahead of target, one at a time, until every step fits its slots, and fill
    a step that draws nothing with the next segment of the source it leaves least ahead: steps b0..b0+len(tg_rows)-1,
    `near` their nearest pointer rows (row 0: step b0's nearest row), `prev` the repaired row before step b0,
    `prior` step b0 - 1's targets; returns the repaired rows as pointer chunks.

    Sequential by nature (a deferral moves a segment into the next step): a compiled pass over a chunk of steps
    at a time (_mixture_kernel.repair_rows), linear in steps and sources, over the window of each stream's
    counts those steps can reach (from the repaired pointer before the chunk to the nearest pointer after it:
    a deferral never goes below the pointer before its step; widened where a fill reads past it). It matches the
    original per-step loop exactly where no step draws nothing.
    """
    r, n_src = tg_rows.shape
    sl = np.ascontiguousarray(room[0][b0 : b0 + r], dtype=np.int64)
    gb = np.ascontiguousarray(room[1][b0 : b0 + r], dtype=np.int64)
    n_of = np.array([len(s.cum) for s in streams], dtype=np.int64)
    # several sources' windows are laid end to end (a copy): a chunk also ends once they would hold more than
    # REPAIR_WINDOW segments (sized from the nearest pointers; the repair only lowers them)
    drawn = near.sum(axis=1, dtype=np.int64) if n_src > 1 else None
    out: list[PointerChunk] = []
    lo = np.asarray(prev).copy()
    bufs: tuple[list[np.ndarray], list[np.ndarray]] = ([np.zeros(0, np.int64)], [np.zeros(0, np.int64)])
    c0 = 0
    while c0 < r:
        c1 = r
        if drawn is not None:
            fits = int(np.searchsorted(drawn, drawn[c0] + REPAIR_WINDOW, side="right")) - 1
            c1 = min(c1, max(c0 + 1, fits))
        chunk = near[c0 : c1 + 1].copy()
        chunk[0] = lo
        # still the nearest row (the chunk's last step sets it), or the row before, past it after a fill
        hi = np.maximum(chunk[-1], lo).astype(np.int64) + 1
        at = 0

        def before_of(i: int) -> np.ndarray:
            return prior if i == 0 else tg_rows[i - 1]

        while True:
            before = before_of(c0 + at)
            done = _repair_window(
                chunk, tg_rows[c0 + at : c1], streams, (lo, hi, n_of), (sl[c0:c1], gb[c0:c1]), lanes, at, before, bufs
            )
            if done >= c1 - c0:
                break
            # a fill reads past a window: through every source's pointer before the step plus a segment a step left
            at = done
            _refuse_run_out(b0 + c0 + at, chunk[at], tg_rows[c0 + at] > before_of(c0 + at), streams)
            hi = np.minimum(np.maximum(hi - 1, chunk[at]) + 2 + (c1 - c0 - at), n_of)
        out.append(compress_rows(chunk, b0 + c0))
        lo = chunk[-1].copy()
        c0 = c1
    return out


def _repair_window(
    chunk: np.ndarray,
    tg_rows: np.ndarray,
    streams: Sequence[Stream],
    reach: tuple[np.ndarray, np.ndarray, np.ndarray],
    room: tuple[np.ndarray, np.ndarray],
    lanes: Lanes,
    at: int,
    prior: np.ndarray,
    bufs: tuple[list[np.ndarray], list[np.ndarray]] = ([], []),
) -> int:
    """repair_rows over the chunk's steps from `at` on (`tg_rows` theirs, `room` the whole chunk's slots and token
    budgets), every
    source's counts at stream positions lo..hi-1 gathered (laid end to end; reach: lo, hi, the streams' lengths);
    the steps done (repair_rows' answer). `bufs`: where the counts and short counts are laid end to end, reused
    from one window to the next (empty lists: fresh arrays)."""
    lo, hi, n_of = reach
    cum, short, long_ = [], [], []
    for k, s in enumerate(streams):
        a, b = int(lo[k]), int(hi[k])
        cum.append(s.cum[a:b])
        short.append((s.cum if s.cum_short is None else s.cum_short)[a:b])
        long_.append(s.cum_long[a:b] if s.cum_long is not None else s.cum[:0])
    off_s = np.concatenate([[0], np.cumsum(hi.astype(np.int64) - lo)])
    off_l = np.concatenate([[0], np.cumsum([len(x) for x in long_])]).astype(np.int64)
    cum_w = _laid_end_to_end(cum, bufs[0])  # one source: its window itself; without a long lane short is cum
    short_w = cum_w if all(s.cum_short is None for s in streams) else _laid_end_to_end(short, bufs[1])
    return int(
        repair_rows(
            chunk,
            tg_rows,
            (cum_w, short_w, _laid_end_to_end(long_)),
            (off_s, off_l),
            lo.astype(np.int64),
            room[0],
            lanes.seq_len,
            (at, at + len(tg_rows)),
            np.ascontiguousarray(prior, dtype=np.float64),
            n_of,
            room[1],
        )
    )
