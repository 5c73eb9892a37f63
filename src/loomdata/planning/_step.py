"""Balanced steps into the plan: their manifest rows and report figures (loomdata vs both baselines), a block
at a time (`add_block`, NumPy over the block) or one step (`add`, the distributed fix-up's path)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning._counts import Pieces
from loomdata.planning._manifest import ManifestWriter
from loomdata.planning._report import BlockFigures, ReportBuilder, StepFigures
from loomdata.planning._report_kernel import run_sums
from loomdata.planning._step_kernel import rank_max_item as rank_max_item_of
from loomdata.planning.balance import BalancedBlock, BalancedStep

__all__ = ["StepSink", "own_offsets", "report_tokens"]


def report_tokens(pieces: Pieces, n_sources: int) -> Pieces | np.ndarray:
    """A block's tokens per (step, source) for the report: the placed pieces themselves where the block's
    (steps x sources) cells outnumber them (many sources, small dp: added into the sparse counts), else those
    cells (same counts either way)."""
    return pieces if pieces.steps * n_sources > len(pieces.step) else pieces.dense(n_sources)


def own_offsets(off: np.ndarray, in_step: np.ndarray) -> np.ndarray:
    """Where each step's own segments start once those not in their step (`in_step` False) are left out: each
    step's start `off` moved back by the segments left out before it (a search over the few left out, not a
    count of every segment by step)."""
    return off - np.searchsorted(np.flatnonzero(~in_step), off, side="left")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSink:
    """Where balanced steps go: the manifest writer and the report, with the shape both need."""

    writer: ManifestWriter
    report: ReportBuilder
    dp: int
    micro_batches: int
    n_sources: int
    report_from: int = 0  # the report's step 0 is this step (a range's own report, planning._ranges)

    def add_block(self, blk: BalancedBlock) -> None:
        """Write a block's manifest rows and record its figures, with a few NumPy calls for the whole block (the
        same bytes as add step by step)."""
        n, dp, rs, item = len(blk.steps), self.dp, blk.row_step, blk.item
        segs = blk.segs
        placed_src = segs.source[item]
        self.writer.add_block(
            blk.steps,
            rs,
            {
                "dp_rank": blk.rank,
                "micro_batch": blk.micro_batch,
                "source": placed_src,
                "length": blk.length,
                "lane": blk.lane,
            },
            take=(item, {"sample": segs.sample, "offset": segs.offset}),
            offset_delta=blk.delta,
        )
        # rows are sorted by (step, rank): one pass gives each rank's largest segment
        rank_max_item = rank_max_item_of(rs, blk.rank, item, np.ascontiguousarray(blk.cost, dtype=np.float64), n, dp)
        own, own_off = blk.cost, blk.off
        if blk.in_step is not None:  # segments wholly deferred are not part of their step
            own = blk.cost[blk.in_step]
            own_off = own_offsets(blk.off, blk.in_step)
        total, top = run_sums(np.ascontiguousarray(own, dtype=np.float64), own_off)
        if len(total) < n:
            raise ValueError("a step without segments")
        tokens = report_tokens(Pieces(n, rs, placed_src, blk.length), self.n_sources)
        deferred = np.zeros(n, dtype=np.int64)
        if blk.carry is not None:
            deferred[-1] = int(blk.carry.length.sum())
        fig = BlockFigures(
            tokens=tokens,
            lb=np.maximum(total / dp, top),
            loom_rank=blk.rank_cost,
            concat_rank=blk.concat_rank,
            packed_rank=blk.packed_rank,
            slot_cost=blk.slot_cost,
            packed_waiting_tokens=blk.packed_waiting,
            deferred_tokens=deferred,
            rank_max_item=rank_max_item.reshape(n, dp),
            parts=None if blk.parts is None else list(blk.parts),
        )
        self.report.add_block(blk.steps.start - self.report_from, fig)

    def add(self, t: int, b: BalancedStep) -> None:
        """Write step t's manifest rows and record its figures."""
        segs, asg, dp = b.segs, b.asg, self.dp
        step_cost = b.cost if b.in_step is None else b.cost[b.in_step]
        placed_src = segs.source[asg.item]
        self.writer.add(
            t,
            {
                "dp_rank": asg.rank,
                "micro_batch": asg.micro_batch,
                "source": placed_src,
                "sample": segs.sample[asg.item],
                "offset": segs.offset[asg.item].astype(np.int64) + asg.delta,
                "length": asg.length,
                "lane": asg.lane,
            },
        )
        rank_max_item = np.zeros(dp)
        if len(asg.rank):  # rows are sorted by rank: one reduceat gives each rank's largest segment
            change = np.empty(len(asg.rank), dtype=bool)
            change[0] = True
            np.not_equal(asg.rank[1:], asg.rank[:-1], out=change[1:])
            starts = change.nonzero()[0]
            rank_max_item[asg.rank[starts]] = np.maximum.reduceat(b.cost[asg.item], starts)
        fig = StepFigures(
            tokens=np.bincount(placed_src, weights=asg.length, minlength=self.n_sources).astype(np.int64),
            lb=max(float(step_cost.sum()) / dp, float(step_cost.max())),
            loom_rank=asg.rank_cost,
            concat_rank=b.concat_rank,
            packed_rank=b.packed_rank,
            slot_cost=asg.slot_cost,
            packed_waiting_tokens=b.packed_waiting,
            deferred_tokens=0 if b.carry is None else int(b.carry.length.sum()),
            rank_max_item=rank_max_item,
            parts=b.parts,
        )
        self.report.add(t - self.report_from, fig)
