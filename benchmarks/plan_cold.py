"""What a fresh planning process pays once: a small plan cold (first in its process) against the same plan again.

Every `loom plan`, elastic re-plan and Dask worker planning a step range is a fresh process, so besides the plan's own
work it pays numba's first-use set-up (its registries, imports and runtime, whichever kernel is called first), loading
every kernel it calls from the on-disk cache (object code linked and relocated, ~1.7 ms a kernel + 0.16 ms a KB of it:
docs/planning.md) and its first touch of fresh memory. Each measurement is its own subprocess (PYTHONPATH = the tree)
that imports the planner, plans --steps steps of the index in --workdir (a plan_scale index: written first when
absent, --samples x --n-sources) at --dp, removes that plan dir and plans it again. Reported, CPU seconds (user +
system): import; the cold plan and the warm one (their difference: the once-per-process cost inside make_plan); of the
cold plan numba's set-up and the kernel loads (count, CPU), by wrapping numba's Dispatcher._compile_for_args (a cached
kernel's first call) and the set-up's first registry load; minor page faults and system time of both plans; the whole
child's CPU (RUSAGE_CHILDREN, interpreter start and exit included), and the same up to the end of the cold plan (what
a `loom plan`-like process pays). Trees run in alternating order, --rounds times, after one untimed run each (its
kernel cache filled). Writes --out (JSON).

    flock /tmp/loom-bench.lock .venv/bin/python benchmarks/plan_cold.py --workdir /tmp/pst10b --dp 4 \
        --trees base=/tmp/base30/src after=src --rounds 5 --out benchmarks/results/plan_cold.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIGURES = [
    ("import_cpu_s", "import"),
    ("cold_cpu_s", "cold plan"),
    ("cold_sys_s", "of it system"),
    ("warm_cpu_s", "warm plan"),
    ("warm_sys_s", "of it system"),
    ("once_cpu_s", "cold-warm"),
    ("numba_setup_cpu_s", "numba set-up"),
    ("kernel_load_cpu_s", "kernel loads"),
    ("cold_plan_process_cpu_s", "plan process"),
    ("process_cpu_s", "child total"),
]


def child(workdir: Path, dp: int, steps: int) -> dict[str, Any]:
    """In a fresh process: import, plan cold, plan again; the figures as a dict (printed as JSON)."""
    c0 = time.process_time()
    from numba.core import cpu, dispatcher
    from numba.core.typing import context as typing_context

    loads = {"n": 0, "cpu": 0.0, "setup": 0.0}
    compile_for_args = getattr(dispatcher.Dispatcher, "_compile_for_args")  # noqa: B009

    def timed_load(self: Any, *a: Any, **kw: Any) -> Any:
        c = time.process_time()
        try:
            return compile_for_args(self, *a, **kw)
        finally:
            loads["n"] += 1
            loads["cpu"] += time.process_time() - c

    setattr(dispatcher.Dispatcher, "_compile_for_args", timed_load)  # noqa: B010
    for owner in (cpu.CPUContext, typing_context.BaseContext):
        name = "load_additional_registries" if owner is cpu.CPUContext else "refresh"
        _time_first_call(owner, name, loads)

    sys.path.insert(0, str(HERE))
    import plan_scale
    from loomdata.planning import make_plan
    from loomdata.schemas import parse_spec

    info = json.loads((workdir / "index-info.json").read_text())
    raw = {
        "name": "cold",
        "workdir": str(workdir),
        "sources": [{"name": n, "format": "parquet", "paths": ["x"], "tokens_field": "t"} for n in info["weights"]],
        "mixture": {"weights": info["weights"]},
        "training": {
            "seq_len": plan_scale.SEQ_LEN,
            "steps": steps,
            "dp_size": dp,
            "micro_batches": plan_scale.MICRO_BATCHES,
        },
    }
    spec = parse_spec(raw, workdir, check_paths=False)
    out: dict[str, Any] = {"import_cpu_s": time.process_time() - c0}
    for run in ("cold", "warm"):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c = time.process_time()
        result = make_plan(spec)
        out[f"{run}_cpu_s"] = time.process_time() - c
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out[f"{run}_sys_s"] = r1.ru_stime - r0.ru_stime
        out[f"{run}_minflt"] = r1.ru_minflt - r0.ru_minflt
        shutil.rmtree(result.plan_dir)
        if run == "cold":
            ru = resource.getrusage(resource.RUSAGE_SELF)
            out["cold_plan_process_cpu_s"] = ru.ru_utime + ru.ru_stime
            out["kernel_loads"] = loads["n"]
            out["numba_setup_cpu_s"] = loads["setup"]
            out["kernel_load_cpu_s"] = loads["cpu"] - loads["setup"]
    out["once_cpu_s"] = out["cold_cpu_s"] - out["warm_cpu_s"]
    return out


def _time_first_call(owner: type, name: str, into: dict[str, Any]) -> None:
    """Add the CPU seconds of owner.name's first call (numba's one-time set-up) to into["setup"]."""
    original = getattr(owner, name)
    done: list[bool] = []

    def first(self: Any, *a: Any, **kw: Any) -> Any:
        if done:
            return original(self, *a, **kw)
        done.append(True)
        c = time.process_time()
        try:
            return original(self, *a, **kw)
        finally:
            into["setup"] += time.process_time() - c

    setattr(owner, name, first)


def run_child(src: str, workdir: Path, dp: int, steps: int) -> dict[str, Any]:
    """One measurement in a fresh interpreter with `src` first on its path; adds the child's whole CPU."""
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    args = [sys.executable, __file__, "--child", "--workdir", str(workdir), "--dp", str(dp), "--steps", str(steps)]
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    r["process_cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return r


def summarize(runs: list[dict[str, Any]], trees: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per tree and figure: [min, median, max] over the rounds."""
    out: dict[str, dict[str, list[float]]] = {}
    for t in trees:
        mine = [r for r in runs if r["tree"] == t]
        out[t] = {}
        for key, _ in [*FIGURES, ("cold_minflt", ""), ("warm_minflt", ""), ("kernel_loads", "")]:
            v = sorted(float(r[key]) for r in mine)
            out[t][key] = [round(v[0], 3), round(v[len(v) // 2], 3), round(v[-1], 3)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, required=True, help="a plan_scale index (written when absent)")
    ap.add_argument("--samples", type=float, default=1e7, help="index size when --workdir has none")
    ap.add_argument("--n-sources", type=int, default=300, help="sources when --workdir has no index")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trees", nargs="+", default=["src=src"], help="NAME=SRC (the directory holding loomdata/)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.workdir, args.dp, args.steps)))
        return 0
    if not (args.workdir / "index-info.json").exists():
        sys.path.insert(0, str(HERE))
        import plan_scale

        args.workdir.mkdir(parents=True, exist_ok=True)
        info = plan_scale.write_index(int(args.samples), args.n_sources, args.workdir)
        (args.workdir / "index-info.json").write_text(json.dumps(info))
    trees = dict(t.split("=", 1) for t in args.trees)
    names = list(trees)
    print("tree      " + "".join(f"{label:>14}" for _, label in FIGURES) + "  loads  minflt cold/warm", flush=True)
    for name in names:  # untimed: fills a tree's kernel cache (a first run compiles every kernel it calls)
        run_child(trees[name], args.workdir, args.dp, args.steps)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            x = run_child(trees[name], args.workdir, args.dp, args.steps)
            x.update(tree=name, round=r)
            runs.append(x)
            cells = "".join(f"{x[key]:14.3f}" for key, _ in FIGURES)
            print(f"{name:10s}{cells}  {x['kernel_loads']:5d}  {x['cold_minflt']}/{x['warm_minflt']}", flush=True)
    summary = summarize(runs, names)
    for name in names:
        print(f"{name}: " + ", ".join(f"{k} {v[1]} [{v[0]}-{v[2]}]" for k, v in summary[name].items()))
    if args.out:
        meta = {"workdir": str(args.workdir), "dp": args.dp, "steps": args.steps, "trees": trees, "note": args.note}
        args.out.write_text(json.dumps({**meta, "summary": summary, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
