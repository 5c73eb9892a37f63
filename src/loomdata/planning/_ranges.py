"""Balance and write one contiguous range of steps: what one process (or one cluster worker) does after membership.

`PlanWork` is everything balancing needs once membership is done (the index columns, the streams, the step
pointers or look-ahead assignment, the shape, the cost model and the manifest partition bounds; the mixture
weights are the driver's report's); it is picklable (an all-zero image column travels as its length).
`window` cuts from it what one range of steps reads (its stream positions re-indexed from 0 with their
documents' index columns, its pointer rows): a cluster worker cuts its ranges' windows from the shared work it
maps (planning._distributed.SharedWork), another executor is sent each range's window.
`balanced_blocks` yields the balanced blocks of [first, stop) from a given
incoming carry (`balanced_steps` the same step by step, for the distributed fix-up); a step's result
depends only on its drawn segments and its incoming carry (blocks are
dealt jointly but element-wise per step: the golden plans are the same at any block size), which is what
lets ranges be balanced apart and stitched together. `plan_range` balances a range into its own manifest
partitions and a report over the range (`RangePart`), as a worker does.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from loomdata.planning._items import StepItems
from loomdata.planning._lookahead import StepAssignment
from loomdata.planning._manifest import ManifestWriter
from loomdata.planning._mixture import Stream
from loomdata.planning._packing import no_image_tokens
from loomdata.planning._pointers import Pointers
from loomdata.planning._report import RANK_STEPS, ReportBuilder
from loomdata.planning._segments import DenseIds, RowIds, SampleIds, Segments
from loomdata.planning._step import StepSink
from loomdata.planning.balance import BalanceConfig, BalancedBlock, BalancedStep, balance_span
from loomdata.schemas.plan import ManifestFile

__all__ = [
    "PlanWork",
    "RangePart",
    "balanced_blocks",
    "balanced_steps",
    "merge_report",
    "plan_range",
    "same_carry",
    "window",
]


@dataclass(frozen=True, kw_only=True)
class PlanWork:
    """What balancing steps start..steps-1 needs, fixed once membership is done (sent to workers as is)."""

    plan_id: str
    names: list[str]
    samples: Sequence[SampleIds | RowIds]  # RowIds in a window
    num_tokens: list[np.ndarray]
    num_image_tokens: list[np.ndarray]
    streams: list[Stream]  # without their counts
    ptr: Pointers  # (steps + 1, sources) stream positions before each step (row i: step step0 + i), sparse
    assignment: StepAssignment | None  # look-ahead membership, or None (ptr ranges)
    cfg: BalanceConfig
    start: int  # first step planned here (a re-plan's at_step, else 0)
    steps: int
    bounds: np.ndarray  # manifest partition bounds (_manifest.file_bounds), `start` among them
    pp_size: int
    step0: int = 0  # the step of ptr's row 0 (a range's window: its first step)
    windowed: bool = False  # a range's window (`window`): its streams' documents are 0..n-1 in stream order

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["num_image_tokens"] = [_wire_column(a) for a in self.num_image_tokens]
        if self.windowed:  # a window's documents are 0..n-1: sent as n
            state["streams"] = [(len(st.doc), st.doc.dtype.str, replace(st, doc=_NO_DOCS)) for st in self.streams]
            if self.assignment is not None:  # its steps (non-decreasing, within the window's) as counts a step
                state["assignment"] = _AssignedCounts.of(self.assignment, self.step0, self.rows)
        return _restore, (state,)

    @property
    def rows(self) -> int:
        """Steps this work holds (a range's window: its steps; else every step of the plan)."""
        return len(self.ptr) - 1

    def items(self) -> StepItems:
        """A fresh gatherer of the steps' segments and costs."""
        return StepItems(
            self.samples,
            self.num_tokens,
            self.num_image_tokens,
            self.streams,
            self.ptr,
            self.cfg.lanes,
            self.cfg.cost_spec,
            self.assignment,
            self.step0,
        )

    def sink(self, writer: ManifestWriter, report: ReportBuilder, report_from: int = 0) -> StepSink:
        """Where balanced steps go: `writer` and `report` (whose step 0 is step `report_from`)."""
        return StepSink(
            writer=writer,
            report=report,
            dp=self.cfg.dp,
            micro_batches=self.cfg.micro_batches,
            n_sources=len(self.names),
            report_from=report_from,
        )

    def bound_after(self, step: int) -> int:
        """First step of the manifest partition after the one holding `step` (the step count after the last)."""
        return int(self.bounds[np.searchsorted(self.bounds, step, side="right")])


def _wire_column(a: np.ndarray) -> np.ndarray | int:
    """An all-zero column (text only: the common case) as its length; any other column as is."""
    zero = a.strides == (0,) and (len(a) == 0 or not a[0]) if a.ndim == 1 else False
    return len(a) if zero or not a.any() else a


_NO_DOCS = np.zeros(0, dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class _AssignedCounts:
    """A window's look-ahead assignment on the wire: its positions, and each source's steps (non-decreasing) as
    how many positions each step of the window holds where that is smaller than the steps themselves (a source
    drawing in most steps: 4 bytes a step instead of 4 a position), else the steps as they are (with many
    sources and a small dp a source draws in few steps: counts of every step would grow with steps x sources)."""

    pos: list[np.ndarray]
    counts: list[np.ndarray | None]  # (steps of the window,) positions of each step; None: `steps[k]` sent as is
    steps: list[np.ndarray | None]  # the source's steps, where counts are not sent
    step_dtypes: list[str]
    step0: int

    @classmethod
    def of(cls, asg: StepAssignment, step0: int, steps: int) -> _AssignedCounts | StepAssignment:
        """The counts of `asg` (steps step0..step0+steps-1); `asg` itself when a step falls outside them."""
        counts: list[np.ndarray | None] = []
        raw: list[np.ndarray | None] = []
        for k, st in enumerate(asg.step):
            if len(st) and (int(st[0]) < step0 or int(st[-1]) >= step0 + steps):
                return asg
            dense = steps <= len(st)
            counts.append(asg.source_counts(k, step0, steps).astype(np.uint32) if dense else None)
            raw.append(None if dense else st)
        return cls(asg.pos, counts, raw, [st.dtype.str for st in asg.step], step0)

    def restore(self) -> StepAssignment:
        steps = [
            np.repeat(np.arange(self.step0, self.step0 + len(c), dtype=np.dtype(dt)), c)
            if c is not None
            else _aligned(np.asarray(st))
            for c, st, dt in zip(self.counts, self.steps, self.step_dtypes, strict=True)
        ]
        return StepAssignment([_aligned(p) for p in self.pos], steps)


def _restore(state: dict[str, Any]) -> PlanWork:
    """The work from its pickled state; arrays Dask received out of band may sit unaligned in its frames
    (NumPy is then slower on them): those are copied."""
    if state.get("windowed"):
        state["streams"] = [replace(st, doc=np.arange(n, dtype=np.dtype(dt))) for n, dt, st in state["streams"]]
        if isinstance(state["assignment"], _AssignedCounts):
            state["assignment"] = state["assignment"].restore()
    state["num_image_tokens"] = [
        np.broadcast_to(np.zeros(1, np.uint32), (a,)) if isinstance(a, int) else _aligned(a)
        for a in state["num_image_tokens"]
    ]
    state["num_tokens"] = [_aligned(a) for a in state["num_tokens"]]
    state["samples"] = [
        _aligned(a) if isinstance(a, np.ndarray) else RowIds(_aligned(a.rows)) if isinstance(a, RowIds) else a
        for a in state["samples"]
    ]
    state["streams"] = [
        replace(
            st,
            doc=_aligned(st.doc),
            split_pos=_aligned(st.split_pos),
            split_off=_aligned(st.split_off),
            split_len=_aligned(st.split_len),
        )
        for st in state["streams"]
    ]
    state["ptr"] = state["ptr"].aligned()
    return PlanWork(**state)


def _aligned(a: np.ndarray) -> np.ndarray:
    return a if a.flags.aligned else a.copy()


def window(work: PlanWork, first: int, stop: int) -> PlanWork:
    """What balancing steps first..stop-1 reads of `work`, alone: per source the window of stream positions those
    steps draw from, re-indexed from 0 (documents 0..n-1 in stream order, their index columns gathered), their
    look-ahead assignment, and the pointer and weight rows of those steps (step0 = first). Balancing the
    range on it gives the same bytes as on the whole work; it holds about 16 bytes a position of the range
    (tokens, sample rows, assigned positions and steps) instead of the whole index and streams."""
    if not work.step0 <= first < stop <= work.step0 + work.rows:
        raise ValueError(f"steps {first}..{stop - 1} are not within the work's steps")
    if work.windowed:
        raise ValueError("a window cannot be cut from a window")
    n_src = len(work.streams)
    lo = np.zeros(n_src, dtype=np.int64)
    samples: list[SampleIds | RowIds] = []
    tokens: list[np.ndarray] = []
    images: list[np.ndarray] = []
    streams: list[Stream] = []
    pos_w: list[np.ndarray] = []
    step_w: list[np.ndarray] = []
    rows = None if work.assignment is not None else (work.ptr.row(first - work.step0), work.ptr.row(stop - work.step0))
    for k, st in enumerate(work.streams):
        if work.assignment is not None:
            pos, steps = work.assignment.range(k, first, stop)
            a, b = (int(pos.min()), int(pos.max()) + 1) if len(pos) else (0, 0)
            pos_w.append(pos - np.asarray(a, dtype=pos.dtype))
            step_w.append(steps)
        else:
            if rows is None:
                raise AssertionError("pointer rows are read where there is no assignment")
            a, b = int(rows[0][k]), int(rows[1][k])
        lo[k] = a
        doc = st.doc[a:b]
        ids = work.samples[k]
        samples.append(RowIds(doc.copy()) if isinstance(ids, DenseIds) else ids[doc])
        tokens.append(work.num_tokens[k][doc])
        img = work.num_image_tokens[k]
        images.append(np.broadcast_to(np.zeros(1, img.dtype), (b - a,)) if no_image_tokens(img) else img[doc])
        i, j = np.searchsorted(st.split_pos, [a, b])
        streams.append(
            replace(
                st,
                doc=np.arange(b - a, dtype=st.doc.dtype),
                split_pos=st.split_pos[i:j] - a,
                split_off=st.split_off[i:j],
                split_len=st.split_len[i:j],
            )
        )
    return replace(
        work,
        samples=samples,
        num_tokens=tokens,
        num_image_tokens=images,
        streams=streams,
        ptr=work.ptr.window(first - work.step0, stop - work.step0, lo),
        assignment=None if work.assignment is None else StepAssignment(pos_w, step_w),
        step0=first,
        windowed=True,
    )


def balanced_blocks(work: PlanWork, first: int, stop: int, carry: Segments | None) -> Iterator[BalancedBlock]:
    """Balanced blocks of consecutive steps covering first..stop-1 in order, `carry` going first into step
    `first` (a block ends at a gathered block's end, at `stop`, or at a step that defers)."""
    items = work.items()
    t = first
    while t < stop:
        end = min(items.block(t).stop, stop)
        segs, cost, off = items.span(t, end)
        blk = balance_span(range(t, end), segs, cost, off, carry, work.cfg)
        yield blk
        carry = blk.carry
        t = blk.steps.stop


def balanced_steps(work: PlanWork, first: int, stop: int, carry: Segments | None) -> Iterator[tuple[int, BalancedStep]]:
    """(step, balanced step) for steps first..stop-1 in order, `carry` going first into step `first`; the caller
    may stop early (a block is balanced when its first step is taken)."""
    for blk in balanced_blocks(work, first, stop, carry):
        for k, t in enumerate(blk.steps):
            yield t, blk.step(k)


@dataclass(frozen=True, slots=True, kw_only=True)
class RangePart:
    """A balanced range [first, stop): its manifest partitions, its report rows, what each step carried out."""

    first: int
    stop: int
    files: list[ManifestFile]
    report: ReportBuilder  # over the range: its step i is step first + i
    carries: dict[int, Segments]  # step -> what it deferred into the next step (steps that deferred only)
    cpu_seconds: float = 0.0  # CPU time balancing and writing it took (thread time, where it ran)
    worker: str = ""  # where it ran ("host:pid"), for per-worker figures
    span: tuple[float, float] = (0.0, 0.0)  # wall clock (time.time()) when balancing it began and ended there

    @property
    def final_carry(self) -> Segments | None:
        """What the range's last step carries into the next range."""
        return self.carries.get(self.stop - 1)


def range_report(work: PlanWork, first: int, stop: int) -> ReportBuilder:
    """An empty report over steps first..stop-1 (indexed from 0) that keeps the per-rank costs the plan keeps."""
    rank_from = work.start - first if first - work.start < RANK_STEPS else stop - first
    lanes = work.cfg.lanes
    capacity = work.cfg.dp * work.cfg.micro_batches * max(lanes.seq_len, lanes.long_seq_len or 0)
    return ReportBuilder(
        stop - first, work.names, work.cfg.dp, rank_from=rank_from, pp_size=work.pp_size, step_tokens=capacity
    )


def plan_range(work: PlanWork, out: Path, first: int, stop: int, carry: Segments | None = None) -> RangePart:
    """Balance steps first..stop-1 (a partition bound and the bound or step count ending a later one) with
    `carry` into the first, write their manifest partitions under `out`, return their figures and carries."""
    cpu, began = time.thread_time(), time.time()
    writer = ManifestWriter(out, work.plan_id, work.bounds, first_step=first)
    report = range_report(work, first, stop)
    sink = work.sink(writer, report, report_from=first)
    carries: dict[int, Segments] = {}
    for blk in balanced_blocks(work, first, stop, carry):
        sink.add_block(blk)
        if blk.carry is not None:
            carries[blk.steps.stop - 1] = blk.carry
    files = writer.close(stop - 1)
    cpu = time.thread_time() - cpu
    where = f"{socket.gethostname()}:{os.getpid()}"
    return RangePart(
        first=first,
        stop=stop,
        files=files,
        report=report,
        carries=carries,
        cpu_seconds=cpu,
        worker=where,
        span=(began, time.time()),
    )


def merge_report(into: ReportBuilder, part: ReportBuilder, first: int) -> None:
    """Copy a range report's rows (its step i is step first + i) into the plan's report."""
    n = len(part.tokens)
    into.tokens.put(first, part.tokens.rows(0, n))
    for name, col in part.cols.items():
        into.cols[name][first : first + n] = col
    if part.part_cols:  # encoder/backbone columns (cost models with an encoder term)
        if not into.part_cols:
            into.part_cols.update({k: np.zeros(len(into.tokens)) for k in part.part_cols})
        for name, col in part.part_cols.items():
            into.part_cols[name][first : first + n] = col
        into._balance = part._balance
    # a range report's per-rank row i is step start + i, as the plan's (range_report picks its rank_from so)
    lo, hi = max(first - into.rank_from, 0), min(first + n - into.rank_from, len(into.rank_loom))
    for dst, src in (
        (into.rank_loom, part.rank_loom),
        (into.rank_concat, part.rank_concat),
        (into.rank_packed, part.rank_packed),
    ):
        dst[lo:hi] = src[lo:hi]


def same_carry(a: Segments | None, b: Segments | None) -> bool:
    """Whether two carries are the same segments (both none, or equal columns of equal types)."""
    if a is None or b is None:
        return a is b
    return all(
        x.dtype == y.dtype and np.array_equal(x, y)
        for x, y in (
            (a.source, b.source),
            (a.sample, b.sample),
            (a.offset, b.offset),
            (a.length, b.length),
            (a.lane, b.lane),
            (a.image_tokens, b.image_tokens),
        )
    )
