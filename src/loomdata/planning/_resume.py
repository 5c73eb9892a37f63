"""Elastic re-planning: continue a stored plan from step S for a new training shape (dp_size, micro_batches).

Use: `make_plan(spec, resume_from=PlanResume(plan_dir=base_dir, at_step=S))`, where `spec` is the base
plan's spec with the new `training.dp_size` / `micro_batches` (and, if wanted, more or fewer `steps`).

Semantics. The new plan holds every step 0..steps-1:
- steps < S are the base plan's manifest rows, copied unchanged (so they keep the base's shape: dp ranks
  and micro-batches of the base; a job resumed at S reads only steps >= S). The report's per-step rows
  for steps < S are the base's too.
- from step S on, every source continues its seeded permutation stream exactly where the base's step
  membership stood before step S (same epochs, same seeds), with the new step budget
  (new dp_size * micro_batches * seq_len * fill) and the same mixture schedule. The credit accumulator
  keeps running: the cumulative target of source k through step t is sum_{s <= t} w[s, k] * budget[s],
  where budget[s] is the budget of the shape step s was planned with, so the realized mixture stays on
  target across the change.
- Whatever the base had drawn before S but not yet placed (image samples, or the rest of a split text
  segment, deferred from step S-1 to step S) goes first into step S of the new plan; nothing the base
  placed before S is drawn again within that epoch. So the union of the base's steps < S and the new
  steps >= S plans every token once per source epoch.
The in-flight rest is found without replaying the base: the base's report says which steps deferred
tokens; from the last step t0 < S into which nothing was carried, the segments the streams drew for
steps t0..S-1 minus the pieces the base's manifest placed in those steps are what was still in flight
(placed pieces of a segment are always a prefix of it, so the rest is a suffix).

Look-ahead membership (planning.lookahead > 0 in the spec, the base or a base before it; see _lookahead):
steps of the base were not pointer ranges, so the base's manifest before S is the truth (base_positions):
its pieces are matched to stream positions by (document, segment) key, earliest occurrence first; the new
steps plan every position before the new plan's last pointer that the base did not place (those it drew
before S and placed later get natural step S), a partly placed segment's rest is the carry into S. The
look-ahead restarts at S, so with the base's own shape the new steps are not the base's bytes (K = 0 they
are). Changing K at a re-plan is allowed.

Compatibility. The base must have been made by this planner version (or one of the same content:
`SAME_CONTENT`), over the same sources (same order), the same index fingerprints, seed, mixture, shuffle
settings, planning.fill, seq_len and long_context; else PlanError lists every difference. The base may itself
be a re-plan: `parameters.shape_schedule` records the shape of every step range ([{from_step, dp_size,
micro_batches}], only in re-planned plans), so chains of re-plans reproduce the same membership. The new
plan's id hashes the spec, the index fingerprints, the planner version, the base plan id and S; plan.json
`parameters.resume` holds {base_plan_id, at_step, base_dp_size, base_micro_batches}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loomdata.planning._manifest import ManifestWriter
from loomdata.planning._mixture import Stream
from loomdata.planning._packing import Lanes
from loomdata.planning._pointers import Pointers
from loomdata.planning._report import source_columns
from loomdata.planning._segments import DenseIds, SampleIds, Segments
from loomdata.schemas.errors import PlanError
from loomdata.schemas.plan import PlanMeta, ResumeInfo, StepShape, read_manifest, read_plan, stale_sources
from loomdata.schemas.spec import Spec
from loomdata.schemas.tables import TableKind, read_steps

__all__ = [
    "BasePlan",
    "PlanResume",
    "base_carry",
    "base_positions",
    "base_report_rows",
    "copy_base_rows",
    "open_base",
    "resume_parameters",
    "shape_schedule",
]

_STEPS_FILE = "report/steps.parquet"
_PLACED = ["source", "sample", "offset", "length"]
"""The manifest columns matching placed pieces to stream positions needs (not the slot columns)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResume:
    """Re-plan from `at_step` of the plan in `plan_dir`: steps before it are that plan's, later ones new."""

    plan_dir: Path
    at_step: int

    def __post_init__(self) -> None:
        """Reject a negative step early (the range against the plans is checked by make_plan)."""
        if self.at_step < 0:
            raise PlanError(f"resume at_step must be >= 0, got {self.at_step}")


@dataclass(frozen=True, slots=True)
class BasePlan:
    """A validated base plan: where it is, its plan.json, the resume step and the shape of steps before it."""

    plan_dir: Path
    meta: PlanMeta
    at_step: int
    shapes: list[StepShape]  # of steps < at_step


def shape_schedule(meta: PlanMeta) -> list[StepShape]:
    """The shape of every step range of a plan: its recorded schedule, or its one shape from step 0."""
    return meta.parameters.shapes(meta.dp_size, meta.micro_batches)


SAME_CONTENT: tuple[frozenset[str], ...] = (frozenset({"7", "8", "9"}),)
"""Planner versions whose plans hold the same rows and figures for the same inputs (8 changed only the manifest's
and the report's Parquet encoding; 9 only where the report keeps its (step, source) token counts and weights,
_report.source_columns reading either): a base made by one re-plans under another of its set."""


def same_content(a: str, b: str) -> bool:
    """Whether planner versions `a` and `b` make plans of the same content (a base of one re-plans under the other)."""
    return a == b or any(a in group and b in group for group in SAME_CONTENT)


def open_base(resume: PlanResume, spec: Spec, fingerprints: dict[str, str], planner_version: str) -> BasePlan:
    """Read the base plan and check that `spec` can continue it at resume.at_step; PlanError lists what differs."""
    plan_dir = Path(resume.plan_dir)
    meta = read_plan(plan_dir)
    s = resume.at_step
    problems: list[str] = []
    if not same_content(meta.parameters.planner_version, planner_version):
        problems.append(
            f"planner version differs (base {meta.parameters.planner_version}, this loomdata {planner_version}):"
            " re-plan with the loomdata that made the base, or plan afresh"
        )
    if meta.sources != spec.source_names:
        problems.append(f"sources differ (base {meta.sources}, spec {spec.source_names}): same names in the same order")
    fp_diff = stale_sources(meta, fingerprints, spec.source_names)
    if fp_diff:
        problems.append(f"index fingerprints differ: {', '.join(fp_diff)}: the index changed since the base plan")
    if meta.seed != spec.seed:
        problems.append(f"seed differs (base {meta.seed}, spec {spec.seed})")
    if meta.spec.mixture != spec.mixture:
        problems.append(
            f"mixture differs (base {meta.spec.mixture.model_dump(mode='json')}, "
            f"spec {spec.mixture.model_dump(mode='json')})"
        )
    base_shuffle = {s.name: s.shuffle_blocks for s in meta.spec.sources}
    new_shuffle = {s.name: s.shuffle_blocks for s in spec.sources}
    if base_shuffle != new_shuffle:
        problems.append(
            f"shuffle differs (base {base_shuffle}, spec {new_shuffle}; None: global, else (block_size, window))"
        )
    if meta.parameters.fill != spec.planning.fill:
        problems.append(f"planning.fill differs (base {meta.parameters.fill}, spec {spec.planning.fill})")
    if meta.seq_len != spec.training.seq_len:
        problems.append(f"training.seq_len differs (base {meta.seq_len}, spec {spec.training.seq_len})")
    if meta.spec.long_context != spec.long_context:
        base_lc, spec_lc = (
            None if lc is None else lc.model_dump(mode="json") for lc in (meta.spec.long_context, spec.long_context)
        )
        problems.append(f"long_context differs (base {base_lc}, spec {spec_lc})")
    if not 1 <= s <= meta.steps:
        problems.append(f"at_step {s} is outside the base plan's steps 1..{meta.steps} (step 0: plan afresh)")
    if s >= spec.training.steps:
        problems.append(f"at_step {s} leaves no step to plan (training.steps is {spec.training.steps})")
    if problems:
        raise PlanError(
            f"cannot re-plan from step {s} of plan {meta.plan_id} ({plan_dir}): "
            + "; ".join(problems)
            + ". Use the base plan's spec with only training.dp_size, micro_batches or steps changed"
        )
    shapes = [sh for sh in shape_schedule(meta) if sh.from_step < s]
    return BasePlan(plan_dir, meta, s, shapes)


def copy_base_rows(base: BasePlan, writer: ManifestWriter) -> None:
    """Append the base's manifest rows of steps < at_step to `writer`, step by step, unchanged."""
    cols = ["dp_rank", "micro_batch", "source", "sample", "offset", "length", "lane"]
    for f in base.meta.manifest:
        if f.first_step >= base.at_step:
            break
        last = min(f.last_step, base.at_step - 1)
        table = read_manifest(base.plan_dir, base.meta, f.first_step, last)
        data = {c: table.column(c).to_numpy() for c in ["step", *cols]}
        bounds = np.searchsorted(data["step"], np.arange(f.first_step, last + 2))
        for i, t in enumerate(range(f.first_step, last + 1)):
            a, b = int(bounds[i]), int(bounds[i + 1])
            writer.add(t, {c: data[c][a:b] for c in cols})


def base_report_rows(base: BasePlan, columns: list[str] | None = None) -> dict[str, np.ndarray] | None:
    """The base's report/steps.parquet `columns` (default all, and then every source's `tokens__<name>` and
    `weight__<name>`, wherever its planner version stored them: _report.source_columns) for steps < at_step,
    read by step range (only the row groups holding those steps); None when the base has no report."""
    path = base.plan_dir / _STEPS_FILE
    if not path.exists():
        return None
    table = read_steps(path, TableKind.PLAN_STEPS, 0, base.at_step - 1, columns)
    rows = {name: table.column(name).to_numpy() for name in table.column_names}
    if columns is None and base.at_step > 0 and not any(n.startswith("tokens__") for n in rows):  # version 9 on
        rows.update(source_columns(base.plan_dir, list(base.meta.sources), 0, base.at_step - 1))
    return rows


def _carry_window_start(base: BasePlan) -> int:
    """The last step t0 <= at_step into which the base carried nothing (0 when unknown)."""
    rows = base_report_rows(base, ["deferred_tokens"])
    if rows is None:
        return 0
    carried = rows["deferred_tokens"] > 0  # step t deferred tokens into step t+1
    free = np.flatnonzero(~carried)
    return int(free[-1]) + 1 if len(free) else 0


def base_carry(
    base: BasePlan,
    ptr: Pointers,
    streams: Sequence[Stream],
    samples: Sequence[SampleIds],
    lengths: Sequence[np.ndarray],
    images: Sequence[np.ndarray],
    lanes: Lanes,
) -> Segments | None:
    """Segments the base drew before at_step but had not placed by then, the carry into step at_step; None
    when there is none."""
    s = base.at_step
    t0 = _carry_window_start(base)
    if t0 >= s:
        return None
    placed = read_manifest(base.plan_dir, base.meta, t0, s - 1, columns=_PLACED)
    p_src = placed.column("source").to_numpy()
    parts: list[tuple[np.ndarray, ...]] = []
    row_t0, row_s = ptr.row(t0), ptr.row(s)
    for k, st in enumerate(streams):
        a, b = int(row_t0[k]), int(row_s[k])
        sel = p_src == k
        if b <= a:
            if sel.any():
                raise _mismatch(base, k, "placed pieces of a source it drew nothing of")
            continue
        doc, off, seg_len, _ = st.segments(a, b, lengths[k], lanes)
        rows = _rows_of(base, k, samples[k], placed.column("sample").to_numpy()[sel])
        p_off = placed.column("offset").to_numpy()[sel].astype(np.int64)
        p_len = placed.column("length").to_numpy()[sel].astype(np.int64)
        cap = lanes.capacity(lanes.lane_of(lengths[k][rows]))
        p_seg = p_off // cap * cap  # a placed piece lies inside one segment; segments start at multiples of cap
        keys = np.concatenate([np.stack([doc.astype(np.int64), off.astype(np.int64)], 1), np.stack([rows, p_seg], 1)])
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        nd = len(doc)
        drawn = np.bincount(inv[:nd], minlength=len(uniq))
        key_len = np.zeros(len(uniq), dtype=np.int64)
        key_len[inv[:nd]] = seg_len
        done = np.bincount(inv[nd:], weights=p_len, minlength=len(uniq)).astype(np.int64)
        rest = drawn * key_len - done
        if (rest < 0).any() or (drawn[inv[nd:]] == 0).any():
            raise _mismatch(base, k, "placed pieces its membership did not draw")
        left = np.flatnonzero(rest > 0)
        if len(left) == 0:
            continue
        whole, part = rest[left] // key_len[left], rest[left] % key_len[left]
        # a partly placed segment keeps its suffix; segments drawn twice in the window (two epochs) and
        # not placed at all come back whole
        cut, again = left[part > 0], np.repeat(left, whole)
        r_key = np.concatenate([cut, again])
        r_off = np.concatenate([uniq[cut, 1] + key_len[cut] - part[part > 0], uniq[again, 1]])
        r_len = np.concatenate([part[part > 0], key_len[again]])
        order = np.lexsort((r_off, uniq[r_key, 0]))
        row = uniq[r_key[order], 0]
        r_off, r_len = r_off[order], r_len[order]
        ntok = lengths[k][row].astype(np.int64)
        parts.append(
            (
                np.full(len(row), k, dtype=np.uint16),
                samples[k][row],
                r_off.astype(np.uint32),
                r_len,
                lanes.lane_of(ntok),
                np.where(r_len == ntok, images[k][row], 0),
            )
        )
    if not parts:
        return None
    return Segments.concat([Segments(*p) for p in parts])


def base_positions(
    base: BasePlan,
    ptr: Pointers,
    streams: Sequence[Stream],
    samples: Sequence[SampleIds],
    lengths: Sequence[np.ndarray],
    images: Sequence[np.ndarray],
    lanes: Lanes,
) -> tuple[list[np.ndarray], list[np.ndarray], Segments | None]:
    """Re-plan with look-ahead membership (base or spec): per source the stream positions the new steps
    plan (those drawn for steps at_step.. minus what the base placed before at_step, plus what it drew before
    at_step and placed later), their natural steps (at least at_step), and the in-flight rests (the carry).

    The base's manifest of steps < at_step is the truth: its pieces are matched to stream positions by
    (document, segment) key, the earliest occurrences first (look-ahead keeps each length class in stream
    order, and a key recurs only an epoch later); a partly placed segment's rest is carried into at_step.
    Every position before ptr[-1] is either placed before at_step, carried, or returned: nothing twice."""
    s = base.at_step
    placed = read_manifest(base.plan_dir, base.meta, 0, s - 1, columns=_PLACED)
    p_src = placed.column("source").to_numpy()
    pos_out, nat_out, parts = [], [], []
    last = ptr.last()
    for k, st in enumerate(streams):
        sel = p_src == k
        rows = _rows_of(base, k, samples[k], placed.column("sample").to_numpy()[sel])
        p_off = placed.column("offset").to_numpy()[sel].astype(np.int64)
        p_len = placed.column("length").to_numpy()[sel].astype(np.int64)
        end = int(last[k])
        state = _match_placed(st, lengths[k], lanes, end, rows, p_off, p_len)
        if state is None:  # the base placed pieces beyond the new plan's positions: look at the whole stream
            state = _match_placed(st, lengths[k], lanes, len(st.doc), rows, p_off, p_len)
        if state is None:
            raise _mismatch(base, k, "placed pieces its membership did not draw")
        doc, off, seg_len, lane, done = state
        n = min(end, len(doc))
        free = np.flatnonzero(done[:n] == 0)
        pos_out.append(free)
        nat_out.append(np.maximum(np.searchsorted(ptr.column(k), free, side="right") - 1, s).astype(np.int64))
        cut = np.flatnonzero((done > 0) & (done < seg_len))
        if len(cut):
            r_len = seg_len[cut] - done[cut]
            ntok = lengths[k][doc[cut]].astype(np.int64)
            parts.append(
                (
                    np.full(len(cut), k, dtype=np.uint16),
                    samples[k][doc[cut]],
                    (off[cut] + done[cut]).astype(np.uint32),
                    r_len,
                    lane[cut],
                    np.where(r_len == ntok, images[k][doc[cut]], 0),
                )
            )
    carry = Segments.concat([Segments(*p) for p in parts]) if parts else None
    return pos_out, nat_out, carry


def _match_placed(
    st: Stream,
    lengths: np.ndarray,
    lanes: Lanes,
    end: int,
    rows: np.ndarray,
    p_off: np.ndarray,
    p_len: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(doc, offset, length, lane, placed tokens) of stream positions [0, end), the placed pieces (index rows,
    offsets, lengths) given to the earliest occurrences of their segment; None when some piece matches none."""
    doc, off, seg_len, lane = st.segments(0, end, lengths, lanes)
    seg_len = seg_len.astype(np.int64)
    cap = lanes.capacity(lane)
    width = int((lengths.max(initial=0) // max(lanes.seq_len, 1)) + 2)  # segments a document has, at most
    key = doc.astype(np.int64) * width + off.astype(np.int64) // cap
    p_cap = lanes.capacity(lanes.lane_of(lengths[rows]))
    p_key = rows * width + p_off // p_cap  # a placed piece lies inside one segment
    order = np.argsort(key, kind="stable")  # by key, stream order within a key
    sk = key[order]
    first = np.searchsorted(sk, sk, side="left")
    occ = np.empty(end, dtype=np.int64)
    occ[order] = np.arange(end) - first  # which occurrence of its key a position is
    uk = np.unique(sk)
    i = np.minimum(np.searchsorted(uk, p_key), max(len(uk) - 1, 0))
    if len(p_key) and (len(uk) == 0 or (uk[i] != p_key).any()):
        return None
    tokens = np.bincount(i, weights=p_len, minlength=len(uk)).astype(np.int64)
    g = np.searchsorted(uk, key)
    if (tokens > np.bincount(g, weights=seg_len, minlength=len(uk))).any():
        return None
    done = np.clip(tokens[g] - occ * seg_len, 0, seg_len)
    return doc, off.astype(np.int64), seg_len, lane, done


def _rows_of(base: BasePlan, k: int, samples: SampleIds, wanted: np.ndarray) -> np.ndarray:
    """Index-table rows (int64) of the sample ids `wanted` of source k."""
    n = len(samples)
    if isinstance(samples, DenseIds) or (
        n and samples[0] == 0 and samples[-1] == n - 1 and bool((np.diff(samples.astype(np.int64)) == 1).all())
    ):
        rows = wanted.astype(np.int64)
        if len(rows) and rows.max() >= n:
            raise _mismatch(base, k, "sample ids beyond the index")
        return rows
    order = np.argsort(samples, kind="stable")
    pos = np.minimum(np.searchsorted(samples[order], wanted), max(n - 1, 0))
    if n == 0 or not (samples[order][pos] == wanted).all():
        raise _mismatch(base, k, "sample ids the index does not hold")
    return order[pos].astype(np.int64)


def _mismatch(base: BasePlan, k: int, what: str) -> PlanError:
    source = base.meta.sources[k]
    return PlanError(
        f"plan {base.meta.plan_id} ({base.plan_dir}): its manifest before step {base.at_step} holds, for source "
        f"{source!r}, {what}: it was not made by this planner from this index; plan afresh or re-plan from a base "
        "made by this loomdata"
    )


def resume_parameters(base: BasePlan) -> ResumeInfo:
    """What plan.json `parameters.resume` records of the base."""
    return ResumeInfo(
        base_plan_id=base.meta.plan_id,
        at_step=base.at_step,
        base_dp_size=base.shapes[-1].dp_size,
        base_micro_batches=base.shapes[-1].micro_batches,
    )
