"""Measured training-step time (real forward + backward) of loomdata's plan vs concat-and-chunk and first-fit packing.

A GPT-style decoder (`_train_model.py`; CPU by default, `--device cuda` supported) runs forward + backward
over every micro-batch of every rank of a step, with document-masked causal attention driven by the
micro-batch's cu_seqlens (each segment attends only within itself). The ranks of a step run one after
another in this process, so they do not share cores; a synchronous data-parallel step takes as long as
its slowest rank. Tokens are random ids: only lengths matter for compute.

Arms, on the same documents with the same tokens per step (a web-like log-normal mix with a long tail
of books, synthetic index tables, no data files):
- loomdata: `make_plan` with the spec's default cost model; each (step, rank, micro-batch)'s segment
  lengths are read from the plan's manifest;
- megatron-full: Megatron's GPTDataset way: the step's documents shuffled, concatenated and cut into
  seq_len rows, dealt round-robin; full causal attention over each row (Megatron's default, no
  attention-mask reset);
- megatron-masked: the same rows with document masking (a cut document's pieces attend within their row);
- first-fit: the step's documents shuffled and packed first-fit into exactly micro_batches sequences per
  rank (dp x micro_batches bins of seq_len; what does not fit waits for the next step), dealt round-robin;
- loomdata-calibrated: the loop `loom calibrate` closes: the default-cost plan is measured first (as a
  training job would run it), the cost model is fitted (fit_cost) to its micro-batches, and the spec is
  re-planned with the fitted cost. Then all five arms are measured, interleaved step by step (so a
  drifting machine load hits every arm alike); the tables are from that second pass.

Printed and written to benchmarks/results/train_throughput.json (+ .png): step time per arm, measured gain
of loomdata (tokens/s ratio; the same as the step-time ratio when tokens are equal) over each baseline,
the gain the plan's report simulated (vs its own baseline: shuffled next-fit dealt round-robin), the
measured rank imbalance (mean over steps of max/mean rank time) next to the one the cost model predicted,
before and after calibration, and the paper's figures (MegaScale-Data, arXiv 2504.09844: 1.71x at 4K,
2.63x at 8K, 3.09x at 16K on average; up to 4.54x) for reference. The machine is described in the JSON.

    .venv/bin/python benchmarks/train_throughput.py                 # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/train_throughput.py --quick         # under a minute (4K and 8K, 2 steps)
    .venv/bin/python benchmarks/train_throughput.py --device cuda --preset gpu-7b-layer --dp 8 --steps 6  # ~3 min, H200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from _synthetic import index_table
from _train_model import PRESETS, RankTimer
from loomdata.planning import (
    Measurement,
    calibrate,
    make_plan,
    plan_rank_costs,
    plan_report,
    segment_cost,
    write_measurements,
)
from loomdata.schemas import CostSpec, Spec, parse_spec, read_manifest, read_plan

RESULTS = Path(__file__).resolve().parent / "results"
PAPER = {4096: 1.71, 8192: 2.63, 16384: 3.09}  # measured average gains; "up to 4.54x" overall
PAPER_MAX = 4.54
# log-normal (mu, sigma) of token counts and clip range per source (as in balance.py), and the mix
LENGTHS: dict[str, tuple[float, float, int, int]] = {
    "web": (6.2, 1.1, 16, 100_000),
    "code": (6.8, 1.2, 16, 200_000),
    "papers": (8.8, 0.6, 1_000, 60_000),
    "books": (11.0, 0.7, 8_000, 1_000_000),
}
WEIGHTS = {"web": 0.55, "code": 0.15, "papers": 0.15, "books": 0.15}
# context -> (micro_batches, steps); dp is --dp
DEFAULT_RUNS = {4096: (4, 4), 8192: (2, 4), 16384: (2, 2), 32768: (1, 2)}
QUICK_RUNS = {4096: (2, 2), 8192: (1, 2)}
ARMS = ("loomdata", "megatron-full", "megatron-masked", "first-fit")

Layout = list[list[list[np.ndarray]]]  # step -> rank -> micro-batch -> segment lengths


def make_spec(
    workdir: Path,
    seq_len: int,
    dp: int,
    micro_batches: int,
    steps: int,
    cost: CostSpec | None,
    planning: dict[str, Any] | None = None,
) -> Spec:
    """The benchmark's data-plane spec (paths unchecked: the index tables are synthetic); `planning`: its keys."""
    raw: dict[str, Any] = {
        "name": f"train-{seq_len}",
        "workdir": str(workdir),
        "seed": 0,
        "sources": [
            {"name": n, "format": "parquet", "paths": [f"{n}/*.parquet"], "tokens_field": "input_ids"} for n in WEIGHTS
        ],
        "mixture": {"weights": WEIGHTS},
        "training": {"seq_len": seq_len, "steps": steps, "dp_size": dp, "micro_batches": micro_batches},
    }
    if cost is not None:
        raw["cost"] = cost.model_dump()
    if planning:
        raw["planning"] = planning
    return parse_spec(raw, workdir, check_paths=False)


def synthetic_index(spec: Spec, seed: int = 0) -> dict[str, pa.Table]:
    """Index tables with a few times the documents the plan draws from each source."""
    tr = spec.training
    total = tr.dp_size * tr.micro_batches * tr.seq_len * tr.steps
    out = {}
    for k, (name, w) in enumerate(WEIGHTS.items()):
        mu, sigma, lo, hi = LENGTHS[name]
        mean = float(np.exp(mu + sigma**2 / 2))
        n = int(max(200, 4 * total * w / mean))
        rng = np.random.default_rng([seed, k])
        out[name] = index_table(np.clip(rng.lognormal(mu, sigma, n), lo, hi).astype(np.uint32))
    return out


def plan_layout(plan_dir: Path) -> Layout:
    """Each (step, rank, micro-batch)'s segment lengths, from the plan's manifest (stored order)."""
    meta = read_plan(plan_dir)
    m = read_manifest(plan_dir, meta)
    step, rank, mb = (m[c].to_numpy().astype(np.int64) for c in ("step", "dp_rank", "micro_batch"))
    length = m["length"].to_numpy().astype(np.int64)
    key = (step * meta.dp_size + rank) * meta.micro_batches + mb
    order = np.argsort(key, kind="stable")
    key, length = key[order], length[order]
    out: Layout = [
        [[np.zeros(0, np.int64) for _ in range(meta.micro_batches)] for _ in range(meta.dp_size)]
        for _ in range(meta.steps)
    ]
    uniq, start = np.unique(key, return_index=True)
    for k, seg in zip(uniq, np.split(length, start[1:]), strict=True):
        s, rest = divmod(int(k), meta.dp_size * meta.micro_batches)
        out[s][rest // meta.micro_batches][rest % meta.micro_batches] = seg
    return out


def _deal(rows: Sequence[np.ndarray], dp: int, micro_batches: int) -> list[list[np.ndarray]]:
    """Rows dealt round-robin (row j -> rank j % dp, micro-batch j // dp), as a distributed sampler does."""
    ranks: list[list[np.ndarray]] = [[] for _ in range(dp)]
    for j, row in enumerate(rows):
        ranks[j % dp].append(row)
    for r in ranks:
        r.extend(np.zeros(0, np.int64) for _ in range(micro_batches - len(r)))
    return ranks


def megatron(docs: np.ndarray, rng: np.random.Generator, seq_len: int, dp: int, mb: int, masked: bool):
    """Concat-and-chunk: shuffled documents concatenated, cut into seq_len rows; per row its pieces (masked)
    or one segment over the whole row (full causal attention)."""
    docs = rng.permutation(docs)
    total = int(docs.sum())
    cuts = np.union1d(np.cumsum(docs), np.arange(seq_len, total, seq_len))
    cuts = np.concatenate([[0], cuts[cuts <= total]])
    pieces, row = np.diff(cuts), cuts[:-1] // seq_len
    n_rows = int(row.max()) + 1 if len(row) else 0
    if n_rows > dp * mb:
        raise ValueError(f"{total} tokens need {n_rows} rows, more than the step's {dp * mb} slots")
    rows = [pieces[row == j] for j in range(n_rows)]
    if not masked:
        rows = [np.array([r.sum()]) for r in rows]
    return _deal(rows, dp, mb)


def first_fit(docs: np.ndarray, carry: np.ndarray, rng: np.random.Generator, seq_len: int, dp: int, mb: int):
    """Waiting documents first, then this step's shuffled, first-fit into dp*mb bins; returns (ranks, left over)."""
    order = np.concatenate([carry, rng.permutation(docs)])
    room = np.full(dp * mb, seq_len, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(dp * mb)]
    left = []
    for length in order.tolist():
        fits = np.flatnonzero(room >= length)
        if len(fits) == 0:
            left.append(length)
            continue
        b = int(fits[0])
        room[b] -= length
        bins[b].append(length)
    return _deal([np.asarray(b, np.int64) for b in bins], dp, mb), np.asarray(left, np.int64)


def baseline_layouts(layout: Layout, seq_len: int, dp: int, mb: int, seed: int) -> dict[str, Layout]:
    """The three baselines on each step's documents of the plan (its segments), same tokens per step."""
    rng = np.random.default_rng(seed)
    out: dict[str, Layout] = {"megatron-full": [], "megatron-masked": [], "first-fit": []}
    carry = np.zeros(0, np.int64)
    for step in layout:
        docs = np.concatenate([seg for rank in step for seg in rank])
        state = rng.bit_generator.state
        out["megatron-full"].append(megatron(docs, rng, seq_len, dp, mb, masked=False))
        rng.bit_generator.state = state  # the same shuffle for both Megatron arms
        out["megatron-masked"].append(megatron(docs, rng, seq_len, dp, mb, masked=True))
        ranks, carry = first_fit(docs, carry, rng, seq_len, dp, mb)
        out["first-fit"].append(ranks)
    return out


@dataclass
class ArmResult:
    """Measured seconds of every micro-batch of an arm: steps x ranks x micro-batches."""

    layout: Layout
    seconds: list[list[list[float]]]

    @property
    def rank_seconds(self) -> np.ndarray:
        return np.array([[sum(mbs) for mbs in step] for step in self.seconds])

    @property
    def tokens(self) -> int:
        return int(sum(seg.sum() for step in self.layout for rank in step for seg in rank))

    def summary(self, cost: CostSpec) -> dict[str, Any]:
        r = self.rank_seconds
        step_s = r.max(axis=1)
        pred = np.array(
            [[sum(float(segment_cost(s, None, cost).sum()) for s in rank) for rank in st] for st in self.layout]
        )
        return {
            "tokens": self.tokens,
            "step_seconds": step_s.tolist(),
            "mean_step_seconds": float(step_s.mean()),
            "tokens_per_second": self.tokens / float(step_s.sum()),
            "measured_imbalance": _max_over_mean(r),
            "predicted_imbalance": _max_over_mean(pred),
        }


def _max_over_mean(per_rank: np.ndarray) -> float:
    mean = per_rank.mean(axis=1)
    return float(np.mean(per_rank.max(axis=1) / np.where(mean > 0, mean, 1.0)))


def measure_steps(timer: RankTimer, layouts: dict[str, Layout]) -> dict[str, ArmResult]:
    """Time every arm step by step, arms interleaved within a step (so drifting machine load hits all alike)."""
    steps = len(next(iter(layouts.values())))
    res = {a: ArmResult(lay, []) for a, lay in layouts.items()}
    for s in range(steps):
        for arm, lay in layouts.items():
            res[arm].seconds.append([timer.rank(rank) for rank in lay[s]])
    return res


def measurements_of(res: dict[str, ArmResult], context: int, phase: str) -> list[Measurement]:
    """One measurement line per rank per non-empty micro-batch, annotated with arm, context, step, rank."""
    out = []
    for arm, r in res.items():
        for s, step in enumerate(r.layout):
            for k, rank in enumerate(step):
                for m, seg in enumerate(rank):
                    if len(seg):
                        notes = {"arm": arm, "phase": phase, "context": context, "step": s, "rank": k, "micro_batch": m}
                        out.append(Measurement(lengths=seg, seconds=r.seconds[s][k][m], notes=notes))
    return out


def run_context(
    timer: RankTimer,
    seq_len: int,
    dp: int,
    mb: int,
    steps: int,
    root: Path,
    seed: int,
    lookahead: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[Measurement]]:
    """default cost -> measure all arms -> calibrate -> re-plan -> measure, at one context length.

    `lookahead` (planning keys, e.g. {"lookahead": 8, "lookahead_tolerance": 0.05}): one more arm, the default-cost
    plan with them ("loomdata-lookahead"; its steps hold other documents, the run the same tokens)."""
    spec = make_spec(root / f"ctx{seq_len}", seq_len, dp, mb, steps, None)
    index = synthetic_index(spec, seed)
    fps = {n: f"synthetic-{n}-{seed}" for n in index}
    t0 = time.perf_counter()
    plan = make_plan(spec, index=index, fingerprints=fps)
    plan_s = time.perf_counter() - t0
    report = plan_report(plan.plan_dir)
    layout = plan_layout(plan.plan_dir)
    timer.warm_up(seq_len)
    # the loop's "measure": the default-cost plan as a training job would run it; fit_cost on its micro-batches
    first = measure_steps(timer, {"loomdata": layout})
    lines = measurements_of(first, seq_len, phase="calibration")
    fit = calibrate(lines)
    cal_spec = make_spec(root / f"ctx{seq_len}", seq_len, dp, mb, steps, fit.cost)
    cal_plan = make_plan(cal_spec, index=index, fingerprints=fps)
    cal_report = plan_report(cal_plan.plan_dir)
    # then every arm, interleaved step by step, for the comparison
    layouts = {
        "loomdata": layout,
        "loomdata-calibrated": plan_layout(cal_plan.plan_dir),
        **baseline_layouts(layout, seq_len, dp, mb, seed),
    }
    la_report = None
    if lookahead:
        la_spec = make_spec(root / f"ctx{seq_len}-la", seq_len, dp, mb, steps, None, planning=lookahead)
        la_plan = make_plan(la_spec, index=index, fingerprints=fps)
        la_report = plan_report(la_plan.plan_dir)
        layouts["loomdata-lookahead"] = plan_layout(la_plan.plan_dir)
    res = measure_steps(timer, layouts)
    lines += measurements_of(res, seq_len, phase="comparison")
    default_cost = ("loomdata", "loomdata-lookahead")  # the rest are priced by the fitted cost
    arms = {a: r.summary(spec.cost if a in default_cost else fit.cost) for a, r in res.items()}
    # what the fitted model predicts for the default-cost plan (all its steps), next to the re-plan
    old_fit = _max_over_mean(plan_rank_costs(plan.plan_dir, spec, fit.cost))
    new_fit = _max_over_mean(plan_rank_costs(cal_plan.plan_dir, cal_spec, fit.cost))
    tps = {a: v["tokens_per_second"] for a, v in arms.items()}
    row = {
        "seq_len": seq_len,
        "dp": dp,
        "micro_batches": mb,
        "steps": steps,
        "plan_seconds": plan_s,
        "arms": arms,
        "gain": {
            f"{lo}_over_{base}": tps[lo] / tps[base]
            for lo in ("loomdata", "loomdata-calibrated", "loomdata-lookahead")
            if lo in tps
            for base in ("megatron-full", "megatron-masked", "first-fit", "loomdata")
            if base != lo
        },
        "simulated_gain": {"default_cost": report["simulated_gain"], "calibrated_cost": cal_report["simulated_gain"]},
        "report_max_over_mean": {
            "default_cost": report["max_over_mean"]["loomdata"],
            "calibrated_cost": cal_report["max_over_mean"]["loomdata"],
        },
        "predicted_under_fitted_cost": {"default_plan": old_fit, "calibrated_plan": new_fit},
        "lookahead_arm": None
        if la_report is None
        else {
            "planning": lookahead,
            "simulated_gain": la_report["simulated_gain"],
            "worst_mixture_error_pp": la_report["worst_mixture_error_pp"],
        },
        "fit": fit.to_dict(),
        "paper_gain": PAPER.get(seq_len),
    }
    return row, lines


def machine(threads: int, device: str, preset: str) -> dict[str, Any]:
    """What ran: CPU, threads, torch, device, model."""
    return {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        "cuda": None if device == "cpu" else torch.version.cuda,
        "model_preset": preset,
        "model": PRESETS[preset].describe(),
    }


def print_lookahead(rows: list[dict[str, Any]]) -> None:
    """The --lookahead-tolerance arm beside the default plan: step time, measured gains, simulated gain, mixture."""
    rows = [r for r in rows if r.get("lookahead_arm")]
    if not rows:
        return
    print("\nthe look-ahead arm (default cost, planning " + json.dumps(rows[0]["lookahead_arm"]["planning"]) + ")")
    head = f"{'ctx':>6} {'step s':>7} {'vs loom':>8} {'vs mg-full':>10} {'vs mg-mask':>10} {'vs ff':>6}"
    print(head + f" {'sim':>6} {'mix pp':>7}")
    for r in rows:
        g, la = r["gain"], r["lookahead_arm"]
        print(
            f"{r['seq_len']:>6} {r['arms']['loomdata-lookahead']['mean_step_seconds']:>7.3f} "
            f"{g['loomdata-lookahead_over_loomdata']:>8.2f} {g['loomdata-lookahead_over_megatron-full']:>10.2f} "
            f"{g['loomdata-lookahead_over_megatron-masked']:>10.2f} {g['loomdata-lookahead_over_first-fit']:>6.2f} "
            f"{la['simulated_gain']:>6.2f} {la['worst_mixture_error_pp']:>7.2f}"
        )


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\nmeasured step time (s, mean over steps); measured gain of loomdata (tokens/s), default / calibrated cost")
    head = (
        f"{'ctx':>6} {'mb':>3} {'loom':>6} {'loom-cal':>8} {'mg-full':>7} {'mg-mask':>7} {'ff':>6} | "
        f"{'vs mg-full':>11} {'vs mg-mask':>11} {'vs ff':>11} | {'sim gain':>8} {'paper':>6}"
    )
    print(head)
    for r in rows:
        a, g = r["arms"], r["gain"]
        paper = f"{r['paper_gain']:.2f}x" if r["paper_gain"] else f"<={PAPER_MAX}x"
        gains = " ".join(
            f"{g[f'loomdata_over_{b}']:>5.2f}/{g[f'loomdata-calibrated_over_{b}']:.2f}"
            for b in ("megatron-full", "megatron-masked", "first-fit")
        )
        secs = " ".join(
            f"{a[k]['mean_step_seconds']:>{w}.3f}"
            for k, w in (
                ("loomdata", 6),
                ("loomdata-calibrated", 8),
                ("megatron-full", 7),
                ("megatron-masked", 7),
                ("first-fit", 6),
            )
        )
        sim = r["simulated_gain"]["default_cost"]
        print(f"{r['seq_len']:>6} {r['micro_batches']:>3} {secs} | {gains} | {sim:>7.2f}x {paper:>6}")
    print("\nthe calibration loop: rank imbalance (mean max/mean rank time), measured vs predicted")
    print(
        f"{'ctx':>6} {'fitted linear':>13} {'R2':>6} {'med err':>7} | {'default: measured':>17} {'predicted':>9} "
        f"{'by fit':>6} | "
        f"{'calibrated: measured':>20} {'predicted':>9} | {'ff meas':>7} {'mg-mask meas':>12}"
    )
    for r in rows:
        a, f = r["arms"], r["fit"]
        print(
            f"{r['seq_len']:>6} {f['cost']['linear']:>13.0f} {f['r2']:>6.3f} {f['median_rel_error']:>7.1%} | "
            f"{a['loomdata']['measured_imbalance']:>17.3f} {a['loomdata']['predicted_imbalance']:>9.3f} "
            f"{r['predicted_under_fitted_cost']['default_plan']:>6.3f} | "
            f"{a['loomdata-calibrated']['measured_imbalance']:>20.3f} "
            f"{a['loomdata-calibrated']['predicted_imbalance']:>9.3f} | "
            f"{a['first-fit']['measured_imbalance']:>7.3f} {a['megatron-masked']['measured_imbalance']:>12.3f}"
        )


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(rows))
    labels = [f"{r['seq_len'] // 1024}K" for r in rows]
    arms = ("loomdata", "loomdata-calibrated", "megatron-full", "megatron-masked", "first-fit")
    w = 0.16
    for k, arm in enumerate(arms):
        ax[0].bar(x + (k - 2) * w, [r["arms"][arm]["mean_step_seconds"] for r in rows], w, label=arm)
    ax[0].set_xticks(x, labels)
    ax[0].set_ylabel("measured step time (s, slowest rank)")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=8)
    for base, color in (("megatron-full", "tab:green"), ("megatron-masked", "tab:red"), ("first-fit", "tab:purple")):
        ax[1].plot(x, [r["gain"][f"loomdata_over_{base}"] for r in rows], "o-", color=color, label=f"vs {base}")
        ax[1].plot(x, [r["gain"][f"loomdata-calibrated_over_{base}"] for r in rows], "s:", color=color, alpha=0.6)
    ax[1].plot(x, [r["simulated_gain"]["default_cost"] for r in rows], "k--", label="simulated (plan report)")
    px = [i for i, r in enumerate(rows) if r["paper_gain"]]
    ax[1].plot(px, [rows[i]["paper_gain"] for i in px], "r*", ms=10, label="paper (avg)")
    ax[1].axhline(1.0, color="grey", lw=0.8)
    ax[1].set_xticks(x, labels)
    ax[1].set_ylabel("measured gain of loomdata (tokens/s)")
    ax[1].set_title("solid: default cost, dotted: calibrated cost", fontsize=9)
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="4K and 8K only, 2 steps (under a minute)")
    ap.add_argument("--contexts", type=int, nargs="*", default=None, help="context lengths (default 4K-32K)")
    ap.add_argument("--steps", type=int, default=None, help="steps per context (default: per context)")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (fixed for the run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lookahead-tolerance",
        type=float,
        default=None,
        help="add an arm planned with this planning.lookahead_tolerance (and --lookahead), measured beside the rest",
    )
    ap.add_argument("--lookahead", type=int, default=8, help="planning.lookahead of the --lookahead-tolerance arm")
    ap.add_argument("--write-measurements", default=None, metavar="PATH", help="JSON lines for `loom calibrate`")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/train_throughput.json)")
    ap.add_argument(
        "--from-json", default=None, metavar="PATH", help="print the tables and redraw the PNG of a stored run"
    )
    args = ap.parse_args(argv)
    if args.from_json:
        stored = json.loads(Path(args.from_json).read_text())
        print(f"machine: {json.dumps(stored['machine'])}")
        print_table(stored["runs"])
        print_lookahead(stored["runs"])
        plot(stored["runs"], Path(args.from_json).with_suffix(".png"))
        return 0
    torch.set_num_threads(args.threads)
    runs = dict(QUICK_RUNS if args.quick else DEFAULT_RUNS)
    if args.contexts:
        runs = {c: runs.get(c, DEFAULT_RUNS.get(c, (1, 2))) for c in args.contexts}
    if args.steps:
        runs = {c: (mb, args.steps) for c, (mb, _) in runs.items()}
    info = machine(torch.get_num_threads(), args.device, args.preset)
    print(f"machine: {json.dumps(info)}")
    timer = RankTimer(PRESETS[args.preset], device=args.device, seed=args.seed)
    rows, lines = [], []
    t_all = time.perf_counter()
    out = Path(args.out) if args.out else RESULTS / "train_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="train-throughput-") as tmp:
        for ctx, (mb, steps) in runs.items():
            t0 = time.perf_counter()
            la = None
            if args.lookahead_tolerance is not None:
                la = {"lookahead": args.lookahead, "lookahead_tolerance": args.lookahead_tolerance}
            row, ls = run_context(timer, ctx, args.dp, mb, steps, Path(tmp), args.seed, la)
            row["elapsed_s"] = time.perf_counter() - t0
            rows.append(row)
            lines += ls
            print(f"  {ctx:>6}: {row['elapsed_s']:.0f}s, {len(ls)} micro-batches measured", flush=True)
            # written after every context, so a run cut short (a lent GPU's time limit) keeps what it measured
            info["attention"], info["varlen_error"] = timer.attention, timer.varlen_error
            result = {"machine": info, "elapsed_s": time.perf_counter() - t_all, "paper_max_gain": PAPER_MAX}
            out.write_text(json.dumps({**result, "runs": rows}, indent=2))
    print_table(rows)
    print_lookahead(rows)
    plot(rows, out.with_suffix(".png"))
    if args.write_measurements:
        n = write_measurements(args.write_measurements, lines)
        print(f"{n} measurement lines written to {args.write_measurements} (input of `loom calibrate SPEC PATH`)")
    print(f"written {out} and {out.with_suffix('.png')} in {result['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
