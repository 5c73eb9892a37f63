"""Planning on 1 vs 2 workers, before/after side by side: plan_scale's cluster part for two source trees in one sitting.

For each --sizes index (2 sources, dp --dp; written once, plan_scale's synthetic tables), every (tree, workers)
plan runs in its own subprocess (plan_scale `--child loom`), the trees alternating within a round. Reports per
run wall and CPU figures as plan_scale's cluster part does (serial CPU, driver CPU, each worker's range CPU,
the critical path on idle cores: serial + driver + busiest worker) and each tree's speedups over its own one
process; with --rounds, every other round swapped and each tree's chain speedups summarized (median, min, max),
after an untimed warm-up of both trees (a fresh tree's first plans compile numba kernels). Writes --out (JSON).

    .venv/bin/python benchmarks/plan_scale_cluster_ab.py --before /tmp/main/src --after src --sizes 5e7 --speculate \
        --rounds 4 --out benchmarks/results/plan_scale_cluster_s33.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from plan_scale_ab import run_child  # plan_scale.py as a child of one source tree (the A/B's runner)


def _figures(r: dict[str, Any], one: dict[str, Any]) -> dict[str, Any]:
    """Speedups of run `r` over the same tree's one-process run `one`: wall; critical-path CPU (the serial part
    as the process's CPU, all its threads summed) over one process's CPU; and `chain_speedup`, the critical
    path with the serial part's per-source threads as on idle cores (serial_chain_cpu_seconds) over one
    process's CPU (one core: how the 1.8x goal is read)."""
    one_cpu = one["serial_cpu_seconds"] + one["balance_cpu_seconds"]
    crit = r["critical_cpu_seconds"] if r["workers"] > 1 else one_cpu
    chain = r.get("critical_chain_cpu_seconds", crit) if r["workers"] > 1 else one_cpu
    return {
        "wall_speedup": one["seconds"] / r["seconds"],
        "critical_speedup": one_cpu / crit,
        "chain_speedup": one_cpu / chain,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="source tree (the directory holding loomdata/) of the baseline")
    ap.add_argument("--after", required=True, help="source tree of the change")
    ap.add_argument("--sizes", nargs="+", type=float, default=[5e6])
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--speculate",
        action="store_true",
        help="plans on N workers speculate (planning._plan.SPECULATE True) even where the workers fill this host's "
        "cores, for the critical path on idle cores (a tree without the setting plans as it does)",
    )
    ap.add_argument(
        "--swap",
        action="store_true",
        help="the N-worker runs in the other order (before first; by default after goes first there, before first on "
        "one worker): a round each way separates a tree's effect from its place in the round",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds a size, every other one swapped (--swap swaps the first); the summary gives each tree's chain "
        "speedups and their median",
    )
    ap.add_argument(
        "--no-warm",
        action="store_true",
        help="skip the warm-up (each tree plans a 10M-sample index on 1 and N workers first, so no timed run compiles "
        "numba kernels into a fresh tree's cache)",
    )
    args = ap.parse_args(argv)
    if args.speculate:
        os.environ["LOOM_BENCH_SPECULATE"] = "1"
    trees = {"before": args.before, "after": args.after}
    out: dict[str, Any] = {
        "dp": args.dp,
        "sources": 2,
        "speculate": args.speculate,
        "swap": args.swap,
        "rounds": args.rounds,
        "sizes": [],
        "summary": {},
    }
    if not args.no_warm:
        _warm(trees, args.dp, args.workers)
    for n, rnd in [(int(s), r) for s in args.sizes for r in range(args.rounds)]:
        swap = args.swap != (rnd % 2 == 1)
        with tempfile.TemporaryDirectory(prefix="loom-scale-") as d:
            run_child(args.after, "--child", "index", "--samples", str(n), "--n-sources", "2", "--workdir", d)
            runs: dict[str, dict[int, dict[str, Any]]] = {"before": {}, "after": {}}
            firsts = {1: ("before", "after"), args.workers: ("after", "before")}  # alternate who goes first
            if swap:
                firsts = {1: ("after", "before"), args.workers: ("before", "after")}
            order = [(t, w) for w in (1, args.workers) for t in firsts[w]]
            for tree, w in order:
                load = os.getloadavg()[0]
                r = run_child(trees[tree], "--child", "loom", "--dp", str(args.dp), "--workdir", d, "--workers", str(w))
                r.update(samples=n, tree=tree, load_before=load, finished=time.time())
                runs[tree][w] = r
                print(
                    f"{n:>11,} {tree:>6} {w} worker(s): wall {r['seconds']:7.1f}s"
                    f" serial CPU {r['serial_cpu_seconds']:6.1f}s"
                    f" balance CPU {r['balance_cpu_seconds']:6.1f}s driver {r.get('driver_cpu_seconds', 0.0):5.1f}s"
                    f" workers {sorted(round(c, 1) for c in r.get('worker_cpu_seconds', {}).values())}"
                    f" scatter {r['scatter_seconds']:5.2f}s critical {r['critical_cpu_seconds']:6.1f}s"
                    f" (threads as on idle cores {r['critical_chain_cpu_seconds']:6.1f}s)"
                    f" (load {load:.1f})",
                    flush=True,
                )
        entry: dict[str, Any] = {"samples": n, "round": rnd, "swapped": swap, "runs": [], "speedups": {}}
        for tree, by_w in runs.items():
            for r in by_w.values():
                r.update(_figures(r, by_w[1]))
                entry["runs"].append(r)
            entry["speedups"][tree] = {
                k: by_w[args.workers][k] for k in ("wall_speedup", "critical_speedup", "chain_speedup")
            }
        a1, b1 = runs["after"][1], runs["before"][1]
        entry["serial_cpu_after_over_before"] = a1["serial_cpu_seconds"] / b1["serial_cpu_seconds"]
        ratio = entry["serial_cpu_after_over_before"]
        print(f"  speedups {json.dumps(entry['speedups'])}; serial CPU after/before {ratio:.2f}", flush=True)
        out["sizes"].append(entry)
        out["summary"][str(n)] = summary = _summary([e for e in out["sizes"] if e["samples"] == n])
        print(f"  chain speedups so far {json.dumps(summary)}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _warm(trees: dict[str, str], dp: int, workers: int) -> None:
    """Each tree plans a 10M-sample index on 1 and `workers` workers, untimed: a tree's first plans compile numba
    kernels into its cache (a fresh `git archive` of a tree has none), which would land in a timed run. 10M: its
    larger source (8M) takes the paths in parts (index reads, streams) that a 1M-sample warm-up left cold (session
    33: the first timed one-process run still compiled, 13.0 CPU-s of serial part against 4.8)."""
    with tempfile.TemporaryDirectory(prefix="loom-scale-warm-") as d:
        run_child(trees["after"], "--child", "index", "--samples", str(10**7), "--n-sources", "2", "--workdir", d)
        for src in trees.values():
            for w in (1, workers):
                run_child(src, "--child", "loom", "--dp", str(dp), "--workdir", d, "--workers", str(w))


def _summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Each tree's chain speedups over the rounds (in round order), their median, min and max."""
    out: dict[str, Any] = {}
    for tree in ("before", "after"):
        xs = [e["speedups"][tree]["chain_speedup"] for e in entries]
        med = statistics.median(xs)
        out[tree] = {"chain": [round(x, 3) for x in xs], "median": med, "min": min(xs), "max": max(xs)}
    return out


if __name__ == "__main__":
    sys.exit(main())
