"""Before/after planner throughput, side by side: the same synthetic indexes (plan_scale's) planned by two
source trees in alternating order, each run its own subprocess (plan_scale's `--child loom`).

For each (sources, samples) an index is written once; for each dp both trees plan it, `--rounds` times
(alternating which goes first). Reports wall and CPU seconds (the CPU figures say more on a loaded
machine), samples/s, peak RSS per sample above the post-import baseline, the after/before ratios, and
per (dp, sources) the slope of log(CPU seconds) over log(steps) across the sizes. Writes --out (JSON).

    .venv/bin/python benchmarks/plan_scale_ab.py --before /work/main/src --after src \
        --sizes 2.5e5 1e6 --dps 4 8 64 1024 --sources 1 300 --out benchmarks/results/plan_scale_block.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent / "plan_scale.py"


def run_child(src: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    out = subprocess.run([sys.executable, str(BENCH), *args], check=True, capture_output=True, text=True, env=env)
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return r


def _slope(runs: list[dict[str, Any]], key: str) -> float:
    if len({r["steps"] for r in runs}) < 2:
        return float("nan")
    return float(np.polyfit(np.log([r["steps"] for r in runs]), np.log([r[key] for r in runs]), 1)[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="source tree (the directory holding loomdata/) of the baseline")
    ap.add_argument("--after", required=True, help="source tree of the change")
    ap.add_argument("--sizes", nargs="+", type=float, default=[2.5e5, 1e6])
    ap.add_argument("--dps", nargs="+", type=int, default=[4, 8, 64, 1024])
    ap.add_argument("--sources", nargs="+", type=int, default=[1, 300])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--from-log", type=Path, help="no runs: summarize the per-run lines of a sweep's output into --out")
    args = ap.parse_args(argv)
    if args.from_log is not None:
        _write(args.out, runs_from_log(args.from_log.read_text()), args.sources, args.dps, complete=True)
        return 0
    trees = {"before": args.before, "after": args.after}
    runs: list[dict[str, Any]] = []
    for n_src in args.sources:
        for samples in [int(s) for s in args.sizes]:
            with tempfile.TemporaryDirectory(prefix="loom-ab-") as d:
                index = ["--child", "index", "--samples", str(samples), "--n-sources", str(n_src), "--workdir", d]
                run_child(args.after, *index)
                for dp in args.dps:
                    for r in range(args.rounds):
                        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                            x = run_child(trees[name], "--child", "loom", "--dp", str(dp), "--workdir", d)
                            # all of make_plan (a tree whose script predates it: serial part + balancing)
                            cpu = x.get("plan_cpu_seconds", x["serial_cpu_seconds"] + x["balance_cpu_seconds"])
                            x.update(version=name, samples=samples, sources=n_src, dp=dp, round=r, cpu_seconds=cpu)
                            x["samples_per_s"] = samples / x["seconds"]
                            x["samples_per_cpu_s"] = samples / cpu
                            x["bytes_per_sample"] = (x["rss_peak_mb"] - x["rss_base_mb"]) * 2**20 / samples
                            runs.append(x)
                            _write(args.out, runs, args.sources, args.dps, complete=False)
                            print(
                                f"dp {dp:5d} src {n_src:3d} n {samples:>11,} steps {x['steps']:7d} {name:6s} wall "
                                f"{x['seconds']:7.2f}s cpu {cpu:7.2f}s (balance {x['balance_cpu_seconds']:6.2f}s) "
                                f"{x['samples_per_cpu_s']:>11,.0f} samples/cpu-s {x['bytes_per_sample']:6.1f} B/sample",
                                flush=True,
                            )
    _write(args.out, runs, args.sources, args.dps, complete=True)
    return 0


def summarize(runs: list[dict[str, Any]], sources: list[int], dps: list[int]) -> list[dict[str, Any]]:
    """Per (dp, sources) with runs of both trees: each tree's best (least CPU) run per size, slopes, ratios."""
    summary = []
    for n_src in sources:
        for dp in dps:
            row: dict[str, Any] = {"dp": dp, "sources": n_src}
            for name in ("before", "after"):
                mine = [r for r in runs if r["version"] == name and r["dp"] == dp and r["sources"] == n_src]
                best = {}  # per size, the run of least CPU (the least disturbed by other load)
                for r in mine:
                    if r["samples"] not in best or r["cpu_seconds"] < best[r["samples"]]["cpu_seconds"]:
                        best[r["samples"]] = r
                pick = [best[s] for s in sorted(best)]
                row[name] = {
                    "samples_per_cpu_s": {str(r["samples"]): r["samples_per_cpu_s"] for r in pick},
                    "samples_per_s": {str(r["samples"]): r["samples_per_s"] for r in pick},
                    "bytes_per_sample": {str(r["samples"]): r["bytes_per_sample"] for r in pick},
                    "slope_cpu": _slope(pick, "cpu_seconds"),
                    "slope_wall": _slope(pick, "seconds"),
                }
            b, a = row["before"]["samples_per_cpu_s"], row["after"]["samples_per_cpu_s"]
            if a and b:
                row["cpu_speedup"] = {k: a[k] / b[k] for k in a if k in b}
                summary.append(row)
    return summary


def _write(out: Path | None, runs: list[dict[str, Any]], sources: list[int], dps: list[int], complete: bool) -> None:
    """Write the runs so far and their summary to `out` (after every run: a long sweep cut short keeps them)."""
    summary = summarize(runs, sources, dps)
    if complete:
        for row in summary:
            print(json.dumps(row), flush=True)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"complete": complete, "summary": summary, "runs": runs}, indent=1) + "\n")
    if complete:
        print(f"wrote {out}")


_LOG = re.compile(
    r"dp\s+(\d+) src\s+(\d+) n\s+([\d,]+) steps\s+(\d+) (before|after)\s+wall\s+([\d.]+)s cpu\s+([\d.]+)s "
    r"\(balance\s+([\d.]+)s\)\s+[\d,]+ samples/cpu-s\s+([\d.]+) B/sample"
)


def runs_from_log(text: str) -> list[dict[str, Any]]:
    """The runs printed by a sweep (its per-run lines), for one cut short before it wrote its JSON."""
    runs = []
    for m in _LOG.finditer(text):
        dp, src, n, steps, name, wall, cpu, bal, bps = m.groups()
        samples = int(n.replace(",", ""))
        runs.append(
            {
                "version": name,
                "samples": samples,
                "sources": int(src),
                "dp": int(dp),
                "steps": int(steps),
                "seconds": float(wall),
                "cpu_seconds": float(cpu),
                "balance_cpu_seconds": float(bal),
                "samples_per_s": samples / float(wall),
                "samples_per_cpu_s": samples / float(cpu),
                "bytes_per_sample": float(bps),
                "from_log": True,
            }
        )
    return runs


if __name__ == "__main__":
    sys.exit(main())
