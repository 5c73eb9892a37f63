"""What the planner's compiled kernels cost a process: numba's first-call compile (cold cache) and cache load.

Each measurement is its own subprocess planning two small golden cases (tests/loomtest/golden_plans.py:
web4k_dp8, then web4k_dp64) and reporting the CPU seconds of importing loomdata.planning and of each plan:
- cold: NUMBA_CACHE_DIR is an empty folder, so the first plan compiles every kernel and writes the cache;
- warm: the same folder again, so the first plan loads the kernels from the cache (what every later process,
  Dask workers included, pays once);
- before (--before SRC, optional): a tree without kernels, for the plans' own time.
The first plan's CPU minus the second's same-size plan is the kernels' one-time cost per process. Writes
results/plan_scale_compile.json.

    .venv/bin/python benchmarks/plan_scale_compile.py --before /work/main/src --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "plan_scale_compile.json"
CHILD = """
import json, sys, tempfile, time
from pathlib import Path
c0 = time.process_time()
import loomdata.planning
from loomtest.golden_plans import CASES
from loomdata.planning import make_plan
out = {"import_cpu_s": time.process_time() - c0}
for name in ("web4k_dp8", "web4k_dp8_again", "web4k_dp64"):
    with tempfile.TemporaryDirectory() as d:
        spec, index, kw = CASES[name.removesuffix("_again")](Path(d))
        c = time.process_time()
        make_plan(spec, index=index, **kw)
        out[name + "_cpu_s"] = time.process_time() - c
print(json.dumps(out))
"""


def child(src: str, cache: str | None) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(src).resolve()), str(HERE.parent / "tests")]))
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = cache
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True, env=env)
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--after", default=str(HERE.parent / "src"), help="source tree with the kernels")
    ap.add_argument("--before", help="source tree without kernels (optional)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="loom-numba-cache-") as cache:
            for kind in ("cold", "warm"):
                runs.append({"kind": kind, "round": r, **child(args.after, cache)})
        if args.before:
            runs.append({"kind": "before", "round": r, **child(args.before, None)})
    print(f"{'kind':>7}{'import':>9}{'plan dp8 1st':>14}{'2nd':>8}{'dp64':>8}  (CPU seconds)")
    for x in runs:
        print(
            f"{x['kind']:>7}{x['import_cpu_s']:>9.3f}{x['web4k_dp8_cpu_s']:>14.3f}"
            f"{x['web4k_dp8_again_cpu_s']:>8.3f}{x['web4k_dp64_cpu_s']:>8.3f}"
        )
    summary = {}
    for kind in ("cold", "warm", "before"):
        mine = [x for x in runs if x["kind"] == kind]
        if mine:
            first = sorted(x["web4k_dp8_cpu_s"] - x["web4k_dp8_again_cpu_s"] for x in mine)
            summary[kind] = {
                "first_call_extra_cpu_s_median": first[len(first) // 2],
                "import_cpu_s_median": sorted(x["import_cpu_s"] for x in mine)[len(mine) // 2],
            }
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
