"""One balanced step into the plan: its manifest rows and its report figures (loomdata vs both baselines)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning._manifest import ManifestWriter
from loomdata.planning._report import ReportBuilder, StepFigures
from loomdata.planning.balance import BalancedStep

__all__ = ["StepSink"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSink:
    """Where balanced steps go: the manifest writer and the report, with the shape both need."""

    writer: ManifestWriter
    report: ReportBuilder
    dp: int
    micro_batches: int
    n_sources: int
    report_from: int = 0  # the report's step 0 is this step (a range's own report, planning._ranges)

    def add(self, t: int, weights: np.ndarray, b: BalancedStep) -> None:
        """Write step t's manifest rows and record its figures (target mixture `weights`)."""
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
            weights=weights,
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
