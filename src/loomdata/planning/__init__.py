"""The global planner: mixture schedule -> step membership -> packing -> cost-balanced slots -> plan dir.

Use:
    result = make_plan(spec)                     # reads workdir/index/<source>/ for every source
    result = make_plan(spec, index={"web": table}, fingerprints={"web": "..."})  # synthetic tables
    result = make_plan(new_spec, resume_from=PlanResume(plan_dir=base_dir, at_step=s))  # elastic re-plan
    result = make_plan(spec, client=dask_client)  # step ranges balanced on the cluster's workers, same bytes
    report = plan_report(result.plan_dir)        # the figures `loom plan/inspect --json` print
    plot_plan(result.plan_dir, Path("plan.png"))

The plan dir `workdir/plans/<plan_id>/` holds plan.json (PlanMeta), `manifest/steps-<first>-<last>.parquet`
(MANIFEST_SCHEMA, sorted by step, dp_rank, micro_batch, then placement order) and `report/` (per-step
figures). plan_id hashes the spec's content (Spec.content_json: no workdir, base_dir or tokenizer path),
the index fingerprints and the planner version; the same inputs give byte-identical files wherever they
are, and planning an existing complete plan is a no-op. Files are written into a temporary folder and
renamed into place.

Decisions, one module each (their docstrings say more):
- _mixture, step membership: every step draws planning.fill (default 0.96) x dp_size x micro_batches x seq_len tokens,
  split by the interpolated weights (token shares); each source draws from its own seeded permutation,
  a new one per epoch; a credit accumulator (searchsorted over the stream's cumulative tokens, all
  steps at once) keeps each source's cumulative tokens within half a segment of its target; a step that
  would draw nothing draws from the weighted source it leaves least ahead (the fill). Errors:
  max_epochs exceeded (names source and step), an empty source with positive weight, fills that run a
  source past its stream (budget smaller than the documents); the mixture's own rules are the spec's (parse_spec).
- _shuffle, the I/O-aware block shuffle (spec `shuffle: block`: block order permuted per epoch, documents
  shuffled within windows of blocks) and the per-source shuffle figures of the summary (Spearman
  correlation with storage order, storage jump, LRU block-read amplification).
- _packing, lanes and segments: documents longer than their lane are split into segments
  (offset, length), never dropped; documents above long_context.threshold go to the long lane; samples
  with images are never split. Baseline packer: next-fit in shuffled order (vectorised).
- balance/, slots: lanes share a step by slots (a long sequence takes one whole slot and weighs
  cost / long cp); load-aware vectorised LPT that packs as it balances, plus local swaps; one
  implementation, run on blocks of steps (a step with carried-in items is dealt as a block of one).
- _cost: cost(segment) = attention L^2 + linear L + encoder image_tokens^2, over the lane's cp size;
  fit_cost calibrates it from measured times.
- _calibrate, `loom calibrate`: the measurement file (JSON lines of segment lengths and seconds), the fit
  and its quality (R², relative error per run), the spec's new `cost:` block, the balance change.
- _manifest: step-range partitions of bounded size (bounded memory whatever the plan's size), their
  bounds fixed up front from the segments membership draws.
- _ranges, _distributed: balancing a range of steps from a given carry (PlanWork: what it needs, picklable);
  on a cluster (make_plan(client=...)) ranges are balanced on the workers speculatively with nothing
  carried in, then stitched in order, re-balancing a range's first steps when a carry crosses into it,
  until its carries agree: byte-identical to the one-process plan; a fresh plan's first ranges may go out on a
  look-ahead over a prefix of the steps while the whole look-ahead is worked out (kept where the two agree).
  `wants_cluster`: the embedded-cluster rule.
- _resume, elastic re-plans: steps < S are the base plan's rows; from S on each source's stream continues
  where the base's membership stood (in-flight deferred pieces first) with the new dp_size/micro_batches
  budget and the same mixture; the base must match in sources, fingerprints, seed, mixture, seq_len and
  long_context (else PlanError listing every difference); the id hashes the base id and S.
- _cp_report: how evenly each long-lane sequence splits over its CP ranks in the served layout
  (schemas.context_parallel), read from the manifest by plan_report; not stored.
- _report: per-step imbalance max/LB for loomdata and the baseline (same membership: shuffled,
  next-fit, dealt round-robin), simulated gain, realized vs target mixture; the plot.
"""

from loomdata.planning._calibrate import (
    CalibrationFit,
    Measurement,
    MeasurementError,
    balance_change,
    calibrate,
    plan_rank_costs,
    read_measurements,
    read_spec_index,
    with_cost_block,
    write_measurements,
)
from loomdata.planning._cost import fit_cost, segment_cost
from loomdata.planning._distributed import CLUSTER_MIN_SAMPLES, wants_cluster
from loomdata.planning._plan import PlanResult, PlanResume, make_plan
from loomdata.planning._report import plan_report, plot_plan

__all__ = [
    "CLUSTER_MIN_SAMPLES",
    "CalibrationFit",
    "Measurement",
    "MeasurementError",
    "PlanResult",
    "PlanResume",
    "balance_change",
    "calibrate",
    "fit_cost",
    "make_plan",
    "plan_rank_costs",
    "plan_report",
    "plot_plan",
    "read_measurements",
    "read_spec_index",
    "segment_cost",
    "wants_cluster",
    "with_cost_block",
    "write_measurements",
]
