"""Plan time at dp 1 with planning.draw_window 0 (membership) and W (the windowed draw), side by side.

plan_scale.py's child (the index written once, each plan its own process: whole-plan CPU seconds, peak RSS and
membership's own CPU) at dp 1 x 4 micro-batches of 4,096 tokens, one epoch, for each (samples, sources); the two
windows alternate, --rounds rounds. Writes --out (JSON).

    .venv/bin/python benchmarks/window_plan_time.py --samples 1e6 --sources 1 300 --window 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_scale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", nargs="+", type=float, default=[1e6])
    ap.add_argument("--sources", nargs="+", type=int, default=[1, 300])
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/window_plan_time.json"))
    a = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in a.samples):
        for n_src in a.sources:
            with tempfile.TemporaryDirectory(prefix="loom-window-") as d:
                for r in range(a.rounds):
                    for w in (0, a.window) if r % 2 == 0 else (a.window, 0):
                        os.environ["LOOM_BENCH_DRAW_WINDOW"] = str(w)
                        res = plan_scale.run("loom", n, n_src, 1, Path(d))
                        memb = res.get("phases", {}).get("membership", {}).get("cpu_seconds", float("nan"))
                        row = {"samples": n, "sources": n_src, "window": w, "round": r, "steps": res["steps"]}
                        row.update(cpu_s=res.get("plan_cpu_seconds"), seconds=res["seconds"], membership_cpu_s=memb)
                        row.update(rss_peak_mb=res["rss_peak_mb"])
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    os.environ.pop("LOOM_BENCH_DRAW_WINDOW", None)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"note": a.note, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
