"""Golden plan hashes: reference plans on synthetic in-memory index tables, hashed by content.

Each case plans a fixed spec over fixed synthetic index tables and hashes (sha256) the manifest ROWS (the
manifest tables in step order, each column's bytes) and the columns of report/steps.parquet: not the
Parquet file bytes and not the plan id, so a change of the id (or of file metadata) does not show, while
any change of what the planner decides does. tests/unit/planning/test_golden_plans.py compares them with
tests/unit/planning/golden_plans.json, recorded from the planner before its refactors.

    PYTHONPATH=src:tests python -m loomtest.golden_plans            # print the hashes as JSON
    PYTHONPATH=src:tests python -m loomtest.golden_plans --write    # record them into golden_plans.json
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.planning import PlanResume, make_plan
from loomdata.schemas.plan import read_manifest, read_plan
from loomdata.schemas.spec import Spec, parse_spec
from loomdata.schemas.tables import synthetic_index

__all__ = ["CASES", "GOLDEN_FILE", "golden_hashes", "plan_hashes"]

GOLDEN_FILE = Path(__file__).resolve().parents[1] / "unit" / "planning" / "golden_plans.json"


_index = synthetic_index  # (the one synthetic index builder: schemas.tables)


def _lognormal(seed: int, n: int, mu: float, sigma: float, lo: int = 16, hi: int = 100_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mu, sigma, n), lo, hi).astype(np.uint32)


def _spec(workdir: Path, sources: list[str], training: dict[str, int], **extra: Any) -> Spec:
    raw: dict[str, Any] = {
        "name": "golden",
        "workdir": str(workdir),
        "seed": 11,
        "sources": [
            {"name": s, "format": "parquet", "paths": ["none/*.parquet"], "tokens_field": "ids"} for s in sources
        ],
        "mixture": extra.pop("mixture", {"weights": dict.fromkeys(sources, 1.0)}),
        "training": training,
        **extra,
    }
    return parse_spec(raw, workdir, check_paths=False)


Case = Callable[[Path], tuple[Spec, dict[str, pa.Table], dict[str, Any]]]


def _web4k(dp: int, steps: int) -> Case:
    def case(wd: Path) -> tuple[Spec, dict[str, pa.Table], dict[str, Any]]:
        n = max(2000, dp * steps * 4 * 4096 // 600)
        index = {"web": _index(_lognormal(1, n, 6.0, 1.1)), "code": _index(_lognormal(2, n // 3, 6.6, 1.2))}
        spec = _spec(
            wd,
            ["web", "code"],
            {"seq_len": 4096, "steps": steps, "dp_size": dp, "micro_batches": 4},
            mixture={"weights": {"web": 0.75, "code": 0.25}},
        )
        return spec, index, {}

    return case


def _books32k(wd: Path) -> tuple[Spec, dict[str, pa.Table], dict[str, Any]]:
    books = _lognormal(3, 600, 10.0, 1.0, lo=2000, hi=400_000)
    index = {"web": _index(_lognormal(4, 30_000, 6.2, 1.1)), "books": _index(books)}
    spec = _spec(
        wd,
        ["web", "books"],
        {"seq_len": 32768, "steps": 40, "dp_size": 8, "micro_batches": 2},
        mixture={"weights": {"web": 0.6, "books": 0.4}},
    )
    return spec, index, {}


def _long_lane(wd: Path) -> tuple[Spec, dict[str, pa.Table], dict[str, Any]]:
    index = {"web": _index(_lognormal(5, 40_000, 6.2, 1.1)), "long": _index(_lognormal(6, 3000, 9.3, 0.8, lo=500))}
    spec = _spec(
        wd,
        ["web", "long"],
        {"seq_len": 8192, "steps": 50, "dp_size": 8, "micro_batches": 4},
        mixture={"weights": {"web": 0.7, "long": 0.3}},
        long_context={"threshold": 8192, "seq_len": 32768, "cp_size": 4},
    )
    return spec, index, {}


def _caps(seed: int, seq_len: int, dp: int, micro_batches: int, caps_weight: float) -> Case:
    """Image samples that cannot be split (90% of one source) on few slots: some steps defer image samples
    into the next step (carried items), many have leftovers that get split or moved."""

    def case(wd: Path) -> tuple[Spec, dict[str, pa.Table], dict[str, Any]]:
        rng = np.random.default_rng(seed)
        n = 3000
        ln = rng.integers(seq_len // 3, seq_len + 1, n).astype(np.uint32)
        img = np.where(rng.random(n) < 0.9, ln, 0).astype(np.uint32)
        txt = rng.integers(1, seq_len + 1, n).astype(np.uint32)
        big = rng.random(n) < 0.2
        txt[big] = rng.integers(seq_len, 3 * seq_len, int(big.sum()))
        index = {"caps": _index(ln, img), "text": _index(txt)}
        spec = _spec(
            wd,
            ["caps", "text"],
            {"seq_len": seq_len, "steps": 200, "dp_size": dp, "micro_batches": micro_batches},
            mixture={"weights": {"caps": caps_weight, "text": 1.0}},
        )
        return spec, index, {}

    return case


def _curriculum(wd: Path) -> tuple[Spec, dict[str, pa.Table], dict[str, Any]]:
    index = {
        "web": _index(_lognormal(9, 40_000, 6.0, 1.1)),
        "code": _index(_lognormal(10, 20_000, 6.6, 1.2)),
        "math": _index(_lognormal(11, 10_000, 5.5, 0.9)),
    }
    schedule = [
        {"step": 0, "weights": {"web": 0.8, "code": 0.2, "math": 0.0}},
        {"step": 30, "weights": {"web": 0.5, "code": 0.3, "math": 0.2}},
        {"step": 70, "weights": {"web": 0.3, "code": 0.3, "math": 0.4}},
    ]
    spec = _spec(
        wd,
        ["web", "code", "math"],
        {"seq_len": 2048, "steps": 100, "dp_size": 4, "micro_batches": 4},
        mixture={"schedule": schedule},
    )
    return spec, index, {}


def _elastic(base_case: Case, at_step: int | None, dp: int, micro_batches: int, steps: int) -> Case:
    """A re-plan of base_case's plan from at_step (None: the step after the base's first deferral from step 20
    on, so in-flight image samples go into the re-plan) with another dp_size and micro_batches."""

    def case(wd: Path) -> tuple[Spec, dict[str, pa.Table], dict[str, Any]]:
        base, index, _ = base_case(wd)
        res = make_plan(base, index=index)
        s = at_step
        if s is None:
            deferred = pq.read_table(res.plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy() > 0
            s = int(np.flatnonzero(deferred[20:])[0]) + 21
        tr = base.training.model_copy(update={"dp_size": dp, "micro_batches": micro_batches, "steps": steps})
        return (
            base.model_copy(update={"training": tr}),
            index,
            {"resume_from": PlanResume(plan_dir=res.plan_dir, at_step=s)},
        )

    return case


CASES: dict[str, Case] = {
    "web4k_dp1": _web4k(1, 200),
    "web4k_dp8": _web4k(8, 120),
    "web4k_dp64": _web4k(64, 40),
    "web4k_dp300": _web4k(300, 12),
    "books32k_dp8": _books32k,
    "long_lane_cp4": _long_lane,
    "images_defer_dp3": _caps(11, 128, 3, 2, 4.0),
    "images_defer_dp2": _caps(10, 64, 2, 2, 3.0),
    "images_leftovers_dp1": _caps(9, 128, 1, 4, 1.0),
    "curriculum": _curriculum,
    "elastic_web_dp8_to_dp64": _elastic(_web4k(8, 120), 50, 64, 2, 90),
    "elastic_images_in_flight": _elastic(_caps(11, 128, 3, 2, 4.0), None, 5, 2, 220),
}


def plan_hashes(plan_dir: Path) -> dict[str, str]:
    """sha256 of the manifest rows (every column's bytes, step order) and of report/steps.parquet's columns, with
    every source's `tokens__<name>` and `weight__<name>` among them wherever the plan keeps them (columns of that
    table up to planner version 8, report/sources.parquet and weights.parquet from 9: the same hash for the same
    figures)."""
    meta = read_plan(plan_dir)
    h = hashlib.sha256()
    for f in meta.manifest:
        table = read_manifest(plan_dir, meta, f.first_step, f.last_step)
        for name in table.column_names:
            h.update(name.encode())
            h.update(np.ascontiguousarray(table.column(name).to_numpy()).tobytes())
    r = hashlib.sha256()
    from loomdata.planning._report import source_columns  # here: benchmarks import CASES under older trees too

    table = pq.read_table(plan_dir / "report" / "steps.parquet")
    steps = {name: table.column(name).to_numpy() for name in table.column_names}
    steps.update(source_columns(plan_dir, list(meta.sources)))
    for name in sorted(steps):
        r.update(name.encode())
        r.update(np.ascontiguousarray(steps[name]).tobytes())
    return {"manifest": h.hexdigest(), "report_steps": r.hexdigest(), "steps": str(meta.steps)}


def golden_hashes(names: list[str] | None = None) -> dict[str, dict[str, str]]:
    """Plan every case (or the named ones) in a temporary workdir and return their hashes."""
    out = {}
    for name, case in CASES.items():
        if names is not None and name not in names:
            continue
        with tempfile.TemporaryDirectory() as d:
            spec, index, kw = case(Path(d))
            res = make_plan(spec, index=index, **kw)
            out[name] = plan_hashes(res.plan_dir)
    return out


def main(argv: list[str]) -> None:
    """Print the hashes; with --write, record them into GOLDEN_FILE."""
    hashes = golden_hashes()
    text = json.dumps(hashes, indent=1, sort_keys=True) + "\n"
    if "--write" in argv:
        GOLDEN_FILE.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
