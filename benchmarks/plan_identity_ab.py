"""Are two planner trees' plans byte-identical? Every file of every plan dir, over varied shapes.

Plans the golden cases (tests/loomtest/golden_plans.py: dp 1-300, images, long lane, curriculum, re-plans)
and extra shapes (3-300 sources, dp 2-1024, micro-batches 1/2/4, look-ahead off, curricula over many
sources) with each tree in its own subprocess, in the same workdir (plan.json holds the spec's paths), and
compares the sha256 of every file (manifest partitions, report tables, plan.json). Exit status 1 on any
difference. Writes --out (JSON) when given.

--content compares what the plans hold instead of their bytes, for a change of on-disk encoding (a
PLANNER_VERSION bump changes every plan id): each Parquet file read back with pyarrow (column names and types,
its loomdata.* metadata, every column's values in stored order, which is the plan's order), plan.json as
parsed; the plan ids (dir names, plan.json's ids, each table's `plan_id` stamp) are replaced by their role
(`plan`, or `base` for a re-plan's base) and `planner_version` by `*`. Every row (step, rank, micro-batch,
source, sample, offset, length, lane) and every report figure and summary number must be equal. The report's
steps table is compared as one logical table whatever its layout: its own columns and every source's
`tokens__<name>` (int64) and `weight__<name>` (float64) of every step, whether stored as its columns (planner
version 8 and earlier) or in report/sources.parquet and report/weights.parquet (version 9; those two files are
not compared on their own).

    .venv/bin/python benchmarks/plan_identity_ab.py --before /work/main/src --after src
    .venv/bin/python benchmarks/plan_identity_ab.py --before /tmp/main/src --after src --content
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
TESTS = HERE.parents[1] / "tests"
sys.path.insert(0, str(TESTS))  # loomtest.golden_plans


ROWS_PER_FILE = 1 << 12
"""Drawn segments per manifest partition in these plans (the planner's default holds 2^18)."""


def _lognormal(seed: int, n: int, mu: float, sigma: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mu, sigma, n), 16, 100_000).astype(np.uint32)


def _many(n_src: int, dp: int, mb: int, steps: int, *, lookahead: int | None = None, curriculum: bool = False) -> Any:
    """A mix of n_src web-like and code-like sources (unequal weights) at dp x mb x 4K for `steps` steps."""
    from loomtest.golden_plans import _index, _spec

    def case(wd: Path) -> Any:
        names = [f"s{k:03d}" for k in range(n_src)]
        need = dp * mb * steps * 4096 // 500 + 1000
        sizes = [max(200, int(need * (2 if k % 2 == 0 else 1) / (1.5 * n_src)) * 2) for k in range(n_src)]
        index = {
            n: _index(_lognormal(100 + k, sizes[k], 6.0 if k % 2 == 0 else 6.7, 1.1 if k % 2 == 0 else 1.3))
            for k, n in enumerate(names)
        }
        weights = {n: 1.0 + (k % 7) for k, n in enumerate(names)}
        extra: dict[str, Any] = {}
        if curriculum:
            half = {n: (w if k % 3 else 0.0) + 0.5 for k, (n, w) in enumerate(weights.items())}
            extra["mixture"] = {
                "schedule": [
                    {"step": 0, "weights": weights},
                    {"step": steps // 3, "weights": half},
                    {"step": 2 * steps // 3, "weights": weights},
                ]
            }
        else:
            extra["mixture"] = {"weights": weights}
        if lookahead is not None:
            extra["planning"] = {"lookahead": lookahead}
        spec = _spec(wd, names, {"seq_len": 4096, "steps": steps, "dp_size": dp, "micro_batches": mb}, **extra)
        return spec, index, {}

    return case


def cases() -> dict[str, Any]:
    """The golden cases and the extra shapes, by name."""
    from loomtest.golden_plans import CASES

    out = dict(CASES)
    out.update(
        {
            "src3_dp2_mb1": _many(3, 2, 1, 400),
            "src3_dp4_mb2_nolookahead": _many(3, 4, 2, 200, lookahead=0),
            "src40_dp4_mb4": _many(40, 4, 4, 300),
            "src40_dp8_mb2_curriculum": _many(40, 8, 2, 200, curriculum=True),
            "src300_dp4_mb4": _many(300, 4, 4, 200),
            "src300_dp64_mb1": _many(300, 64, 1, 40),
            "src300_dp4_curriculum_nolookahead": _many(300, 4, 4, 150, lookahead=0, curriculum=True),
            "src2_dp1024_mb1": _many(2, 1024, 1, 6),
            "src1_dp4_mb4": _many(1, 4, 4, 500),
            "src1_dp64_mb4_nolookahead": _many(1, 64, 4, 60, lookahead=0),
        }
    )
    return out


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _roles(plans: Path) -> dict[str, str]:
    """plan id -> role: `base` for a plan another one here re-plans from, `plan` for the rest (one each: a case
    holds one plan or a base and its re-plan; a longer chain raises, as it could not be told apart by role)."""
    metas = {d.name: json.loads((d / "plan.json").read_text()) for d in plans.iterdir() if (d / "plan.json").is_file()}
    bases = {(m["parameters"].get("resume") or {}).get("base_plan_id") for m in metas.values()}
    roles = {pid: "base" if pid in bases else "plan" for pid in metas}
    if sorted(roles.values()) not in (["plan"], ["base", "plan"]):
        raise ValueError(f"cannot tell the plans of {plans} apart by role: {roles}")
    return roles


def _neutral(x: Any, roles: dict[str, str]) -> Any:
    """`x` (parsed JSON or a string) with every plan id replaced by its role and planner_version by '*'."""
    if isinstance(x, dict):
        return {k: "*" if k == "planner_version" else _neutral(v, roles) for k, v in x.items()}
    if isinstance(x, list):
        return [_neutral(v, roles) for v in x]
    if isinstance(x, str):
        for pid, role in roles.items():
            x = x.replace(pid, f"<{role}>")
    return x


def content_hashes(root: Path) -> dict[str, str]:
    """sha256 of what every file under root holds, by relative path with plan ids replaced by their role: a
    Parquet file's columns (names, types, values in stored order) and loomdata.* metadata, a JSON file parsed
    (plan ids and planner_version neutral), any other file's bytes."""
    import pyarrow.parquet as pq

    roles = _roles(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or (p.parent.name == "report" and p.name in ("sources.parquet", "weights.parquet")):
            continue
        h = hashlib.sha256()
        if p.parent.name == "report" and p.name == "steps.parquet":
            t = pq.read_table(p)
            meta = {k.decode(): v.decode() for k, v in (t.schema.metadata or {}).items() if k.startswith(b"loomdata.")}
            h.update(json.dumps(_neutral(meta, roles), sort_keys=True).encode())
            for name, col in sorted(_report_columns(p).items()):
                h.update(f"{name}:{col.dtype}".encode())
                h.update(np.ascontiguousarray(col).tobytes())
        elif p.suffix == ".parquet":
            t = pq.read_table(p)
            meta = {k.decode(): v.decode() for k, v in (t.schema.metadata or {}).items() if k.startswith(b"loomdata.")}
            h.update(json.dumps(_neutral(meta, roles), sort_keys=True).encode())
            for name, col in zip(t.column_names, t.columns, strict=True):
                h.update(f"{name}:{col.type}:{col.null_count}".encode())
                h.update(np.ascontiguousarray(col.to_numpy()).tobytes())
        elif p.suffix == ".json":
            h.update(json.dumps(_neutral(json.loads(p.read_text()), roles), sort_keys=True).encode())
        else:
            h.update(p.read_bytes())
        out[_neutral(str(p.relative_to(root)), roles)] = h.hexdigest()
    return out


def _report_columns(steps_file: Path) -> dict[str, np.ndarray]:
    """report/steps.parquet's columns with every source's token counts and weights of every step among them,
    from the steps table's own columns (planner version 8 and earlier) or report/sources.parquet and
    report/weights.parquet (version 9: the cells that place tokens; the steps whose weights change)."""
    import pyarrow.parquet as pq

    t = pq.read_table(steps_file)
    cols = {n: t.column(n).to_numpy() for n in t.column_names}
    sources_file, weights_file = steps_file.parent / "sources.parquet", steps_file.parent / "weights.parquet"
    if not sources_file.exists():
        return cols
    names = json.loads((steps_file.parent.parent / "plan.json").read_text())["sources"]
    names = [s if isinstance(s, str) else s["name"] for s in names]
    steps = len(cols["step"])
    cells = pq.read_table(sources_file)
    tokens = np.zeros((len(names), steps), dtype=np.int64)
    tokens[cells.column("source").to_numpy(), cells.column("step").to_numpy()] = cells.column("tokens").to_numpy()
    w = pq.read_table(weights_file)
    row = np.searchsorted(w.column("step").to_numpy(), np.arange(steps), side="right") - 1
    for k, name in enumerate(names):
        cols[f"tokens__{name}"] = tokens[k]
        cols[f"weight__{name}"] = w.column(f"weight__{name}").to_numpy()[row]
    return cols


def child(name: str, workdir: Path, content: bool = False) -> dict[str, str]:
    """Plan case `name` in workdir; the hashes of every file of its plans dir (a re-plan's base included): of
    their bytes, or with `content` of what they hold (content_hashes)."""
    from loomdata.planning import _manifest, make_plan

    _manifest.ROWS_PER_FILE = ROWS_PER_FILE  # several partitions a plan (their bounds are compared too)
    spec, index, kw = cases()[name](workdir)
    make_plan(spec, index=index, **kw)
    return content_hashes(spec.plans_dir) if content else file_hashes(spec.plans_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="source tree (the directory holding loomdata/) of the baseline")
    ap.add_argument("--after", help="source tree of the change")
    ap.add_argument("--cases", nargs="*", help="only these cases")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--content", action="store_true", help="compare what the files hold, not their bytes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.workdir, args.content)))
        return 0
    names = args.cases or list(cases())
    results: dict[str, Any] = {}
    bad = 0
    with tempfile.TemporaryDirectory(prefix="loom-ident-") as d:
        wd = Path(d) / "wd"
        for name in names:
            got = {}
            for tree in ("before", "after"):
                shutil.rmtree(wd, ignore_errors=True)
                wd.mkdir()
                src = str(Path(getattr(args, tree)).resolve())
                env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{TESTS}")
                cmd = [
                    sys.executable,
                    str(HERE),
                    "--child",
                    name,
                    "--workdir",
                    str(wd),
                ]
                if args.content:
                    cmd.append("--content")
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                got[tree] = json.loads(out.stdout.strip().splitlines()[-1])
            same = got["before"] == got["after"]
            diff = sorted(
                k for k in set(got["before"]) | set(got["after"]) if got["before"].get(k) != got["after"].get(k)
            )
            bad += not same
            results[name] = {"identical": same, "files": len(got["after"]), "differ": diff}
            print(
                f"{name:40s} {'identical' if same else 'DIFFERENT'} ({len(got['after'])} files) {diff[:3]}", flush=True
            )
    mode = "content" if args.content else "bytes"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"identical": bad == 0, "compared": mode, "cases": results}, indent=1) + "\n")
    print(f"{len(names) - bad}/{len(names)} identical ({mode})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
