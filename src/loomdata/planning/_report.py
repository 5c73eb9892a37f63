"""Per-step plan figures (loomdata vs two baselines, pipeline bubble, realized vs target mixture), the
summary, the plot.

Stored in the plan dir so `loom inspect` never recomputes: `report/steps.parquet` (one row per step:
tokens, LB, max and mean rank cost for loomdata and for both baselines of planning._baselines:
`concat_*` (Megatron-style concat-and-chunk) and `packed_*` (shuffled packing, exactly micro_batches
sequences per rank, overflow waits: `packed_waiting_tokens`), `base_max` = the stronger (lower) of the
two baselines' max for that step, micro-batch spread (mean over ranks of max micro-batch cost /
max(mean micro-batch cost, largest segment of the rank): 1.0 is as even as the rank's segments allow),
pipeline time `pp_time` and `pp_time_even`, tokens deferred to the next step), `report/sources.parquet` (the
tokens of each source in each step, one row per (step, source) cell that places any, step-major),
`report/weights.parquet` (the target weight of every source, a row at the first step and at each step whose
weights differ from the step before's: one row for a fixed mixture; `source_columns` reads both back as dense
columns of a step range, as well as version 8's `tokens__<name>` / `weight__<name>` columns of the steps table)
and `report/ranks.parquet` (per-rank cost of the first steps, for the plot).

Imbalance is max rank cost / LB with LB = max(total cost / dp_size, largest segment cost); a gain is
sum(max_baseline) / sum(max_loomdata) over all steps (step time is set by the most loaded rank); the
headline `simulated_gain` is against the stronger baseline overall (the lower sum), and
`gain.per_step_vs_stronger` the distribution of min(concat_max, packed_max) / loom_max per step.
Pipeline (1F1B, training.pp_size stages): a rank's step takes its micro-batches' sum plus a bubble of
(pp - 1) x its slowest micro-batch (warm-up and cool-down run at the pace of the slowest), so
pp_time = max over ranks of (rank cost + (pp - 1) x max micro-batch cost); pp_time_even is the same
with every micro-batch at its rank's mean; the summary gives the bubble's share of pp_time and how much
longer uneven micro-batches make the step (pp_time / pp_time_even - 1); with pp_size 1 both are 0.
The mixture error of step t is |realized cumulative share - target cumulative share| in percentage
points; the reported worst error is over steps >= 20. With a long lane of cp > 1, `plan_report` adds
`context_parallel` (planning._cp_report: each long sequence's CP ranks priced in the served layout),
computed from the manifest a partition at a time when asked, never stored. Readers never load a report
table whole: `plan_report(plan_dir, steps=(first, last))` (`loom inspect --steps FIRST:LAST`) adds
`step_range` (step_range_figures: the steps table's rows of the range, the ranks table, steps x dp rows, a
row group at a time), and plot_plan reads the columns it draws and the heatmaps' steps only.
Shuffle (summary `shuffle`, per source, planning._shuffle.ShuffleFigures): the shuffle mode and blocks,
`spearman` (rank correlation of storage position and plan position: ~0 is no file-order trend),
`mean_jump_docs` / `mean_jump_share` (storage distance of consecutive planned documents), and
`read_amplification` / `fetches_per_segment` of a reader fetching whole blocks and keeping `window` of
them (bytes fetched per byte delivered, bytes estimated as tokens).
Encoder and backbone (only when the cost model has an encoder term, CostSpec.has_encoder; summary `hybrid`):
per step the encoder part (image tokens) and the backbone part (text and placeholder tokens) of every rank's
load, for loomdata and both baselines (`{loom,concat,packed}_{enc,bb}_{max,mean}`, `enc_lb`, `bb_lb`: each
part's LB), and in the summary per system each part's max/mean and max/LB, the hybrid objective
max(enc max / enc LB, bb max / bb LB) (what `cost.balance: both` minimizes), the hybrid step time
`step_time` = sum over steps of bb mean x max(enc max / enc mean, bb max / bb mean) (encoder and backbone
on different stages, each sized so that its mean per-rank load takes the same time: the step waits for
the slower stage; in backbone cost units) with its `gain` over each baseline, and `step_time_equal_speed`
= sum over steps of max(enc max, bb max) (both stages at the same speed: the backbone dominates).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from loomdata.planning._counts import DenseCounts, Pieces, SparseCounts, StepCounts
from loomdata.planning._counts_kernel import step_sums
from loomdata.planning._cp_report import cp_figures
from loomdata.planning._mixture import StepWeights
from loomdata.planning._report_kernel import mixture_shares, mixture_steps, running_totals
from loomdata.planning._transpose_kernel import transposed
from loomdata.schemas.plan import read_plan
from loomdata.schemas.tables import (
    ReadCount,
    TableKind,
    iter_steps,
    read_steps,
    step_span,
    write_table,
    write_table_parts,
)

__all__ = [
    "BlockFigures",
    "PartFigures",
    "ReportBuilder",
    "StepFigures",
    "plan_report",
    "plot_plan",
    "source_columns",
    "step_range_figures",
]

RANK_STEPS = 64  # per-rank costs are kept for this many first steps (the plot's heatmaps)
MIXTURE_WARMUP = 20  # the worst mixture error is taken over steps from here on
_STEPS_FILE = "report/steps.parquet"
_RANKS_FILE = "report/ranks.parquet"
_SOURCES_FILE = "report/sources.parquet"
_WEIGHTS_FILE = "report/weights.parquet"


@dataclass(frozen=True, slots=True, kw_only=True)
class PartFigures:
    """One step's encoder and backbone loads per rank (loomdata and both baselines) and each part's LB."""

    balance: str  # the plan's cost.balance (sum | both)
    lb_enc: float  # max(total encoder cost / dp, largest segment's encoder cost)
    lb_bb: float  # the same for the backbone part
    loom_enc: np.ndarray  # float64 [dp]
    loom_bb: np.ndarray
    concat_enc: np.ndarray
    concat_bb: np.ndarray
    packed_enc: np.ndarray
    packed_bb: np.ndarray


_SYSTEMS = (("loomdata", "loom"), ("concat_chunk", "concat"), ("packed", "packed"))
_MAX_MEAN = ("max", "mean")
_PART_COLUMNS = ("enc_lb", "bb_lb", *(f"{c}_{x}_{y}" for _, c in _SYSTEMS for x in ("enc", "bb") for y in _MAX_MEAN))


_UINT32_MAX = (1 << 32) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFigures:
    """One step's figures, as the planner measured them."""

    tokens: np.ndarray  # int64 [sources] tokens placed per source
    lb: float  # lower bound max(total cost / dp, largest segment cost)
    loom_rank: np.ndarray  # float64 [dp] cost per rank, loomdata
    concat_rank: np.ndarray  # float64 [dp] time per rank, concat-and-chunk baseline
    packed_rank: np.ndarray  # float64 [dp] time per rank, packed baseline
    slot_cost: np.ndarray  # float64 [dp, micro_batches] cost per slot, loomdata
    packed_waiting_tokens: int  # tokens the packed baseline leaves for its next step
    deferred_tokens: int  # tokens deferred into the next step
    rank_max_item: np.ndarray  # float64 [dp] each rank's largest segment cost
    parts: PartFigures | None = None  # encoder and backbone apart (cost models with an encoder term)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockFigures:
    """The figures of consecutive steps (StepFigures' fields with a leading step axis)."""

    tokens: np.ndarray | Pieces  # int64 [steps, sources], or the placed pieces' (step, source, tokens)
    lb: np.ndarray  # [steps]
    loom_rank: np.ndarray  # [steps, dp]
    concat_rank: np.ndarray  # [steps, dp]
    packed_rank: np.ndarray  # [steps, dp]
    slot_cost: np.ndarray  # [steps, dp, micro_batches]
    packed_waiting_tokens: np.ndarray  # [steps]
    deferred_tokens: np.ndarray  # [steps]
    rank_max_item: np.ndarray  # [steps, dp]
    parts: list[PartFigures | None] | None = None


class ReportBuilder:
    """Collects per-step figures while planning, then writes them and summarises them."""

    def __init__(
        self,
        steps: int,
        sources: list[str],
        dp: int,
        *,
        rank_from: int = 0,
        budgets: np.ndarray | None = None,
        pp_size: int = 1,
        weights: StepWeights | None = None,
        step_tokens: int = _UINT32_MAX,
        sparse: bool = False,
    ) -> None:
        """Figures of `steps` steps; per-rank costs from step `rank_from` on; `budgets`: per-step token budgets
        when they differ between steps (a re-plan), which weights the mixture's target shares; `pp_size`:
        pipeline stages (for the 1F1B bubble); `weights`: the steps' target mixture (the plan's, worked out
        when the report is written: never held as a (steps, sources) grid; None: a range's own report, which
        is merged into the plan's and never written); `step_tokens`: the most tokens a step can hold (sizes the
        token counts' type); `sparse`: the token counts kept sparse (planning._counts.SparseCounts: the steps must
        then be recorded in step order, as the plan's report is; a range's report, rewritten by a fix-up, is
        dense)."""
        self.sources = sources
        self.pp_size = pp_size
        self._shuffle: dict[str, dict[str, float | int | str]] = {}
        self.rank_from = rank_from
        self.budgets = budgets
        # each source's tokens a step: dense, source-major in the narrowest unsigned type a step's tokens of one
        # source fit in (`step_tokens`: a step's capacity; at dp 4 uint16), widened if a count ever does not fit;
        # or sparse (its nonzero cells: with many sources and a small dp most cells are zero)
        self.tokens: StepCounts = (
            SparseCounts(steps, len(sources)) if sparse else DenseCounts(steps, len(sources), step_tokens)
        )
        self.weights = weights
        self._seeded = np.zeros((len(sources), 0))  # a re-plan's base weights of steps < its resume step
        self.cols = {
            k: np.zeros(steps)
            for k in (
                "lb",
                "loom_max",
                "loom_mean",
                "concat_max",
                "concat_mean",
                "packed_max",
                "packed_mean",
                "base_max",
                "mb_spread",
                "pp_time",
                "pp_time_even",
                "packed_waiting_tokens",
                "deferred_tokens",
            )
        }
        self.part_cols: dict[str, np.ndarray] = {}  # encoder/backbone columns, once a step brings parts
        self._balance = "sum"
        n_rank_steps = min(steps - rank_from, RANK_STEPS)
        self.rank_loom = np.zeros((n_rank_steps, dp))
        self.rank_concat = np.zeros((n_rank_steps, dp))
        self.rank_packed = np.zeros((n_rank_steps, dp))

    def add(self, step: int, fig: StepFigures) -> None:
        """Record one step's figures (a block of one step)."""
        self.add_block(
            step,
            BlockFigures(
                tokens=fig.tokens[None],
                lb=np.array([fig.lb]),
                loom_rank=fig.loom_rank[None],
                concat_rank=fig.concat_rank[None],
                packed_rank=fig.packed_rank[None],
                slot_cost=fig.slot_cost[None],
                packed_waiting_tokens=np.array([fig.packed_waiting_tokens]),
                deferred_tokens=np.array([fig.deferred_tokens]),
                rank_max_item=fig.rank_max_item[None],
                parts=None if fig.parts is None else [fig.parts],
            ),
        )

    def add_block(self, first: int, fig: BlockFigures) -> None:
        """Record the figures of steps first.. (one row of each array per step), all at once."""
        n = len(fig.lb)
        sl = slice(first, first + n)
        if isinstance(fig.tokens, Pieces):
            self.tokens.put_pieces(first, fig.tokens)
        else:
            self.tokens.put(first, fig.tokens)
        loom_rank, slot_cost = fig.loom_rank, fig.slot_cost
        dp, mb = slot_cost.shape[1], slot_cost.shape[2]
        c = self.cols
        c["lb"][sl] = fig.lb
        c["loom_max"][sl] = loom_rank.max(axis=1)
        c["loom_mean"][sl] = np.add.reduce(loom_rank, axis=1) / dp  # = each row's .mean(), bit for bit
        for name, r in (("concat", fig.concat_rank), ("packed", fig.packed_rank)):
            c[f"{name}_max"][sl] = r.max(axis=1)
            c[f"{name}_mean"][sl] = np.add.reduce(r, axis=1) / dp
        c["base_max"][sl] = np.minimum(c["concat_max"][sl], c["packed_max"][sl])
        bubble = self.pp_size - 1
        slot_max = slot_cost.max(axis=2)
        c["pp_time"][sl] = (loom_rank + bubble * slot_max).max(axis=1)
        c["pp_time_even"][sl] = (loom_rank * (1 + bubble / mb)).max(axis=1)
        c["packed_waiting_tokens"][sl] = fig.packed_waiting_tokens
        c["deferred_tokens"][sl] = fig.deferred_tokens
        # micro-batch spread of a rank: its most loaded micro-batch over that rank's own lower bound
        mean_mb = np.maximum(np.add.reduce(slot_cost, axis=2) / mb, fig.rank_max_item)
        used = mean_mb > 0
        ratio = slot_max / np.where(used, mean_mb, 1.0)
        spread = np.ones(n)
        every = used.all(axis=1)
        spread[every] = ratio[every].mean(axis=1)  # a row's mean as the 1-d mean of its used ranks
        for k in np.flatnonzero(~every & used.any(axis=1)).tolist():  # ranks left empty (tiny steps): rare
            spread[k] = float(ratio[k][used[k]].mean())
        c["mb_spread"][sl] = spread
        if fig.parts is not None:
            for k, p in enumerate(fig.parts):
                if p is not None:
                    self._add_parts(first + k, p)
        lo, hi = max(first, self.rank_from), min(first + n, self.rank_from + len(self.rank_loom))
        if lo < hi:
            dst, src = slice(lo - self.rank_from, hi - self.rank_from), slice(lo - first, hi - first)
            self.rank_loom[dst] = loom_rank[src]
            self.rank_concat[dst] = fig.concat_rank[src]
            self.rank_packed[dst] = fig.packed_rank[src]

    def _add_parts(self, step: int, p: PartFigures) -> None:
        """Record one step's encoder and backbone figures (allocating their columns on the first)."""
        pc = self.part_cols
        if not pc:
            pc.update({k: np.zeros(len(self.tokens)) for k in _PART_COLUMNS})
        self._balance = p.balance
        pc["enc_lb"][step] = p.lb_enc
        pc["bb_lb"][step] = p.lb_bb
        for _, col in _SYSTEMS:
            for x in ("enc", "bb"):
                r = getattr(p, f"{col}_{x}")
                pc[f"{col}_{x}_max"][step] = r.max()
                pc[f"{col}_{x}_mean"][step] = r.mean()

    def hybrid(self) -> dict[str, Any] | None:
        """Encoder and backbone imbalance apart per system (module docstring), or None without parts."""
        pc = self.part_cols
        if not pc:
            return None

        def ratio(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            return np.where(y > 0, x / np.where(y > 0, y, 1.0), 1.0)

        out: dict[str, Any] = {"balance": self._balance}
        for key, col in _SYSTEMS:
            em, bm = pc[f"{col}_enc_max"], pc[f"{col}_bb_max"]
            obj = np.maximum(ratio(em, pc["enc_lb"]), ratio(bm, pc["bb_lb"]))
            out[key] = {
                "encoder": {
                    "max_over_mean": _dist(ratio(em, pc[f"{col}_enc_mean"])),
                    "max_over_lb": _dist(ratio(em, pc["enc_lb"])),
                },
                "backbone": {
                    "max_over_mean": _dist(ratio(bm, pc[f"{col}_bb_mean"])),
                    "max_over_lb": _dist(ratio(bm, pc["bb_lb"])),
                },
                "objective": _dist(obj),
                "step_time": float(
                    (
                        pc[f"{col}_bb_mean"]
                        * np.maximum(ratio(em, pc[f"{col}_enc_mean"]), ratio(bm, pc[f"{col}_bb_mean"]))
                    ).sum()
                ),
                "step_time_equal_speed": float(np.maximum(em, bm).sum()),
            }
        loom_t = max(out["loomdata"]["step_time"], 1e-300)
        out["gain"] = {key: out[key]["step_time"] / loom_t for key, _ in _SYSTEMS[1:]}
        return out

    def seed(self, rows: dict[str, np.ndarray] | None, upto: int) -> None:
        """Take the figures of steps < upto from another plan's report/steps.parquet columns (a re-plan's base)."""
        if rows is None:
            return
        for name, col in self.cols.items():
            if name in rows:
                col[:upto] = rows[name][:upto]
        for name in _PART_COLUMNS:  # the base plan's encoder/backbone figures, if it had them
            if name in rows:
                self.part_cols.setdefault(name, np.zeros(len(self.tokens)))[:upto] = rows[name][:upto]
        self._seeded = np.zeros((len(self.sources), upto))
        n = len(self.sources)
        block = max(1, STEP_TABLE_CELLS // max(n, 1))
        for a in range(0, upto, block):  # the base's counts, a block of steps at a time
            b = min(upto, a + block)
            counts = np.zeros((b - a, n), dtype=np.int64)
            for k, name in enumerate(self.sources):
                if f"tokens__{name}" in rows:
                    counts[:, k] = rows[f"tokens__{name}"][a:b]
            self.tokens.put(a, counts)
        for k, name in enumerate(self.sources):
            if f"weight__{name}" in rows:
                self._seeded[k] = rows[f"weight__{name}"][:upto]

    def weight_rows(self, k0: int, k1: int, a: int = 0, b: int | None = None) -> np.ndarray:
        """(k1 - k0, b - a) float64: the target weights of sources k0..k1-1 at steps a..b-1, as rows (a re-plan's
        steps before its resume step: its base's)."""
        b = len(self.tokens) if b is None else b
        out = np.zeros((k1 - k0, b - a)) if self.weights is None else self.weights.window(a, b).columns(k0, k1)
        upto = self._seeded.shape[1]
        if a < upto:
            out[:, : min(upto, b) - a] = self._seeded[k0:k1, a : min(upto, b)]
        return out

    def _source_blocks(self) -> Iterator[tuple[int, int]]:
        """Blocks of sources whose weight rows are worked out at once (about WEIGHT_BLOCK_CELLS cells)."""
        n = len(self.sources)
        width = max(1, WEIGHT_BLOCK_CELLS // max(len(self.tokens), 1))
        for k0 in range(0, n, width):
            yield k0, min(n, k0 + width)

    def imbalance(self, first: int = 0) -> dict[str, dict[str, float]]:
        """Distribution of max rank cost / LB over steps >= first: loomdata, each baseline, and `baseline` (the
        stronger baseline of each step)."""
        c = self.cols
        lb = c["lb"][first:]
        safe = np.where(lb > 0, lb, 1.0)
        out = {}
        for key, col in (("loomdata", "loom"), ("concat_chunk", "concat"), ("packed", "packed"), ("baseline", "base")):
            x = c[f"{col}_max"][first:] / safe
            x[lb == 0] = 1.0
            out[key] = _dist(x)
        return out

    def write(self, plan_dir: Path) -> None:
        """Write report/sources.parquet (the (step, source) cells that place tokens, a block of steps at a time),
        report/weights.parquet (the steps whose target weights change; their rows worked out a block of steps
        at a time, never whole), report/steps.parquet (a row group of steps at a time) and report/ranks.parquet.
        (Planner version 8 wrote every (step, source) token count and weight as two columns a source of the
        steps table: 615 columns at 300 sources, whose values cost more to write than the rest of the plan's.)"""
        steps = len(self.tokens)
        rows = step_rows(len(self.sources))  # a row group of each table: about STEP_TABLE_CELLS cells worked out
        per_step = np.zeros(steps, dtype=np.int64)
        write_table_parts(
            (self._sources_table(a, min(steps, a + rows), per_step) for a in range(0, max(steps, 1), rows)),
            plan_dir / _SOURCES_FILE,
            TableKind.PLAN_SOURCES,
        )
        prev: list[np.ndarray] = []  # the weights of the step before the block (none before step 0)
        weights = (self._weights_table(a, min(steps, a + rows), prev) for a in range(0, max(steps, 1), rows))
        write_table_parts(
            (t for t in weights if t is not None),  # no empty row groups (a fixed mixture: one row)
            plan_dir / _WEIGHTS_FILE,
            TableKind.PLAN_WEIGHTS,
        )
        write_table_parts(
            (self._steps_table(a, min(steps, a + rows), per_step) for a in range(0, max(steps, 1), rows)),
            plan_dir / _STEPS_FILE,
            TableKind.PLAN_STEPS,
        )
        n, dp = self.rank_loom.shape
        ranks = pa.table(
            {
                "step": np.repeat(np.arange(self.rank_from, self.rank_from + n, dtype=np.uint32), dp),
                "dp_rank": np.tile(np.arange(dp, dtype=np.uint32), n),
                "loom_cost": self.rank_loom.ravel(),
                "concat_cost": self.rank_concat.ravel(),
                "packed_cost": self.rank_packed.ravel(),
            }
        )
        write_table(ranks, plan_dir / _RANKS_FILE, TableKind.PLAN_RANKS)

    def _sources_table(self, a: int, b: int, per_step: np.ndarray) -> pa.Table:
        """Steps a..b-1 of report/sources.parquet (the cells that place tokens, step-major, as the counts hold
        them); their steps' tokens written to per_step (the steps table's `tokens`: integers, exact in any order)."""
        cells, src, tokens = self.tokens.step_cells(a, b)
        step_sums(cells, tokens, per_step[a:b])
        step = np.repeat(np.arange(a, b, dtype=np.uint32), cells)
        return pa.table({"step": step, "source": np.asarray(src, dtype=np.uint16), "tokens": tokens.astype(np.int64)})

    def _weights_table(self, a: int, b: int, prev: list[np.ndarray]) -> pa.Table | None:
        """The rows of report/weights.parquet among steps a..b-1: a step whose weights differ from the step
        before's (`prev` holds that step's weights when a > 0, and is given the block's last); None where no step
        of them has a row (an empty table for no steps at all). Weights are worked out up to the steady row
        (_steady) only: the steps after its first all repeat it."""
        n = len(self.sources)
        start, row = self._steady()
        m = min(max(start, a), b)  # steps m..b-1 hold the steady row
        w = np.empty((n, m - a + (m < b)))  # the steps a..m-1, then one step of the steady row
        for k0, k1 in self._source_blocks():
            w[k0:k1, : m - a] = self.weight_rows(k0, k1, a, m)
        if m < b:
            w[:, m - a] = row
        bits = w.view(np.int64)  # compared bit for bit (forward-filled rows are the same floats, -0.0 included)
        change = np.ones(w.shape[1], dtype=bool)
        if w.shape[1] > 1:
            change[1:] = (bits[:, 1:] != bits[:, :-1]).any(axis=0)
        if prev:
            change[0] = bool((bits[:, 0] != prev[0].view(np.int64)).any())
            prev.clear()
        if b > a:
            prev.append(w[:, -1].copy())
        at = np.flatnonzero(change)
        if not len(at) and b > a:
            return None
        data: dict[str, Any] = {"step": (at + a).astype(np.uint32)}
        for k, name in enumerate(self.sources):
            data[f"weight__{name}"] = w[k, at]
        return pa.table(data)

    def _steps_table(self, a: int, b: int, per_step: np.ndarray) -> pa.Table:
        """Steps a..b-1 of report/steps.parquet (`per_step`: every step's tokens)."""
        data: dict[str, Any] = {
            "step": np.arange(a, b, dtype=np.uint32),
            "tokens": per_step[a:b],
        }
        data.update({name: col[a:b] for name, col in self.cols.items()})
        data.update({name: col[a:b] for name, col in self.part_cols.items()})
        if self.budgets is not None:
            data["budget"] = self.budgets[a:b]
        return pa.table(data)

    def set_shuffle(self, figures: dict[str, dict[str, float | int | str]]) -> None:
        """Per-source shuffle figures (planning._shuffle) for the summary's `shuffle` section."""
        self._shuffle = dict(figures)

    def _mixture_error(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """mixture_error(tokens, weights, budgets, full=False), bit for bit, in one pass down the steps over the
        token counts' nonzero cells (_report_kernel.mixture_steps; no rows of sources made dense), the target
        weights worked out a block of steps at a time (one row for the steps of the steady row on)."""
        b = np.zeros(0) if self.budgets is None else np.ascontiguousarray(self.budgets, dtype=np.float64)
        steps, n = len(self.tokens), len(self.sources)
        _, b_div = running_totals(np.zeros(steps, dtype=np.int64), b)
        cum, run, total, worst = np.zeros(n), np.zeros(n), np.zeros(1, dtype=np.int64), np.zeros(steps)
        block = max(1, WEIGHT_BLOCK_CELLS // max(n, 1))
        for a in range(0, steps, block):
            e = min(steps, a + block)
            per_step, src, value = self.tokens.step_cells(a, e)
            mixture_steps(per_step, src, value, self._weight_steps(a, e), b, a, b_div, cum, run, total, worst)
        if not steps:
            return worst, np.empty((0, n)), np.empty((0, n))
        d = float(total[0]) if total[0] > 0 else 1.0
        return worst * 100.0, (cum / d)[None], (run / b_div[-1])[None]

    def _steady(self) -> tuple[int, np.ndarray]:
        """(the first step from which every step's target weights are one row, that row): the schedule's last
        milestone on (a fixed mixture: every step), after a re-plan's base steps; zeros without weights."""
        upto = self._seeded.shape[1]
        if self.weights is None:
            return upto, np.zeros(len(self.sources))
        w = self.weights
        return max(upto, w.held - w.first, 0), np.ascontiguousarray(w.last, dtype=np.float64)

    def _weight_steps(self, a: int, b: int) -> np.ndarray:
        """(b - a, sources) float64: the target weights of steps a..b-1 step-major (weight_rows' values), or their
        one row (1, sources) where all of them hold the steady row."""
        start, row = self._steady()
        if a >= start:
            return row[None]
        out = np.zeros((b - a, len(self.sources))) if self.weights is None else self.weights.rows(a, b)
        upto = self._seeded.shape[1]
        if a < upto:
            out[: min(upto, b) - a] = self._seeded[:, a : min(upto, b)].T
        return out

    def summary(self) -> dict[str, Any]:
        """The plan's summary figures (stored in plan.json, printed by `loom plan` / `loom inspect`)."""
        c = self.cols
        err, realized, target = self._mixture_error()  # the last step's shares
        per_source = self.tokens.source_totals()  # integer sums: each source's own sum, exactly
        warm = min(MIXTURE_WARMUP, len(err) - 1)
        total = int(per_source.sum())
        loom_sum = max(float(c["loom_max"].sum()), 1e-300)
        gains = {
            "concat_chunk": float(c["concat_max"].sum()) / loom_sum,
            "packed": float(c["packed_max"].sum()) / loom_sum,
        }
        stronger = min(gains, key=lambda k: gains[k])
        per_step = c["base_max"] / np.where(c["loom_max"] > 0, c["loom_max"], 1.0)
        pp_t = max(float(c["pp_time"].sum()), 1e-300)
        return {
            "steps": len(self.tokens),
            "tokens": total,
            "imbalance": self.imbalance(),
            "max_over_mean": {
                key: float(np.mean(c[f"{col}_max"] / np.where(c[f"{col}_mean"] > 0, c[f"{col}_mean"], 1.0)))
                for key, col in (("loomdata", "loom"), ("concat_chunk", "concat"), ("packed", "packed"))
            },
            "micro_batch_spread": float(np.mean(c["mb_spread"])),
            "pipeline": {
                "pp_size": self.pp_size,
                "bubble_share": 1.0 - float(c["loom_max"].sum()) / pp_t if self.pp_size > 1 else 0.0,
                "uneven_micro_batch_cost": pp_t / max(float(c["pp_time_even"].sum()), 1e-300) - 1.0,
            },
            "packed_waiting_tokens_mean": float(np.mean(c["packed_waiting_tokens"])),
            "deferred": {
                "steps": int((c["deferred_tokens"] > 0).sum()),
                "tokens": int(c["deferred_tokens"].sum()),
            },
            "simulated_gain": gains[stronger],
            "gain": {**gains, "stronger_baseline": stronger, "per_step_vs_stronger": _dist(per_step)},
            "worst_mixture_error_pp": float(err[warm:].max()) if len(err) else 0.0,
            "mixture": {
                name: {
                    "target_share": float(target[-1, k]),
                    "realized_share": float(realized[-1, k]),
                    "tokens": int(per_source[k]),
                }
                for k, name in enumerate(self.sources)
            },
            "shuffle": self._shuffle,
            **({"hybrid": hybrid} if (hybrid := self.hybrid()) is not None else {}),
        }


STEP_TABLE_CELLS = 1 << 23
"""(steps x columns) cells of report/steps.parquet built at once: a row group of at most that many cells."""


def step_rows(n_sources: int) -> int:
    """Steps a row group of the report's steps, sources and weights tables holds with `n_sources` sources (a
    block's token counts and weights, 2 cells a source and step, are worked out at once): 65,536 up to 56 sources,
    fewer with more (13,617 at 300; at least 4,096)."""
    return max(1 << 12, min(1 << 16, STEP_TABLE_CELLS // (2 * n_sources + 16)))


WEIGHT_BLOCK_CELLS = 1 << 22
"""(steps x sources) cells of target weights worked out at once for the summary's mixture error."""


def mixture_error(
    tokens: np.ndarray, weights: np.ndarray, budgets: np.ndarray | None = None, *, full: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(worst error per step in pp, realized cumulative shares, target cumulative shares).

    Targets are the mean of the steps' weights, weighted by their token budgets when those differ (re-plans);
    one compiled pass (_report_kernel). `full` False: the shares of the last step only (one row each).
    """
    b = np.zeros(0) if budgets is None else np.ascontiguousarray(budgets, dtype=np.float64)
    err, realized, target = mixture_shares(_by_source(tokens, np.int64), _by_source(weights, np.float64), b, full)
    return err, realized.T, target.T


def _by_source(grid: np.ndarray, dtype: type) -> np.ndarray:
    """A (steps, sources) grid as C-ordered (sources, steps) rows of `dtype`: a view of the report's own
    source-major grids, a tiled transposed copy of a step-major one."""
    rows = grid.T
    if rows.dtype != dtype:
        rows = rows.astype(dtype)
    return rows if rows.flags.c_contiguous else transposed(grid.astype(dtype, copy=False))


def step_table_columns(plan_dir: Path) -> list[str]:
    """The column names of a plan's report/steps.parquet (from its footer)."""
    from loomdata.schemas.tables import open_table

    return list(open_table(Path(plan_dir) / _STEPS_FILE, TableKind.PLAN_STEPS).schema_arrow.names)


def source_columns(
    plan_dir: Path, sources: list[str], first: int = 0, last: int | None = None
) -> dict[str, np.ndarray]:
    """Per source `tokens__<name>` (int64) and `weight__<name>` (float64) of steps first..last (default: to the
    plan's last step), dense, whichever way the plan stores them: report/sources.parquet and report/weights.parquet
    (planner version 9, read by step range) or columns of report/steps.parquet (version 8 and earlier). `sources`:
    any of the plan's sources, in any order (a name it lacks is a KeyError)."""
    plan_dir = Path(plan_dir)
    names = [f"{k}__{n}" for n in sources for k in ("tokens", "weight")]
    if not (plan_dir / _SOURCES_FILE).exists():
        t = read_steps(plan_dir / _STEPS_FILE, TableKind.PLAN_STEPS, first, last, names)
        return {n: t.column(n).to_numpy() for n in names if n in t.column_names}
    ids = {name: k for k, name in enumerate(read_plan(plan_dir).sources)}  # the table's source ids: plan.json's order
    unknown = [n for n in sources if n not in ids]
    if unknown:
        raise KeyError(f"{plan_dir}: no source {unknown} in this plan (its sources: {sorted(ids)})")
    span = step_span(plan_dir / _STEPS_FILE, TableKind.PLAN_STEPS)
    last = span[1] if last is None else min(last, span[1])
    steps = max(last - first + 1, 0)
    out: dict[str, np.ndarray] = {}
    tokens = np.zeros((len(ids), steps), dtype=np.int64)
    for part in iter_steps(plan_dir / _SOURCES_FILE, TableKind.PLAN_SOURCES, first, last, ["step", "source", "tokens"]):
        at = part.column("step").to_numpy().astype(np.int64) - first
        tokens[part.column("source").to_numpy(), at] = part.column("tokens").to_numpy()
    w = read_steps(plan_dir / _WEIGHTS_FILE, TableKind.PLAN_WEIGHTS, 0, last)  # each step's row: the last at or before
    row = np.searchsorted(w.column("step").to_numpy(), np.arange(first, first + steps), side="right") - 1
    for name in sources:
        out[f"tokens__{name}"] = tokens[ids[name]]
        col = w.column(f"weight__{name}").to_numpy()
        out[f"weight__{name}"] = col[row] if len(col) else np.zeros(steps)
    return out


def _dist(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {"mean": 1.0, "p99": 1.0, "max": 1.0}
    return {"mean": float(x.mean()), "p99": float(np.quantile(x, 0.99)), "max": float(x.max())}


def plan_report(
    plan_dir: Path, steps: tuple[int, int] | None = None, *, count: ReadCount | None = None
) -> dict[str, Any]:
    """The report of a stored plan: plan dir and id, steps, tokens, imbalance, gain, mixture errors; with
    `steps` (first, last inclusive) also `step_range` (step_range_figures). Summary figures come from
    plan.json; report tables are read by step range (`count` tallies what was read)."""
    meta = read_plan(plan_dir)
    out: dict[str, Any] = {"plan_dir": str(Path(plan_dir)), "plan_id": meta.plan_id}
    out.update(meta.summary)
    cp = cp_figures(Path(plan_dir), meta)  # read from the manifest, not stored: plans stay byte-identical
    if cp is not None:
        out["context_parallel"] = cp
    if steps is not None:
        out["step_range"] = step_range_figures(Path(plan_dir), steps[0], steps[1], count)
    return out


_RANGE_COLUMNS = ["tokens", "lb", "loom_max", "base_max", "deferred_tokens"]


def step_range_figures(plan_dir: Path, first: int, last: int, count: ReadCount | None = None) -> dict[str, Any]:
    """Figures of steps first..last from the report tables, read by step range (only the row groups holding
    those steps, only the columns needed; the ranks table, steps x dp rows, a row group at a time): tokens,
    deferred tokens, max/LB of loomdata and of the stronger baseline, and where per-rank costs are stored,
    the worst rank's cost over the mean rank's per step."""
    if last < first:
        raise ValueError(f"step range {first}..{last} is empty: give first <= last")
    t = read_steps(Path(plan_dir) / _STEPS_FILE, TableKind.PLAN_STEPS, first, last, _RANGE_COLUMNS, count)
    c = {n: t.column(n).to_numpy() for n in _RANGE_COLUMNS}
    safe = np.where(c["lb"] > 0, c["lb"], 1.0)
    out: dict[str, Any] = {
        "first": first,
        "last": last,
        "steps": t.num_rows,
        "tokens": int(c["tokens"].sum()),
        "deferred_tokens": float(c["deferred_tokens"].sum()),
        "imbalance": {"loomdata": _dist(c["loom_max"] / safe), "baseline": _dist(c["base_max"] / safe)},
    }
    ranks = Path(plan_dir) / _RANKS_FILE
    if ranks.exists():
        spread: list[np.ndarray] = []
        for part in iter_steps(ranks, TableKind.PLAN_RANKS, first, last, ["step", "loom_cost"], count):
            step = part.column("step").to_numpy()
            cost = part.column("loom_cost").to_numpy()
            if not len(step):
                continue
            at = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])  # rows are in step order
            n = np.diff(np.r_[at, len(step)])
            mean = np.add.reduceat(cost, at) / n
            spread.append(np.maximum.reduceat(cost, at) / np.where(mean > 0, mean, 1.0))
        x = np.concatenate(spread) if spread else np.zeros(0)
        out["rank_steps"] = len(x)  # steps of the range with per-rank costs stored (a step can span row groups)
        out["rank_max_over_mean"] = _dist(x)
    return out


def plot_plan(plan_dir: Path, out_png: Path) -> None:
    """PNG: per-rank cost heatmaps (loomdata vs the stronger baseline), max/LB per step (loomdata and both
    baselines), realized vs target mixture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    meta = read_plan(plan_dir)
    cols = ["lb", "loom_max", "concat_max", "packed_max"]
    if "budget" in step_table_columns(Path(plan_dir)):  # re-plans: the steps' budgets weight the targets
        cols.append("budget")
    table = read_steps(Path(plan_dir) / _STEPS_FILE, TableKind.PLAN_STEPS, columns=["step", *cols])
    steps = {n: table.column(n).to_numpy() for n in table.column_names}
    first = int(steps["step"][0]) if len(steps["step"]) else 0
    steps.update(source_columns(Path(plan_dir), list(meta.sources), first))
    s = meta.summary
    strong = s.get("gain", {}).get("stronger_baseline", "concat_chunk")
    base_col = "packed_cost" if strong == "packed" else "concat_cost"
    # the heatmaps show the stored per-rank steps from the first, at most RANK_STEPS of them (a step range read)
    span = step_span(Path(plan_dir) / _RANKS_FILE, TableKind.PLAN_RANKS)
    ranks = read_steps(
        Path(plan_dir) / _RANKS_FILE,
        TableKind.PLAN_RANKS,
        span[0],
        min(span[1], span[0] + RANK_STEPS - 1),
        ["dp_rank", "loom_cost", base_col],
    )
    first = span[0] if span[1] >= span[0] else 0
    dp = meta.dp_size
    n = ranks.num_rows // dp
    lb = np.asarray(steps["lb"])
    safe_lb = np.where(lb > 0, lb, 1.0)
    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))
    grids = []
    for col in ("loom_cost", base_col):
        g = ranks[col].to_numpy().reshape(n, dp) / safe_lb[first : first + n, None] if n > 0 else np.zeros((1, dp))
        grids.append(g)
    vmax = max(1.05, float(max(g.max() for g in grids)))
    vmin = min(float(min(g.min() for g in grids)), 0.95)
    titles = ("loomdata", f"baseline {strong}")
    for a, g, title in zip(ax[0], grids, titles, strict=True):
        im = a.imshow(
            g.T,
            aspect="auto",
            origin="lower",
            cmap="viridis",
            vmin=vmin,
            vmax=vmax,
            interpolation="nearest",
            extent=(first - 0.5, first + max(n, 1) - 0.5, -0.5, dp - 0.5),
        )
        a.set_title(f"{title}: rank cost / LB")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.yaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_xlabel("step")
        a.set_ylabel("dp rank")
        fig.colorbar(im, ax=a)
    x = np.asarray(steps["step"])
    a = ax[1, 0]
    a.plot(x, np.asarray(steps["concat_max"]) / safe_lb, label="concat-and-chunk max/LB", color="tab:red", lw=1)
    a.plot(x, np.asarray(steps["packed_max"]) / safe_lb, label="packed max/LB", color="tab:orange", lw=1)
    a.plot(x, np.asarray(steps["loom_max"]) / safe_lb, label="loomdata max/LB", color="tab:blue", lw=1)
    a.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set_title(f"most loaded rank / lower bound per step (gain {s.get('simulated_gain', 0):.3f}x over {strong})")
    a.set_xlabel("step")
    a.legend()
    a = ax[1, 1]
    tok = np.stack([np.asarray(steps[f"tokens__{name}"]) for name in meta.sources], 1)
    w = np.stack([np.asarray(steps[f"weight__{name}"]) for name in meta.sources], 1)
    _, realized, target = mixture_error(tok, w, np.asarray(steps["budget"]) if "budget" in steps else None)
    for k, name in enumerate(meta.sources):
        line = a.plot(x, realized[:, k], lw=1.2, label=f"{name} realized")
        a.plot(x, target[:, k], lw=1, ls="--", color=line[0].get_color(), label=f"{name} target")
    a.set_title("cumulative token share: realized (solid) vs target (dashed)")
    a.set_xlabel("step")
    a.legend(fontsize=7, ncol=2)
    fig.suptitle(f"plan {meta.plan_id}: dp {dp}, {meta.micro_batches} micro-batches, seq_len {meta.seq_len}")
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(out_png), dpi=110)
    plt.close(fig)
