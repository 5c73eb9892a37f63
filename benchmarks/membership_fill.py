"""How full a plan's rows are and how near each source stays to its share, per dp, side by side for planner trees.

Two sources (weights 0.75 / 0.25, lognormal documents of means ~350 and ~1,400 tokens, sigma 1), seq_len 4096,
500 steps, planned in memory (synthetic index tables, no data files). For each tree (a source directory holding
loomdata/, run in its own process) and each (dp, micro_batches): real tokens / (steps x dp x micro_batches x
seq_len) (the budget is planning.fill = 0.96 of that), the light source's realized share, the worst mixture error
after step 20 (points) and the planning CPU. Prints a table, writes JSON. `--windows` plans each shape also with
`planning.draw_window` W (the windowed draw at dp 1; W 0 is the default, the only one a tree without it runs).

    python benchmarks/membership_fill.py --trees /tmp/base/src src --out benchmarks/results/membership_fill.json
    python benchmarks/membership_fill.py --trees /tmp/base28/src src --windows 0 2 4 8 --shapes 1x1 1x2 4x1
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


def child(dp: int, mb: int, steps: int, seed: int, window: int = 0) -> dict[str, Any]:
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
            **({"planning": {"draw_window": window}} if window else {}),
        }
        spec = parse_spec(raw, Path(d), check_paths=False)
        t = time.process_time()
        res = make_plan(spec, index={"web": index_table(web), "books": index_table(books)})
        cpu = time.process_time() - t
        s = res.meta.summary
    return {
        "dp": dp,
        "micro_batches": mb,
        "draw_window": window,
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
    ap.add_argument("--windows", nargs="+", type=int, default=[0], help="planning.draw_window values (0: default)")
    ap.add_argument("--shapes", nargs="+", default=None, help="DPxMB shapes (default: 1x1 1x2 2x1 4x1 16x1)")
    ap.add_argument("--note", default="", help="added to the JSON's note (commits, time, load, command)")
    ap.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.steps, a.seed, a.child[2])))
        return 0
    rows = []
    shapes = SHAPES if a.shapes is None else [tuple(int(x) for x in sh.split("x")) for sh in a.shapes]
    runs = [(dp, mb, w, tree) for dp, mb in shapes for w in a.windows for tree in a.trees]
    for dp, mb, w, tree in runs:
        if w and tree != a.trees[-1]:  # the option is the last tree's (the change); the others run the default
            continue
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(dp),
            str(mb),
            str(w),
            "--steps",
            str(a.steps),
            "--seed",
            str(a.seed),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rows.append({"tree": tree, **json.loads(out.strip().splitlines()[-1])})
    head = f"{'tree':<24} {'dp':>3} {'mb':>3} {'W':>2} {'real tokens':>11} {'books share':>11}"
    print(f"{head} {'worst err pp':>12} {'cpu s':>6}")
    for r in rows:
        print(
            f"{r['tree'][-24:]:<24} {r['dp']:>3} {r['micro_batches']:>3} {r['draw_window']:>2} "
            f"{r['real_token_fraction']:>11.4f} "
            f"{r['books_share']:>11.4f} {r['worst_mixture_error_pp']:>12.2f} {r['plan_cpu_s']:>6.2f}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    note = "two sources 0.75/0.25, lognormal means ~350/~1400 (sigma 1), seq 4096, fill 0.96 (budget 0.96 of the rows)"
    a.out.write_text(
        json.dumps({"note": f"{note}; {a.note}" if a.note else note, "steps": a.steps, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
