"""make_plan: spec + index tables -> plan dir (plan.json, manifest partitions, report), atomic and idempotent.

The plan id is a content hash of (the spec's canonical JSON, the index fingerprints, PLANNER_VERSION),
so the same inputs give the same id and byte-identical files; planning an id that already exists
complete is a no-op. Files are written into a temporary folder beside the target and renamed into place.
Per step the work is NumPy over that step's segments (membership slices, balancing rounds of dp_size,
the baseline, manifest rows); nothing loops per sample. Segments and costs are gathered a block of steps
at a time (_items); up to dp BLOCK_DP_MAX the LPT rounds, local search and baseline sequences of a block
are computed at once too (_deal_many, _refine_many, _baseline), since there a step is a few dozen
segments and NumPy's fixed cost per call would dominate; a step that has anything carried in or deferred
recomputes its own (the same bytes either way). Segments a step had no room for (image samples
that cannot be split; rare) go first into the next step; any left after the last step are listed in
the summary (`unplaced_after_last_step`), never dropped silently.
`resume_from=PlanResume(plan_dir=..., at_step=S)` makes an elastic re-plan (see _resume): steps < S are the
base's rows, later steps continue its streams and in-flight pieces with the spec's training shape; the
per-step budgets then follow `parameters.shape_schedule`.

Measured (benchmarks/plan_scale.py, dp 1024, 4 x 4K slots, this 2-core machine): about 1.3-1.6M
indexed samples/s and 47-92 bytes of peak RSS per sample above the interpreter's (1M-50M samples);
the index tables themselves are 28 of those bytes. At dp 8 (`--dp 8`: 1M samples are 8,323 steps of ~120
segments) about 0.6M samples/s, at dp 64 about 1.1M (before block balancing: 0.22M and 0.7M).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from loomdata.planning._balance import Dealt, balance_step, deal_baseline
from loomdata.planning._baseline import baseline_sequences, baseline_sequences_many
from loomdata.planning._deal_many import deal_many
from loomdata.planning._items import Items as _Items
from loomdata.planning._items import StepItems
from loomdata.planning._manifest import ManifestWriter
from loomdata.planning._mixture import Stream, build_stream, check_epochs, membership, step_weights
from loomdata.planning._packing import Lanes, check_unsplittable
from loomdata.planning._refine_many import refine_many
from loomdata.planning._report import ReportBuilder
from loomdata.planning._resume import (
    BasePlan,
    PlanResume,
    base_carry,
    base_report_rows,
    copy_base_rows,
    open_base,
    resume_parameters,
)
from loomdata.schemas.errors import PlanError
from loomdata.schemas.layout import read_index
from loomdata.schemas.plan import PLAN_FORMAT_VERSION, PlanMeta, read_plan
from loomdata.schemas.spec import Spec
from loomdata.schemas.tables import TableKind, check_schema

__all__ = ["PLANNER_VERSION", "PlanResult", "PlanResume", "make_plan"]

PLANNER_VERSION = "4"
"""Part of the plan id: bump it whenever the planner's output for the same inputs changes."""
FILL = 0.96
"""Share of a step's slot capacity (dp * micro_batches * seq_len) the mixture draws: room to balance cost."""
BLOCK_DP_MAX = 256
"""Up to this dp_size, steps are balanced a block at a time (see _block_ahead): many steps of few segments
each, where NumPy's fixed cost per call dominates. Larger steps are balanced one by one (same bytes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """Where a plan lives and its plan.json."""

    plan_dir: Path
    meta: PlanMeta


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    sample: np.ndarray
    num_tokens: np.ndarray
    num_image_tokens: np.ndarray


def make_plan(
    spec: Spec,
    *,
    progress: bool = False,
    index: Mapping[str, pa.Table] | None = None,
    fingerprints: Mapping[str, str] | None = None,
    resume_from: PlanResume | None = None,
) -> PlanResult:
    """Plan `spec` over its index (read from spec.workdir unless `index` is given) into workdir/plans/<id>/.

    With `resume_from`, an elastic re-plan: steps < resume_from.at_step are the base plan's rows and later
    steps continue its streams with spec's (new) training shape (see _resume).
    """
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
        meta = _plan_into(tmp, plan_id, spec, weights, sources, fps, progress, base)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PlanResult(plan_dir=final, meta=meta)


def plan_id_of(spec: Spec, fingerprints: Mapping[str, str], resume: tuple[str, int] | None = None) -> str:
    """Content hash of the spec, the index fingerprints, the planner version and (re-plans) base id and step."""
    content: dict[str, object] = {
        "spec": spec.canonical_json(),
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
    cols = ["sample", "num_tokens", "num_image_tokens"]
    out: list[_Source] = []
    fps: dict[str, str] = {}
    for name in spec.source_names:
        if index is None:
            table, _, fp = read_index(spec.workdir, name, columns=cols)
        else:
            if name not in index:
                raise PlanError(f"no index table given for source {name!r} (given: {', '.join(sorted(index))})")
            table = index[name]
            check_schema(table, TableKind.INDEX, f"index table of source {name!r}")
            fp = fingerprints[name] if fingerprints is not None and name in fingerprints else _fingerprint(table)
        if fingerprints is not None and name in fingerprints:
            fp = fingerprints[name]
        fps[name] = fp
        out.append(
            _Source(
                name,
                _np(table, "sample"),
                _np(table, "num_tokens"),
                _np(table, "num_image_tokens"),
            )
        )
    return out, fps


def _np(table: pa.Table, col: str) -> np.ndarray:
    arr = table.column(col)
    return arr.combine_chunks().to_numpy() if arr.num_chunks != 1 else arr.chunk(0).to_numpy()


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
    weights: np.ndarray,
    sources: list[_Source],
    fps: dict[str, str],
    progress: bool,
    base: BasePlan | None = None,
) -> PlanMeta:
    tr = spec.training
    lanes = Lanes.of(spec)
    slots = tr.dp_size * tr.micro_batches
    budget = int(slots * tr.seq_len * FILL)
    if budget < 1:
        raise PlanError(f"step budget is {budget} tokens; raise training.seq_len, dp_size or micro_batches")
    names = [s.name for s in sources]
    mb = tr.micro_batches
    start = 0 if base is None else base.at_step
    shapes = [] if base is None else [*base.shapes, {"from_step": start, "dp_size": tr.dp_size, "micro_batches": mb}]
    step_slots = _step_slots(shapes, tr.steps) if shapes else np.full(tr.steps, slots, dtype=np.int64)
    step_budget = (step_slots * tr.seq_len * FILL).astype(np.int64)
    targets = np.cumsum(weights * step_budget[:, None], axis=0)
    epoch_tokens = [int(s.num_tokens.sum(dtype=np.int64)) for s in sources]
    check_epochs(names, targets, epoch_tokens, [spec.source(n).max_epochs for n in names])
    max_seg = max(lanes.seq_len, lanes.long_seq_len or 0)
    streams: list[Stream] = []
    for k, s in enumerate(sources):
        check_unsplittable(s.name, s.sample, s.num_tokens, s.num_image_tokens, lanes)
        epochs = int((targets[-1, k] + max_seg) // epoch_tokens[k]) + 1 if epoch_tokens[k] else 1
        streams.append(build_stream(s.name, spec.seed, s.num_tokens, lanes, epochs))
    ptr = membership(targets, streams, lanes, step_slots)
    drawn = sum(np.diff(st.cum[ptr[start:, k]]) for k, st in enumerate(streams))
    streams = [st.without_counts() for st in streams]
    empty = np.flatnonzero(np.asarray(drawn) == 0)
    if len(empty):
        raise PlanError(
            f"step {int(empty[0]) + start} draws no document: its budget of {budget} tokens "
            f"(dp_size*micro_batches*seq_len*{FILL}) cannot be filled by any source's next document "
            f"({len(empty)} empty step(s)); raise micro_batches, dp_size or seq_len"
        )

    writer = ManifestWriter(out, plan_id)
    report = ReportBuilder(tr.steps, names, tr.dp_size, rank_from=start, budgets=step_budget if shapes else None)
    carry: _Items | None = None
    if base is not None:
        copy_base_rows(base, writer)
        report.seed(base_report_rows(base), start)
        carry = base_carry(
            base,
            ptr,
            streams,
            [s.sample for s in sources],
            [s.num_tokens for s in sources],
            [s.num_image_tokens for s in sources],
            lanes,
        )
    steps_iter: Iterable[int] = range(start, tr.steps)
    if progress:
        from tqdm import tqdm

        steps_iter = tqdm(steps_iter, desc="plan", unit="step")
    items = StepItems(
        [s.sample for s in sources],
        [s.num_tokens for s in sources],
        [s.num_image_tokens for s in sources],
        streams,
        ptr,
        lanes,
        spec.cost,
    )
    ahead: dict[int, tuple[Dealt, np.ndarray]] = {}
    for t in steps_iter:
        if tr.dp_size <= BLOCK_DP_MAX and t not in ahead:
            ahead = _block_ahead(items, t, spec, lanes)
        pre, seq = ahead.pop(t, (None, None))
        carry = _plan_step(t, spec, lanes, len(sources), items, weights[t], carry, writer, report, pre, seq)
    files = writer.close(tr.steps - 1)
    report.write(out)
    summary = report.summary()
    parameters: dict[str, object] = {}
    if base is not None:
        summary["resumed"] = {"at_step": start, "imbalance": report.imbalance(start)}
        parameters = {"resume": resume_parameters(base), "shape_schedule": shapes}
    summary["unplaced_after_last_step"] = (
        []
        if carry is None
        else [
            {"source": names[int(k)], "sample": int(s), "offset": int(o), "length": int(n)}
            for k, s, o, n in zip(carry[0], carry[1], carry[2], carry[3], strict=True)
        ]
    )
    meta = PlanMeta(
        format_version=PLAN_FORMAT_VERSION,
        plan_id=plan_id,
        spec=spec.model_dump(mode="json"),
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
        parameters={
            "planner_version": PLANNER_VERSION,
            "fill": FILL,
            "step_budget_tokens": budget,
            "cost": spec.cost.model_dump(mode="json"),
            "short_cp_size": lanes.short_cp,
            "long_threshold": lanes.threshold,
            "baseline": "shuffled segments, next-fit packing per lane, sequences dealt round-robin",
            **parameters,
        },
        manifest=files,
        summary=summary,
    )
    (out / "plan.json").write_text(meta.to_json())
    return meta


def _block_ahead(items: StepItems, t: int, spec: Spec, lanes: Lanes) -> dict[int, tuple[Dealt, np.ndarray]]:
    """The balancer's LPT rounds and local search and the baseline's sequences of the block of steps holding t,
    computed for the whole block at once as if no step had anything carried in or deferred (each step
    uses them only if so; else it computes its own)."""
    tr = spec.training
    steps = items.block(t)
    blk = [items.step(s) for s in steps]
    dealt = deal_many([(d[3], c, d[4]) for d, c in blk], dp=tr.dp_size, micro_batches=tr.micro_batches, lanes=lanes)
    whole = [i for i, d in enumerate(dealt) if not (d.p_rank[d.order] < 0).any()]  # no leftovers
    refine_many(dealt, [c for _, c in blk], whole, [d[4] for d, _ in blk])
    seqs = baseline_sequences_many(steps, spec.seed, [(d[3], d[4]) for d, _ in blk], lanes)
    return dict(zip(steps, zip(dealt, seqs, strict=True), strict=True))


def _step_slots(shapes: list[dict[str, int]], steps: int) -> np.ndarray:
    """Slots (dp_size * micro_batches) of every step from a shape schedule [{from_step, dp_size, micro_batches}]."""
    first = np.array([sh["from_step"] for sh in shapes], dtype=np.int64)
    slots = np.array([sh["dp_size"] * sh["micro_batches"] for sh in shapes], dtype=np.int64)
    return slots[np.searchsorted(first, np.arange(steps), side="right") - 1]


def _plan_step(
    t: int,
    spec: Spec,
    lanes: Lanes,
    n_sources: int,
    items: StepItems,
    weights: np.ndarray,
    carry: _Items | None,
    writer: ManifestWriter,
    report: ReportBuilder,
    dealt: Dealt | None,
    base_seq: np.ndarray | None,
) -> _Items | None:
    """Balance step t, compute its baseline, write its manifest rows and record its figures.

    `carry` holds image samples the previous step had no room for; they go first into this step.
    Returns this step's carry. `dealt` and `base_seq`: the step's LPT rounds and baseline sequences
    computed as if nothing were carried in or deferred (used only when so).
    """
    tr = spec.training
    drawn, cost = items.step(t)
    if carry is not None:
        drawn = tuple(np.concatenate([c, d]) for c, d in zip(carry, drawn, strict=True))  # type: ignore[assignment]
        cost = np.concatenate([items.cost_of(carry[3], carry[5], carry[4]), cost])
    src_id, sample, offset, length, lane, img = drawn
    asg = balance_step(
        length,
        cost,
        lane,
        img == 0,
        dp=tr.dp_size,
        micro_batches=tr.micro_batches,
        lanes=lanes,
        cost_spec=spec.cost,
        carried=0 if carry is None else len(carry[0]),
        dealt=None if carry is not None else dealt,
    )
    next_carry: _Items | None = None
    in_step = np.ones(len(length), dtype=bool)
    if len(asg.deferred):
        d, delta, rest = asg.deferred.T
        next_carry = (src_id[d], sample[d], (offset[d] + delta).astype(np.uint32), rest, lane[d], img[d])
        in_step[d[delta == 0]] = False  # wholly deferred: not part of this step (for LB and the baseline)
    step_cost = cost[in_step]
    if carry is None and base_seq is not None and in_step.all():
        pass  # the block's baseline (computed as if nothing is carried in or deferred) holds
    else:
        base_seq = baseline_sequences(t, spec.seed, length[in_step], lane[in_step], lanes)
    base = deal_baseline(base_seq, step_cost, tr.dp_size, tr.micro_batches)
    placed_src = src_id[asg.item]
    writer.add(
        t,
        {
            "dp_rank": asg.rank,
            "micro_batch": asg.micro_batch,
            "source": placed_src,
            "sample": sample[asg.item],
            "offset": offset[asg.item].astype(np.int64) + asg.delta,
            "length": asg.length,
            "lane": asg.lane,
        },
    )
    lb = max(float(step_cost.sum()) / tr.dp_size, float(step_cost.max()))
    tokens = np.bincount(placed_src, weights=asg.length, minlength=n_sources).astype(np.int64)
    base_per_slot = (int(base_seq.max()) + 1) / (tr.dp_size * tr.micro_batches)
    deferred = 0 if next_carry is None else int(next_carry[3].sum())
    rank_max_item = np.zeros(tr.dp_size)
    if len(asg.rank):  # rows are sorted by rank: one reduceat gives each rank's largest segment
        change = np.empty(len(asg.rank), dtype=bool)
        change[0] = True
        np.not_equal(asg.rank[1:], asg.rank[:-1], out=change[1:])
        starts = change.nonzero()[0]
        rank_max_item[asg.rank[starts]] = np.maximum.reduceat(cost[asg.item], starts)
    report.add(t, tokens, weights, lb, asg.rank_cost, base, asg.slot_cost, base_per_slot, deferred, rank_max_item)
    if next_carry is not None and len(next_carry[0]) > tr.dp_size * tr.micro_batches:
        raise PlanError(
            f"step {t}: {len(next_carry[0])} samples with images found no room and wait for the next step, more "
            f"than it has sequences ({tr.dp_size * tr.micro_batches}): the mixture holds more image samples "
            "than sequences can take; raise micro_batches or seq_len, or lower the image sources' weights"
        )
    return next_carry
