"""make_plan: spec + index tables -> plan dir (plan.json, manifest partitions, report), atomic and idempotent.

The plan id is a content hash of (the spec's content JSON: no workdir, base_dir or tokenizer path; the
index fingerprints; PLANNER_VERSION), so the same inputs give the same id and byte-identical files
wherever the spec, data and workdir are; planning an id that already exists
complete is a no-op. Files are written into a temporary folder beside the target and renamed into place.
The work is NumPy and compiled kernels over a block of consecutive steps at a time (_items gathers their segments and
costs, balance.balance_span deals, places leftovers, refines and computes the baseline for all of
them as flat arrays, _step appends the block's manifest rows and figures; _ranges runs that over a
range of steps); no Python loops per sample, and none but rare leftovers per step. With `client=`,
membership runs here and ranges of steps are balanced and written on the cluster's workers
(_distributed), byte-identical to planning in one process. Segments a step had no room for (image
samples that cannot be split; rare) go first into the next step; any left after
the last step are listed in the summary (`unplaced_after_last_step`), never dropped silently.
`resume_from=PlanResume(plan_dir=..., at_step=S)` makes an elastic re-plan (see _resume): steps < S are the
base's rows, later steps continue its streams and in-flight pieces with the spec's training shape; the
per-step budgets then follow `parameters.shape_schedule`.

Measured (benchmarks/plan_scale.py on this shared 2-core machine, so read them as orders of magnitude;
results/plan_scale*.json hold the figures): with the compiled kernels (numba: deal, local search, baselines'
shuffles and cuts, membership repair, LRU replay, mixture error) at 10M samples 0.9-1.1M samples per
CPU-second with 1 source and 0.4-0.86M with 300 at dp 4-1024, 1.34-1.89x the NumPy code
(results/plan_scale_s6.json); session 7's compiled membership grids make 300 sources at dp 4 1.52x faster
(results/plan_scale_s7.json); a process's first plan loads the kernels from numba's cache (~0.26 s CPU). Peak memory
(benchmarks/plan_memory.py, results/plan_memory.json, each phase's own peak): the index columns (4 bytes a
sample: num_tokens; dense ids and zero image columns not stored), the streams (4 bytes a segment, plus 8
of counts until the look-ahead has read that source's lengths) and the look-ahead's compact per-segment
columns (about 10 bytes a segment while it runs, 8 kept for balancing); no phase copies a column of all
segments or documents into int64 or float64 (session 8: 27.3 B a sample at 100M, results/plan_memory_s8.json).
No table of the plan grows with steps x sources: the stream pointers (planning._pointers) and the report's tokens a
step and source (planning._counts) hold only the cells that draw (session 13, results/plan_memory_s13.json; a
range's report on a worker keeps its own steps' counts dense, since a fix-up rewrites them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from loomdata.planning._allocator import trim_arenas
from loomdata.planning._baselines import BASELINE_DESCRIPTION
from loomdata.planning._distributed import (
    RANGES_PER_WORKER,
    Executor,
    Speculation,
    local_threads,
    plan_ranges,
    split_ranges,
    worker_count,
)
from loomdata.planning._index_read import read_index
from loomdata.planning._jit import warm_up
from loomdata.planning._lookahead import Allocate, Positions, StepAssignment, assign_steps, natural_ranges
from loomdata.planning._manifest import ManifestWriter, file_bounds
from loomdata.planning._mixture import (
    CumulativeTargets,
    StepWeights,
    Stream,
    StreamRunOut,
    build_stream,
    check_epochs,
    give_back_room,
    membership,
    step_weights,
)
from loomdata.planning._packing import Lanes, check_unsplittable, has_image_tokens
from loomdata.planning._pointers import Pointers
from loomdata.planning._ranges import PlanWork, RangePart, balanced_blocks, merge_report
from loomdata.planning._report import ReportBuilder
from loomdata.planning._resume import (
    BasePlan,
    PlanResume,
    base_carry,
    base_positions,
    base_report_rows,
    copy_base_rows,
    open_base,
    resume_parameters,
)
from loomdata.planning._segments import DenseIds, SampleIds, Segments
from loomdata.planning._shuffle import FIGURE_SEGMENTS, BlockLayout, layout_of, shuffle_figures, storage_runs
from loomdata.planning._step import StepSink
from loomdata.planning._threads import THREAD_BYTES, per_source, plan_threads
from loomdata.planning._warm import warm, warm_workers
from loomdata.planning._window import window_membership
from loomdata.planning.balance import BalanceConfig
from loomdata.schemas.errors import PlanError
from loomdata.schemas.freshness import require_built_from
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.plan import PLAN_FORMAT_VERSION, PlanMeta, PlanParameters, ResumeInfo, StepShape, read_plan
from loomdata.schemas.spec import Spec
from loomdata.schemas.tables import TableKind, check_schema

__all__ = ["PLANNER_VERSION", "PlanResult", "PlanResume", "make_plan"]

PLANNER_VERSION = "10"
"""Part of the plan id: bump it whenever the planner's output for the same inputs changes (8: the manifest's and
the report's Parquet encoding, the same rows and figures as 7; see `schemas.tables._SPLIT`; 9: the report's
(step, source) token counts and weights in report/sources.parquet and report/weights.parquet, not 2 columns a source
of report/steps.parquet; the manifest's rows and every figure as 8's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """Where a plan lives and its plan.json."""

    plan_dir: Path
    meta: PlanMeta


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    sample: SampleIds
    num_tokens: np.ndarray
    num_image_tokens: np.ndarray
    runs: np.ndarray  # int64 starts of runs of one shard in storage order, n appended (planning._shuffle)
    order: np.ndarray | None  # index rows in storage order; None: already so


def make_plan(
    spec: Spec,
    *,
    progress: bool = False,
    index: Mapping[str, pa.Table] | None = None,
    fingerprints: Mapping[str, str] | None = None,
    resume_from: PlanResume | None = None,
    client: Executor | None = None,
    ranges: int | None = None,
) -> PlanResult:
    """Plan `spec` over its index (read from spec.workdir unless `index` is given) into workdir/plans/<id>/.

    With `resume_from`, an elastic re-plan: steps < resume_from.at_step are the base plan's rows and later
    steps continue its streams with spec's (new) training shape (see _resume). With `client` (a
    distributed.Client or a concurrent.futures executor whose workers see the workdir), step ranges are
    balanced on its workers (`ranges` of them, default RANGES_PER_WORKER per worker; see _distributed):
    the plan is byte-identical to the one-process plan.
    """
    warm_up()  # numba's set-up beside the index reads (planning._jit)
    if client is not None:  # the workers warmed (numba's kernels loaded) while the serial part runs here
        warm_workers(client, _warm_task)
    weights = step_weights(spec)
    sources, fps = _load_index(spec, index, fingerprints)
    base = None if resume_from is None else open_base(resume_from, spec, fps, PLANNER_VERSION)
    plan_id = plan_id_of(spec, fps, None if base is None else (base.meta.plan_id, base.at_step))
    final = spec.plans_dir / plan_id
    if (final / "plan.json").exists():
        return PlanResult(plan_dir=final, meta=read_plan(final))
    spec.plans_dir.mkdir(parents=True, exist_ok=True)
    tmp = spec.plans_dir / f".tmp-{plan_id}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _plan_into(tmp, plan_id, spec, weights, sources, fps, progress, base, client, ranges)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PlanResult(plan_dir=final, meta=meta)


def _warm_task() -> float:
    """A worker's warming task (planning._warm): a tiny plan made by make_plan, once per process."""
    return warm(make_plan)


def plan_id_of(spec: Spec, fingerprints: Mapping[str, str], resume: tuple[str, int] | None = None) -> str:
    """Content hash of the spec (without locations: Spec.content_json), the index fingerprints, the planner
    version and (re-plans) base id and step: the same spec and data give the same id wherever they are."""
    content: dict[str, object] = {
        "spec": spec.content_json(),
        "index": dict(sorted(fingerprints.items())),
        "planner": PLANNER_VERSION,
    }
    if resume is not None:
        content["resume"] = {"base_plan_id": resume[0], "at_step": resume[1]}
    blob = json.dumps(content, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished temp dir into place; a complete plan already there (a concurrent run) wins."""
    if final.exists() and not (final / "plan.json").exists():
        shutil.rmtree(final)  # an incomplete leftover of a crashed run
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "plan.json").exists():
            raise


def _load_index(
    spec: Spec, index: Mapping[str, pa.Table] | None, fingerprints: Mapping[str, str] | None
) -> tuple[list[_Source], dict[str, str]]:
    if index is None:
        require_built_from(spec)  # the index on disk fits the spec's settings and the files its globs match now
    out: list[_Source] = []
    fps: dict[str, str] = {}
    names = spec.source_names
    read = (
        per_source(
            lambda k: _read_source(spec.workdir, names[k]), len(names), _index_bytes(spec.workdir, names), THREAD_BYTES
        )
        if index is None
        else []
    )
    for k, name in enumerate(names):
        if index is None:
            src, fp = read[k]
        else:
            if name not in index:
                raise PlanError(f"no index table given for source {name!r} (given: {', '.join(sorted(index))})")
            table = index[name]
            check_schema(table, TableKind.INDEX, f"index table of source {name!r}")
            fp = fingerprints[name] if fingerprints is not None and name in fingerprints else _fingerprint(table)
            runs, order = storage_runs(_np(table, "shard"), _np(table, "row"))
            src = _Source(
                name, _np(table, "sample"), _np(table, "num_tokens"), _np(table, "num_image_tokens"), runs, order
            )
        if fingerprints is not None and name in fingerprints:
            fp = fingerprints[name]
        fps[name] = fp
        out.append(src)
    return out, fps


def _index_bytes(workdir: Path, names: Sequence[str]) -> list[int]:
    """Each source's index table size in bytes (0 where there is none: its read says so): how much reading
    each is, for planning._threads.per_source to choose threads by."""
    out = []
    for name in names:
        try:
            out.append(IndexFiles.of(workdir, name).samples.stat().st_size)
        except OSError:
            out.append(0)
    return out


def _read_source(workdir: Path, name: str) -> tuple[_Source, str]:
    """One source's index columns (planning._index_read: compact arrays, a large table's row groups read in parts
    on the usable cores)."""
    cols = read_index(workdir, name, parts=plan_threads())
    n = len(cols.num_tokens)
    ids_of: SampleIds = DenseIds(n) if cols.sample is None else cols.sample
    images = np.broadcast_to(np.zeros(1, np.uint32), (n,)) if cols.images is None else cols.images
    return _Source(name, ids_of, cols.num_tokens, images, cols.runs, None), cols.fingerprint


def _np(table: pa.Table | pa.ChunkedArray, col: str | None) -> np.ndarray:
    arr = table if col is None else table.column(col)
    return arr.to_numpy() if arr.num_chunks != 1 else arr.chunk(0).to_numpy()


def _fingerprint(table: pa.Table) -> str:
    """Content hash of an in-memory index table (used when no fingerprint is given)."""
    h = hashlib.blake2b(digest_size=16)
    for col in ("sample", "num_tokens", "num_image_tokens"):
        h.update(np.ascontiguousarray(_np(table, col)).tobytes())
    return "mem-" + h.hexdigest()


def _plan_into(
    out: Path,
    plan_id: str,
    spec: Spec,
    weights: StepWeights,
    sources: list[_Source],
    fps: dict[str, str],
    progress: bool,
    base: BasePlan | None = None,
    client: Executor | None = None,
    ranges: int | None = None,
) -> PlanMeta:
    tr = spec.training
    lanes = Lanes.of(spec)
    slots = tr.dp_size * tr.micro_batches
    fill = spec.planning.fill
    budget = int(slots * tr.seq_len * fill)
    if budget < 1:
        raise PlanError(f"step budget is {budget} tokens; raise training.seq_len, dp_size or micro_batches")
    names = [s.name for s in sources]
    mb = tr.micro_batches
    start = 0 if base is None else base.at_step
    shapes = [] if base is None else [*base.shapes, StepShape(from_step=start, dp_size=tr.dp_size, micro_batches=mb)]
    step_slots = _step_slots(shapes, tr.steps) if shapes else np.full(tr.steps, slots, dtype=np.int64)
    step_budget = (step_slots * tr.seq_len * fill).astype(np.int64)
    targets = CumulativeTargets(weights, step_budget)  # worked out a block at a time, never whole
    epoch_tokens = [int(s.num_tokens.sum(dtype=np.int64)) for s in sources]
    step_dp = _step_dp(shapes, tr.steps) if shapes else np.full(tr.steps, tr.dp_size, dtype=np.int64)
    images = any(has_image_tokens(s.num_image_tokens) for s in sources)
    window = _draw_window(spec, base, images, lanes, step_dp)  # planning.draw_window where it applies, else 0
    # a windowed draw fills the rows, not fill x rows: its epochs and streams are checked and built for that
    drawn_targets = CumulativeTargets(weights, step_slots * tr.seq_len) if window else targets
    final = check_epochs(names, drawn_targets, epoch_tokens, [spec.source(n).max_epochs for n in names])
    max_seg = max(lanes.seq_len, lanes.long_seq_len or 0)
    reach = max_seg * (window + 4) if window else max_seg  # the window reads W segments past a source's share
    layouts = [layout_of(spec.source(s.name), s.runs, s.order) for s in sources]
    for s in sources:
        check_unsplittable(s.name, s.sample, s.num_tokens, s.num_image_tokens, lanes)

    epochs = [int((final[k] + reach) // tok) + 1 if tok else 1 for k, tok in enumerate(epoch_tokens)]

    def stream_of(k: int) -> Stream:
        s = sources[k]
        blocks = layouts[k] if spec.source(s.name).shuffle_blocks is not None else None
        # a fresh plan needs the stream through its last target (and a segment); a re-plan keeps whole epochs (its
        # base may have placed positions its own, shorter, targets do not reach)
        need = float(final[k]) + reach if base is None else None
        # a large source's permutation and expansion in parts on the usable cores (the same stream: _permute)
        return build_stream(s.name, spec.seed, s.num_tokens, lanes, epochs[k], blocks, need, parts=plan_threads())

    streams = per_source(stream_of, len(sources), [len(s.num_tokens) for s in sources])
    windowed: StepAssignment | None = None
    try:
        if window:
            ptr, windowed = window_membership(weights, streams, tr.seq_len, step_slots, window)
        else:
            ptr = membership(targets, streams, lanes, step_slots, give_back_room(step_dp, step_budget))
    except StreamRunOut as e:
        if window:
            raise PlanError(
                f"step {e.step}: source {names[e.source]!r}'s draw window (planning.draw_window {window}) reads past "
                "the segments of its stream this plan built (its data, or its max_epochs, ends there)"
            ) from None
        raise PlanError(
            f"step {e.step} draws no document: source {names[e.source]!r}, weighted at that step, has drawn past the "
            f"data its share needs (steps whose nearest draws are empty take one segment each: a budget of {budget} "
            f"tokens, dp_size*micro_batches*seq_len*{fill}, below the documents' lengths); raise "
            "micro_batches, dp_size or seq_len"
        ) from None
    shuffle = _shuffle_figures(spec, sources, layouts, streams, ptr)
    drawn_per_step = np.diff(ptr.totals()) if windowed is None else windowed.counts(tr.steps)  # segments a step
    trim_arenas()  # what membership's chunks and the figures freed, before the look-ahead's peak
    assignment = None
    carry: Segments | None = None
    # image samples cannot be split: with them in the mix membership stays as drawn (moved segments would
    # crowd steps the balancer must fit unsplittable samples into)
    lookahead = 0 if images or window else spec.planning.lookahead  # (dp 1: the look-ahead moves nothing)
    # a re-plan with look-ahead anywhere (the spec, the base, or the base's own base) finds its positions by
    # sets; with images in the mix (the base has the same index) every plan of the chain drew as membership did
    lookahead_replan = (
        base is not None
        and not images
        and not window
        and (lookahead > 0 or base.meta.spec.planning.lookahead > 0 or base.meta.parameters.resume is not None)
    )
    samples, num_tokens, num_images = (
        [s.sample for s in sources],
        [s.num_tokens for s in sources],
        [s.num_image_tokens for s in sources],
    )
    # on a cluster a fresh plan's look-ahead is worked out while the first ranges are balanced (_speculation)
    later = client is not None and base is None and lookahead > 0 and _speculate(client)
    counted = streams  # (the streams with their counts, which the look-ahead reads)
    if (lookahead > 0 or lookahead_replan) and not later:
        pos: Sequence[Positions]
        nat: Sequence[np.ndarray] | None
        if base is not None:  # what the base placed before S is excluded, what it drew before S and deferred is in
            pos, nat, carry = base_positions(
                base,
                ptr,
                streams,
                samples,
                num_tokens,
                num_images,
                lanes,
            )
        else:  # natural positions as ranges, their steps from ptr: nothing stored per position
            pos, nat = natural_ranges(ptr, start, tr.steps), None
        at_start = ptr.row(start)
        before = sum(  # short tokens of steps < start
            int((st.cum if st.cum_short is None else st.cum_short)[at_start[k]]) for k, st in enumerate(streams)
        )
        # the streams' counts are dropped as soon as the look-ahead has read the segment lengths from them
        assignment = assign_steps(
            pos,
            nat,
            streams,
            lanes,
            step_slots,
            step_dp,
            lookahead,
            start,
            tr.steps,
            planned_before=before,
            ptr=ptr,
            drop_counts=True,
            tolerance=spec.planning.lookahead_tolerance,
            # balancing here reads the assignment, not the pointers (their number of steps alone): their chunks go
            # once the natural steps are read (300 sources x dp 4: about 4 bytes a segment through the pass's and
            # balancing's peaks); the cluster's ranges still cut windows of them, a re-plan reads its base by them
            release_ptr=client is None and base is None,
        )
        del pos, nat  # the assignment holds what balancing needs
    if windowed is not None:  # its steps are the assignment (a re-plan reads steps >= start of it)
        assignment = windowed
    streams = [st.without_counts() for st in streams]
    if not later:
        del counted
    if assignment is not None and client is None and windowed is None:
        ptr = ptr.released()  # (their chunks let go in the look-ahead of a fresh plan: its steps alone kept)
    trim_arenas()  # the look-ahead's temporaries, the streams' counts and the pointers, before balancing
    empty = np.flatnonzero(drawn_per_step[start:] == 0)
    if len(empty):
        # membership fills a step its nearest pointers leave empty from the weighted source it leaves least ahead
        # (a source that has run out of its stream is refused there): a step stays empty only where no weighted
        # source's next segment fits the step's slots alone
        raise PlanError(
            f"step {int(empty[0]) + start} draws no document: no source weighted at that step has a next segment "
            f"that fits the step's sequences ({len(empty)} empty step(s)); raise micro_batches, dp_size or seq_len"
        )

    bounds = file_bounds(drawn_per_step)  # fixes the manifest partitions up front
    writer = ManifestWriter(out, plan_id, bounds)
    report = ReportBuilder(
        tr.steps,
        names,
        tr.dp_size,
        rank_from=start,
        budgets=step_budget if shapes else None,
        pp_size=tr.pp_size,
        weights=weights,
        step_tokens=int(step_budget.max()),  # what a step is planned to hold (fill < 1: a count above it widens)
        sparse=True,  # steps are recorded in step order here (ranges' reports are merged in order)
    )
    if base is not None:
        copy_base_rows(base, writer)
        report.seed(base_report_rows(base), start)
    if base is not None and not lookahead_replan:
        carry = base_carry(
            base,
            ptr,
            streams,
            samples,
            num_tokens,
            num_images,
            lanes,
        )
    work = PlanWork(
        plan_id=plan_id,
        names=names,
        samples=samples,
        num_tokens=num_tokens,
        num_image_tokens=num_images,
        streams=streams,
        ptr=ptr,
        assignment=assignment,
        cfg=BalanceConfig(dp=tr.dp_size, micro_batches=mb, lanes=lanes, cost_spec=spec.cost, seed=spec.seed),
        start=start,
        steps=tr.steps,
        bounds=bounds,
        pp_size=tr.pp_size,
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=tr.steps - start, desc="plan", unit="step")
    sink = work.sink(writer, report)
    if client is None:
        carry = _balance_into(sink, work, start, tr.steps, carry, bar)
        files = writer.close(tr.steps - 1)
    else:  # the partition holding a re-plan's first step (and base rows) here, the rest on the cluster
        head = start if start in bounds else work.bound_after(start)
        carry = _balance_into(sink, work, start, head, carry, bar)
        files = writer.close(head - 1) if head else []
        n = ranges if ranges is not None else RANGES_PER_WORKER * worker_count(client)

        def take(part: RangePart) -> None:
            merge_report(report, part.report, part.first)
            files.extend(part.files)
            if bar is not None:
                bar.update(part.stop - part.first)

        if head < tr.steps:
            lead = (early_ranges(n, worker_count(client)), EARLY_SIZE) if later else (0, 1.0)
            cut = split_ranges(work, n, head, lead)
            todo: PlanWork | Speculation = work
            if later:
                todo = _speculation(
                    work, worker_count(client), cut, counted, lanes, step_slots, step_dp, lookahead, spec
                )
                del counted
            carry = plan_ranges(client, todo, out, carry, cut, take)
            del todo
    if bar is not None:
        bar.close()
    del work, sink, ptr, streams, assignment  # the pointers, streams and look-ahead: not needed for the report
    report.write(out)
    report.set_shuffle(shuffle)
    summary = report.summary()
    resume: ResumeInfo | None = None
    if base is not None:
        summary["resumed"] = {"at_step": start, "imbalance": report.imbalance(start)}
        resume = resume_parameters(base)
    summary["unplaced_after_last_step"] = (
        []
        if carry is None
        else [
            {"source": names[int(k)], "sample": int(s), "offset": int(o), "length": int(n)}
            for k, s, o, n in zip(carry.source, carry.sample, carry.offset, carry.length, strict=True)
        ]
    )
    meta = PlanMeta(
        format_version=PLAN_FORMAT_VERSION,
        plan_id=plan_id,
        spec=spec,
        spec_hash=spec.spec_hash(),
        sources=names,
        index_fingerprints=fps,
        seed=spec.seed,
        steps=tr.steps,
        dp_size=tr.dp_size,
        micro_batches=tr.micro_batches,
        seq_len=tr.seq_len,
        long_seq_len=lanes.long_seq_len,
        long_cp_size=lanes.long_cp,
        parameters=PlanParameters(
            planner_version=PLANNER_VERSION,
            fill=fill,
            step_budget_tokens=budget,
            cost=spec.cost,
            short_cp_size=lanes.short_cp,
            long_threshold=lanes.threshold,
            baseline=BASELINE_DESCRIPTION,
            resume=resume,
            shape_schedule=shapes or None,
        ),
        manifest=files,
        summary=summary,
    )
    (out / "plan.json").write_text(meta.to_json())
    return meta


def _balance_into(
    sink: StepSink, work: PlanWork, first: int, stop: int, carry: Segments | None, bar: Any
) -> Segments | None:
    """Balance steps first..stop-1 in this process into `sink`, `carry` into the first; return the last carry."""
    for blk in balanced_blocks(work, first, stop, carry):
        sink.add_block(blk)
        carry = blk.carry
        if bar is not None:
            bar.update(blk.steps.stop - work.start - bar.n)
    if bar is not None:
        bar.update(stop - work.start - bar.n)
    return carry


EARLY_SHARE = 0.25
"""On a cluster, the share of the ranges (the first ones, a whole number a worker) balanced on a look-ahead over a
prefix of the steps while the whole look-ahead is worked out (planning._distributed.Speculation): enough that every
worker is busy while it is, no more (the prefix's look-ahead is serial, and worked out twice). 50M samples, dp 64, 2
workers (session 32): one range a worker (0.25) costs 1.85-2.04 CPU-s against the whole look-ahead's 1.5-1.85, and its
prefix look-ahead 0.41-0.59 CPU-s against 1.10-1.40 at 0.5 (two ranges a worker, 3.0-3.6 CPU-s): the critical path
on idle cores 0.6-1.1 CPU-s shorter over 8 rounds. Measured: docs/planning.md."""
EARLY_SIZE = 1.0
"""On a cluster that speculates, the first ranges' size (drawn segments) against each later range's: larger, the
first ranges end no earlier than the whole look-ahead beside them (a worker's path is its first ranges or the whole
look-ahead, whichever ends later, then the rest), at the cost of a longer prefix look-ahead (serial). With the
workers warmed (planning._warm) a first range takes 1.3-1.6 CPU-s at 50M x 2 sources dp 64 against the whole
look-ahead's 1.4-1.9: 1.25 against 1.0 over 4 rounds (2 swapped) moved the critical path on idle cores by nothing
measurable (8.72-9.02 against 8.80-9.34 CPU-s, chain speedup 1.58-1.60x against 1.54-1.63x; whichever ran second
was ahead in all 4); kept at 1.0. Measured: docs/planning.md."""
EARLY_MARGIN = 64
"""Steps past the first ranges' last that the prefix's look-ahead also covers, plus 8 * (lookahead + 1). A margin
makes agreement likely, never certain: the look-ahead's choices near the prefix's end can differ from the whole's
many steps earlier (long_lane_cp4, lookahead 2: a prefix 3 steps past the first ranges differs at step 5), so the
guarantee is StepAssignment.agrees, checked before the ranges are kept (else they are balanced again)."""


SPECULATE: bool | None = None
"""Whether a fresh plan on a cluster balances its first ranges on a prefix's look-ahead (_speculation): None where
this host has a core beyond the cluster's worker threads on it (the prefix's look-ahead is worked out twice, and
the whole one runs beside the workers: on cores the workers fill, that costs more wall clock than it hides;
measured on this 2-core machine with 2 local workers, docs/planning.md); True or False always."""


def _speculate(client: Executor) -> bool:
    """SPECULATE, or (None) whether this host has more cores than the cluster's worker threads on it."""
    if SPECULATE is not None:
        return SPECULATE
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores > local_threads(client)


def early_ranges(ranges: int, workers: int) -> int:
    """How many of `ranges` ranges go out on a prefix's look-ahead: EARLY_SHARE of them, rounded to a whole number
    a worker where there are that many (the workers then wait alike for the rest)."""
    early = round(ranges * EARLY_SHARE)
    return early - early % workers if workers > 1 and early >= workers else early


def _speculation(
    work: PlanWork,
    workers: int,
    cut: list[tuple[int, int]],
    counted: list[Stream],
    lanes: Lanes,
    step_slots: np.ndarray,
    step_dp: np.ndarray,
    lookahead: int,
    spec: Spec,
) -> PlanWork | Speculation:
    """A fresh plan's look-ahead on a cluster: over a prefix of the steps now (the first EARLY_SHARE of the ranges
    and EARLY_MARGIN steps more) and over every step when plan_ranges asks (while those ranges are balanced); or,
    where the prefix would reach the last step, the whole work at once. `counted`: the streams with their counts
    (emptied once the whole look-ahead has read them)."""
    ptr, steps = work.ptr, work.steps
    early = early_ranges(len(cut), workers)
    through = cut[early - 1][1] if early >= 1 else 0
    reach = min(steps, through + EARLY_MARGIN + 8 * (lookahead + 1))

    def look(stop: int, streams: list[Stream], drop: bool, alloc: Allocate | None = None) -> StepAssignment:
        return assign_steps(
            natural_ranges(ptr, 0, stop),
            None,
            streams,
            lanes,
            step_slots,
            step_dp,
            lookahead,
            0,
            stop,
            final=stop == steps,
            ptr=ptr,
            drop_counts=drop,
            tolerance=spec.planning.lookahead_tolerance,
            alloc=alloc,
        )

    done: list[PlanWork] = []

    def finish(alloc: Allocate | None = None) -> PlanWork:
        if not done:  # once: it drops the streams' counts as it reads them, so a second run would differ
            whole = look(steps, counted, True, alloc)  # (each stream's counts dropped once read)
            counted.clear()
            trim_arenas()
            done.append(replace(work, assignment=whole))
        return done[0]

    if early < 1 or reach >= steps:
        return finish()
    prefix = look(reach, list(counted), False)
    return Speculation(work=replace(work, assignment=prefix), through=through, finish=finish)


def _shuffle_figures(
    spec: Spec,
    sources: list[_Source],
    layouts: list[BlockLayout],
    streams: list[Stream],
    ptr: Pointers,
) -> dict[str, dict[str, float | int | str]]:
    """Per source, what its shuffle gives and costs in reads (planning._shuffle), over the stream it draws."""
    out: dict[str, dict[str, float | int | str]] = {}
    last = ptr.last()
    for k, s in enumerate(sources):
        st = streams[k]
        m = min(int(last[k]), FIGURE_SEGMENTS)  # (the segments' tokens: the stream's count, no lengths gathered)
        figs = shuffle_figures(spec.source(s.name), layouts[k], st.doc[:m], None, s.num_tokens, tokens=int(st.cum[m]))
        out[s.name] = figs.to_dict()
    return out


def _draw_window(spec: Spec, base: BasePlan | None, images: bool, lanes: Lanes, step_dp: np.ndarray) -> int:
    """planning.draw_window where every step is at dp 1 (0 where none is: steps at dp > 1 keep membership's rule;
    and with image samples in the mix, which stay as drawn, as with the look-ahead); PlanError where it cannot hold:
    steps at dp 1 and dp > 1 in one plan (a re-plan to or from another dp), a long lane, a re-plan whose base drew
    with another window or carried segments into the re-plan's first step."""
    w = spec.planning.draw_window
    if base is not None and base.meta.spec.planning.draw_window != w:
        raise PlanError(
            f"planning.draw_window differs (base {base.meta.spec.planning.draw_window}, spec {w}): a re-plan keeps "
            "its base's draw (its steps before the resume step are drawn again to continue its streams)"
        )
    dp1 = step_dp == 1
    if w == 0 or images or not dp1.any():
        return 0
    if not dp1.all():
        first = int(np.flatnonzero(~dp1)[0] if dp1[0] else np.flatnonzero(dp1)[0])
        raise PlanError(
            f"planning.draw_window {w} needs every step at dp 1, but step {first} is at dp {int(step_dp[first])} and "
            f"step 0 at dp {int(step_dp[0])}: a re-plan to or from another dp_size continues with draw_window 0 only "
            "(plan the base with draw_window 0, or keep dp_size 1)"
        )
    if lanes.has_long:
        raise PlanError(f"planning.draw_window {w} does not take a long_context lane yet; set draw_window to 0")
    if base is not None:
        rows = base_report_rows(base, ["deferred_tokens"])
        if rows is not None and rows["deferred_tokens"][base.at_step - 1] > 0:
            raise PlanError(
                f"planning.draw_window {w}: the base plan carried segments into step {base.at_step}; re-plan from a "
                "step the base carried nothing into"
            )
    return w


def _step_slots(shapes: list[StepShape], steps: int) -> np.ndarray:
    """Slots (dp_size * micro_batches) of every step from a shape schedule."""
    first = np.array([sh.from_step for sh in shapes], dtype=np.int64)
    slots = np.array([sh.dp_size * sh.micro_batches for sh in shapes], dtype=np.int64)
    return slots[np.searchsorted(first, np.arange(steps), side="right") - 1]


def _step_dp(shapes: list[StepShape], steps: int) -> np.ndarray:
    """dp_size of every step from a shape schedule."""
    first = np.array([sh.from_step for sh in shapes], dtype=np.int64)
    dp = np.array([sh.dp_size for sh in shapes], dtype=np.int64)
    return dp[np.searchsorted(first, np.arange(steps), side="right") - 1]
