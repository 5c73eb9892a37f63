"""A step's segments and their costs, gathered for a block of consecutive steps at once.

Step t's items are, source by source, the stream positions [ptr[t, k], ptr[t+1, k]) of every source k
(Segments: source id, sample, offset, length, lane, image tokens) and their costs. Gathering them step by step costs
a dozen small NumPy calls per source and step, which dominates at small dp (many steps, few segments
each); here one block of steps (about BLOCK_SEGMENTS segments) is gathered with one call per column and
source and laid out step-major (within a step: source order, then stream order), so a step's items are
one contiguous slice. Every value is computed element-wise exactly as for a single step, so the items
and costs are the same bytes. With look-ahead membership (`assignment`, see _lookahead) a step's segments
of a source are the positions assigned to it instead of one pointer range; the layout is the same, and where no
source has images and every source's sample ids are uint64 (as indexes give them) each source's segments are
written straight into their steps' places (`_placed`, _items_kernel), with no sort.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.planning._cost import segment_cost
from loomdata.planning._items_kernel import place_assigned
from loomdata.planning._lookahead import StepAssignment, segments_at, stable_order
from loomdata.planning._mixture import Stream
from loomdata.planning._packing import Lanes
from loomdata.planning._pointers import Pointers
from loomdata.planning._segments import DenseIds, RowIds, SampleIds, Segments
from loomdata.schemas.spec import CostSpec

__all__ = ["BLOCK_SEGMENTS", "StepItems", "block_segments"]

BLOCK_SEGMENTS = 1 << 16
"""Segments gathered per block (bounds the block's memory); a block holds at least one step."""
SEGMENTS_PER_SOURCE = 1 << 10
"""With many sources a block holds at least this many segments a source (up to MAX_BLOCK_SEGMENTS): gathering
costs a few NumPy calls per source and block (300 sources at dp 4, 2M samples: 2^18 segments a block took
0.92-0.95x the CPU of 2^16, the same bytes; results/plan_scale_s8.json)."""
MAX_BLOCK_SEGMENTS = 1 << 18


def block_segments(n_sources: int) -> int:
    """Segments gathered per block with `n_sources` sources."""
    return max(BLOCK_SEGMENTS, min(MAX_BLOCK_SEGMENTS, SEGMENTS_PER_SOURCE * n_sources))


class StepItems:
    """Items and costs of steps start..end-1 in order, gathered a block of steps at a time."""

    def __init__(
        self,
        samples: Sequence[SampleIds | RowIds],
        num_tokens: Sequence[np.ndarray],
        num_image_tokens: Sequence[np.ndarray],
        streams: Sequence[Stream],
        ptr: Pointers,
        lanes: Lanes,
        cost_spec: CostSpec,
        assignment: StepAssignment | None = None,
        step0: int = 0,
    ) -> None:
        self._samples = samples
        self._tokens = num_tokens
        self._images = num_image_tokens
        self._streams = streams
        self._ptr = ptr
        self._lanes = lanes
        self._cost_spec = cost_spec
        self._asg = assignment
        self._step0 = step0  # the step of ptr's row 0 (a range's window: planning._ranges.window)
        if assignment is None:
            self._seg_end = ptr.totals()  # segments drawn before step t (all sources)
        else:
            self._seg_end = np.concatenate([[0], np.cumsum(_counts(assignment, step0, len(ptr) - 1))])
        self._placing = assignment is not None and self._can_place()
        self._first = 0
        self._bounds = np.zeros(1, dtype=np.int64)  # block-relative start of each step of the block, and end
        self._cols: tuple[np.ndarray, ...] = ()

    def block(self, t: int) -> range:
        """The steps gathered with step t (gathering them if needed; t must not go backwards)."""
        if not 0 <= t - self._first < len(self._bounds) - 1:
            self._gather(t)
        return range(self._first, self._first + len(self._bounds) - 1)

    def step(self, t: int) -> tuple[Segments, np.ndarray]:
        """Step t's segments and their costs (t must not go backwards)."""
        i = t - self.block(t).start
        a, b = int(self._bounds[i]), int(self._bounds[i + 1])
        src_id, sample, offset, length, lane, img, cost = (c[a:b] for c in self._cols)
        return Segments(src_id, sample, offset, length, lane, img), cost

    def span(self, t: int, stop: int) -> tuple[Segments, np.ndarray, np.ndarray]:
        """Steps t..stop-1 (within step t's block) laid out flat: their segments, costs, and where each step's
        segments start (stop - t + 1 offsets, from 0)."""
        i = t - self.block(t).start
        j = stop - self._first
        if not i < j < len(self._bounds):
            raise ValueError(f"steps {t}..{stop - 1} are not within one gathered block")
        a, b = int(self._bounds[i]), int(self._bounds[j])
        src_id, sample, offset, length, lane, img, cost = (c[a:b] for c in self._cols)
        return Segments(src_id, sample, offset, length, lane, img), cost, self._bounds[i : j + 1] - a

    def _gather(self, t0: int) -> None:
        """Gather the block of steps from t0 on that holds about block_segments() segments (at least one step)."""
        s0 = self._step0
        last = s0 + len(self._ptr) - 1
        end = self._seg_end[t0 - s0] + block_segments(len(self._streams))
        t1 = s0 + int(np.searchsorted(self._seg_end, end, side="right")) - 1
        t1 = min(max(t1, t0 + 1), last)
        if self._placing:  # step-major as gathered (see _items_kernel)
            src_id, sample, offset, length, lane, img = self._placed(t0, t1)
            cost = segment_cost(length, img, self._cost_spec, self._lanes.cp_sizes(lane))
            self._cols = (src_id, sample, offset, length, lane, img, cost)
            self._bounds = self._seg_end[t0 - s0 : t1 - s0 + 1] - self._seg_end[t0 - s0]
            self._first = t0
            return
        parts = [] if self._asg is None else [self._assigned(t0, t1)]
        first, last_row = (self._ptr.row(t0 - s0), self._ptr.row(t1 - s0)) if self._asg is None else (None, None)
        for k, st in enumerate(self._streams if self._asg is None else ()):
            if first is None or last_row is None:
                raise AssertionError("pointer rows are gathered where there is no assignment")
            a, b = int(first[k]), int(last_row[k])
            if b <= a:
                continue
            doc, off, length, lane = st.segments(a, b, self._tokens[k], self._lanes)
            img = self._image_tokens(k, doc, length)
            ids = np.full(b - a, k, dtype=np.uint16)
            # the step of each segment: its position against the source's step boundaries
            col = self._ptr.column(k, t0 - s0, t1 - s0)
            step = np.searchsorted(col - np.asarray(a, dtype=col.dtype), np.arange(b - a), side="right") - 1
            parts.append((ids, self._samples[k][doc], off, length.astype(np.int64), lane, img, step))
        cols = [c[0] if len(parts) == 1 else np.concatenate(c) for c in zip(*parts, strict=True)]
        step_of = cols[-1]
        if len(step_of) > 1 and not (step_of[1:] >= step_of[:-1]).all():  # already so: one source
            order = stable_order(step_of, 0, t1 - t0)  # step-major; within a step source order, then stream order
            cols = [c[order] for c in cols]
        src_id, sample, offset, length, lane, img, step_of = cols
        cost = segment_cost(length, img, self._cost_spec, self._lanes.cp_sizes(lane))
        self._cols = (src_id, sample, offset, length, lane, img, cost)
        self._bounds = np.searchsorted(step_of, np.arange(t1 - t0 + 1), side="left")
        self._first = t0

    def _can_place(self) -> bool:
        """Whether `_placed` gathers this plan's blocks: no images anywhere (zeros of one type) and every source's
        sample ids dense, a dense index's rows, or stored as uint64 (the types `_assigned` gives: the same bytes)."""
        k_all = range(len(self._streams))
        if not all(self._no_images(k) for k in k_all) or len({self._images[k].dtype for k in k_all}) > 1:
            return False
        return all(
            isinstance(ids, DenseIds | RowIds) or (isinstance(ids, np.ndarray) and ids.dtype == np.uint64)
            for ids in self._samples
        )

    def _placed(self, t0: int, t1: int) -> tuple[np.ndarray, ...]:
        """The columns of the segments assigned to steps t0..t1-1 (look-ahead membership) already step-major: a
        step's segments are placed source by source where its run starts (the assignment's counts) by one compiled
        pass a source (_items_kernel.place_assigned), no sort. The values and types of `_assigned`'s columns put
        in step order."""
        asg = self._asg
        if asg is None:
            raise AssertionError("no assignment to gather from")
        s0 = self._step0
        start = self._seg_end[t0 - s0 : t1 - s0 + 1] - self._seg_end[t0 - s0]
        n = int(start[-1])
        if n == 0:
            raise AssertionError(f"steps {t0}..{t1 - 1} have no segments assigned")
        nxt = start[:-1].copy()
        src = np.empty(n, dtype=np.uint16)
        sample = np.empty(n, dtype=np.uint64)
        offset = np.empty(n, dtype=np.uint32)
        length = np.empty(n, dtype=np.int64)
        lane = np.empty(n, dtype=np.uint8)
        threshold = -1 if self._lanes.threshold is None else int(self._lanes.threshold)
        no_ids = np.zeros(0, dtype=np.uint64)
        for k, st in enumerate(self._streams):
            ids = self._samples[k]
            dense = isinstance(ids, DenseIds)
            col = no_ids if isinstance(ids, DenseIds) else ids.rows if isinstance(ids, RowIds) else ids
            placed = place_assigned(
                st.doc, asg.pos[k], asg.step[k], t0, t1, self._tokens[k], st.split_pos, st.split_off,
                st.split_len, threshold, col, dense, k, nxt, src, sample, offset, length, lane,
            )  # fmt: skip
            if placed < 0:  # (an internal error: counts and steps are the same assignment's, its steps sorted)
                raise AssertionError(
                    f"steps {t0}..{t1 - 1}: source {k}'s segments do not match the assignment's counts"
                )
        if not np.array_equal(nxt, start[1:]):
            raise AssertionError(f"steps {t0}..{t1 - 1}: the sources' segments do not match the assignment's counts")
        return src, sample, offset, length, lane, np.zeros(n, dtype=self._images[0].dtype)

    def _assigned(self, t0: int, t1: int) -> tuple[np.ndarray, ...]:
        """The columns of the segments assigned to steps t0..t1-1 (look-ahead membership), source after source
        (each source's in step-major, stream order) with each one's step from t0: per source only the gather and
        its sample ids; the source ids, int64 lengths, steps and (no images anywhere) image tokens made once for
        all sources, the same values and types as made source by source."""
        asg = self._asg
        if asg is None:
            raise AssertionError("no assignment to gather from")
        # (a block always holds a step, and every step draws: empty steps are a PlanError before balancing)
        ks: list[int] = []
        samples, offsets, lengths, lanes, images, steps = [], [], [], [], [], []
        no_images = all(self._no_images(k) for k in range(len(self._streams))) and (
            len({self._images[k].dtype for k in range(len(self._streams))}) == 1  # (zeros of one type, as before)
        )
        for k, st in enumerate(self._streams):
            pos, at = asg.range(k, t0, t1)
            if len(pos) == 0:
                continue
            doc, off, length, lane = segments_at(st, pos, self._tokens[k], self._lanes)
            ks.append(k)
            samples.append(self._samples[k][doc])
            offsets.append(off)
            lengths.append(length)
            lanes.append(lane)
            steps.append(at)
            if not no_images:
                images.append(self._image_tokens(k, doc, length))
        if not ks:
            raise AssertionError(f"steps {t0}..{t1 - 1} have no segments assigned")
        sample, offset, length, lane, step = (
            c[0] if len(c) == 1 else np.concatenate(c) for c in (samples, offsets, lengths, lanes, steps)
        )
        if no_images:
            img = np.zeros(len(length), dtype=self._images[ks[0]].dtype)
        else:
            img = images[0] if len(images) == 1 else np.concatenate(images)
        ids = np.repeat(np.asarray(ks, dtype=np.uint16), [len(x) for x in offsets])
        return ids, sample, offset, length.astype(np.int64), lane, img, step - t0

    def _no_images(self, k: int) -> bool:
        """Source k's image column is a broadcast zero (no gather needed)."""
        images = self._images[k]
        return bool(images.strides == (0,) and (len(images) == 0 or not images[0]))

    def _image_tokens(self, k: int, doc: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Image tokens of segments of documents `doc` of source k (a split piece has none): zeros without a
        gather where the source has no images (its column a broadcast zero)."""
        images = self._images[k]
        if images.strides == (0,) and (len(images) == 0 or not images[0]):
            return np.zeros(len(doc), dtype=images.dtype)
        return np.where(length == self._tokens[k][doc], images[doc], 0)


def _counts(asg: StepAssignment, step0: int, steps: int) -> np.ndarray:
    """(steps,) segments assigned to steps step0..step0+steps-1, all sources together (asg.counts from step0)."""
    return asg.counts(steps, step0)
