"""How full a plan's rows are and how near each source stays to its share, per dp, side by side for planner trees.

Two sources (weights 0.75 / 0.25, lognormal documents of means ~350 and ~1,400 tokens, sigma 1), seq_len 4096,
500 steps, planned in memory (synthetic index tables, no data files). For each tree (a source directory holding
loomdata/, run in its own process) and each (dp, micro_batches): real tokens / (steps x dp x micro_batches x
seq_len) (the budget is planning.fill = 0.96 of that), the light source's realized share, the worst mixture error
after step 20 (points) and the planning CPU. Prints a table, writes JSON.

    python benchmarks/membership_fill.py --trees /tmp/base/src src --out benchmarks/results/membership_fill.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = [(1, 1), (1, 2), (2, 1), (4, 1), (16, 1)]


def child(dp: int, mb: int, steps: int, seed: int) -> dict[str, Any]:
    """Plan one shape with whichever loomdata is on the path; its figures."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _synthetic import index_table
    from loomdata.planning import make_plan
    from loomdata.schemas.spec import parse_spec

    rng = np.random.default_rng(seed)
    web = np.clip(rng.lognormal(np.log(350) - 0.5, 1.0, 400_000), 16, 100_000)
    books = np.clip(rng.lognormal(np.log(1400) - 0.5, 1.0, 200_000), 16, 100_000)
    with tempfile.TemporaryDirectory() as d:
        raw = {
            "name": "fill",
            "workdir": d,
            "seed": seed,
            "sources": [
                {"name": n, "format": "parquet", "paths": ["none/*.parquet"], "tokens_field": "ids"}
                for n in ("web", "books")
            ],
            "mixture": {"weights": {"web": 0.75, "books": 0.25}},
            "training": {"seq_len": 4096, "steps": steps, "dp_size": dp, "micro_batches": mb},
        }
        spec = parse_spec(raw, Path(d), check_paths=False)
        t = time.process_time()
        res = make_plan(spec, index={"web": index_table(web), "books": index_table(books)})
        cpu = time.process_time() - t
        s = res.meta.summary
    return {
        "dp": dp,
        "micro_batches": mb,
        "real_token_fraction": s["tokens"] / (steps * dp * mb * 4096),
        "books_share": s["mixture"]["books"]["realized_share"],
        "worst_mixture_error_pp": s["worst_mixture_error_pp"],
        "planner_version": res.meta.parameters.planner_version,
        "plan_cpu_s": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="+", default=["src"], help="source trees (directories holding loomdata/)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/membership_fill.json"))
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.steps, a.seed)))
        return 0
    rows = []
    for dp, mb in SHAPES:
        for tree in a.trees:
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            cmd = [
                sys.executable,
                __file__,
                "--child",
                str(dp),
                str(mb),
                "--steps",
                str(a.steps),
                "--seed",
                str(a.seed),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            rows.append({"tree": tree, **json.loads(out.strip().splitlines()[-1])})
    print(f"{'tree':<24} {'dp':>3} {'mb':>3} {'real tokens':>11} {'books share':>11} {'worst err pp':>12} {'cpu s':>6}")
    for r in rows:
        print(
            f"{r['tree'][-24:]:<24} {r['dp']:>3} {r['micro_batches']:>3} {r['real_token_fraction']:>11.4f} "
            f"{r['books_share']:>11.4f} {r['worst_mixture_error_pp']:>12.2f} {r['plan_cpu_s']:>6.2f}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    note = "two sources 0.75/0.25, lognormal means ~350/~1400 (sigma 1), seq 4096, fill 0.96 (budget 0.96 of the rows)"
    a.out.write_text(json.dumps({"note": note, "steps": a.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
