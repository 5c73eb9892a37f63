"""Where planning's peak memory goes: the peak RSS of each phase of `make_plan` over a synthetic index.

The index is plan_scale's (dp --dp, default 1024; --sources, default 2; --sizes samples, written to a
workdir first); the plan runs in a child process that resets the kernel's peak-RSS mark
(`/proc/self/clear_refs` 5) before each phase, so each phase's own peak above the post-import baseline is
printed (MB and bytes per indexed sample), with the RSS it leaves behind. Phases: index reading
(_load_index), the streams (build_stream), membership, the shuffle figures, balancing and writing
(_balance_into), the report (ReportBuilder.write). The largest phase peak is the plan's peak. Writes
benchmarks/results/plan_memory.json.

    .venv/bin/python benchmarks/plan_memory.py --sizes 1e7 5e7 1e8
    PYTHONPATH=/other/checkout/src .venv/bin/python benchmarks/plan_memory.py --out results/x_before.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "plan_memory.json"


def _status(key: str) -> float:
    """VmRSS / VmHWM of this process in MB."""
    m = re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(m.group(1)) / 1024 if m else 0.0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(workdir: Path, dp: int) -> dict[str, Any]:
    """Plan the index in workdir with each phase's own peak RSS recorded."""
    import plan_scale
    from loomdata.planning import _plan, make_plan
    from loomdata.schemas import parse_spec

    base = _status("VmRSS")
    phases: list[dict[str, Any]] = []

    def timed(owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:  # a phase this version of the planner does not have
            return

        def run(*a: Any, **kw: Any) -> Any:
            before = _status("VmRSS")
            gap = _status("VmHWM") - base  # the peak since the previous phase ended
            _reset_peak()
            t = time.perf_counter()
            out = fn(*a, **kw)
            phases.append(
                {
                    "phase": name,
                    "seconds": time.perf_counter() - t,
                    "rss_before_mb": before - base,
                    "peak_mb": _status("VmHWM") - base,
                    "rss_after_mb": _status("VmRSS") - base,
                    "gap_before_peak_mb": gap,
                }
            )
            _reset_peak()
            return out

        setattr(owner, attr, run)

    timed(_plan, "_load_index", "index")
    timed(_plan, "build_stream", "stream")
    timed(_plan, "membership", "membership")
    timed(_plan, "_shuffle_figures", "shuffle_figures")
    timed(_plan, "natural_positions", "lookahead_positions")  # before: positions stored per segment
    timed(_plan, "assign_steps", "lookahead_assign")
    timed(_plan, "_balance_into", "balance")
    timed(_plan.ReportBuilder, "write", "report")
    info = json.loads((workdir / "index-info.json").read_text())
    steps = plan_scale._steps(info["tokens"], dp)
    spec = parse_spec(
        {
            "name": "scale",
            "workdir": str(workdir),
            "sources": [{"name": n, "format": "parquet", "paths": ["x"], "tokens_field": "t"} for n in info["weights"]],
            "mixture": {"weights": info["weights"]},
            "training": {"seq_len": plan_scale.SEQ_LEN, "steps": steps, "dp_size": dp, "micro_batches": 4},
        },
        workdir,
        check_paths=False,
    )
    _reset_peak()
    t0 = time.perf_counter()
    make_plan(spec)
    secs = time.perf_counter() - t0
    return {"steps": steps, "seconds": secs, "rss_base_mb": base, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e7])
    ap.add_argument("--dp", type=int, default=1024)
    ap.add_argument("--sources", type=int, default=2, help="sources of the synthetic index (plan_scale's)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results JSON (default results/plan_memory.json)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.workdir, args.dp)))
        return 0
    here = Path(__file__).resolve().parent
    out = []
    for n in [int(s) for s in args.sizes]:
        with tempfile.TemporaryDirectory(prefix="loom-pmem-") as d:
            cmd = [sys.executable, str(here / "plan_scale.py"), "--child", "index", "--samples", str(n)]
            subprocess.run([*cmd, "--n-sources", str(args.sources), "--workdir", d], check=True, capture_output=True)
            r = subprocess.run(
                [sys.executable, __file__, "--child", "--workdir", d, "--dp", str(args.dp)],
                check=True,
                capture_output=True,
                text=True,
            )
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["samples"] = n
        res["sources"] = args.sources
        res["dp"] = args.dp
        peak = max(max(p["peak_mb"], p["gap_before_peak_mb"]) for p in res["phases"])
        res["peak_mb"] = peak
        res["bytes_per_sample"] = peak * 2**20 / n
        print(
            f"{n:>12,} samples, {res['steps']} steps: {res['seconds']:.1f} s, peak {peak:.0f} MB above base "
            f"({res['bytes_per_sample']:.1f} B/sample; base {res['rss_base_mb']:.0f} MB)",
            flush=True,
        )
        for p in res["phases"]:
            print(
                f"    {p['phase']:>19}: {p['seconds']:7.2f} s  peak {p['peak_mb']:8.0f} MB "
                f"({p['peak_mb'] * 2**20 / n:5.1f} B/s)  before {p['rss_before_mb']:7.0f}  "
                f"after {p['rss_after_mb']:7.0f}  (gap before: peak {p['gap_before_peak_mb']:.0f})",
                flush=True,
            )
        out.append(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
