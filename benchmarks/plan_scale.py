"""How fast and how lean is planning at scale? Samples/s and peak RSS per indexed sample at dp 1024.

Each run is its own subprocess, so `ru_maxrss` is that run's peak. A run notes its RSS after imports,
builds synthetic index tables (web 80% / code 20% of the samples, log-normal lengths, generated in
chunks; the tables themselves are 28 bytes a sample and count towards the peak), then plans about one
epoch at dp 1024 (--dp) x 4 micro-batches x 4,096 tokens (steps = index tokens / step capacity). Side by
side, in another subprocess on the same index, runs the naive planner a user writes today: one
shuffle of all samples, concatenated and cut into sequences, dealt round-robin, one manifest file (no
mixture schedule, no balancing, no report). Targets for loomdata: >= 1M samples/s and <= 100 bytes of
peak RSS per sample above the post-import baseline (the interpreter and libraries take ~115 MB, which
alone is 115 bytes a sample at 1M; the raw figure is printed too). Writes benchmarks/results/plan_scale.json
(plan_scale_dp<N>.json for another --dp).

    .venv/bin/python benchmarks/plan_scale.py                    # 1M and 10M samples, about 1 minute
    .venv/bin/python benchmarks/plan_scale.py --sizes 1e6 1e7 5e7
    .venv/bin/python benchmarks/plan_scale.py --sizes 1e6 --dp 8     # small dp: many steps, few segments each
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from _synthetic import index_table

RESULTS = Path(__file__).resolve().parent / "results" / "plan_scale.json"
DP, MICRO_BATCHES, SEQ_LEN = 1024, 4, 4096
SOURCES = {"web": (0.8, 6.2, 1.1), "code": (0.2, 6.8, 1.2)}  # share of samples, log-normal mu, sigma
GOAL_RATE = 1_000_000
GOAL_BYTES = 100


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic_index(samples: int, seed: int = 0) -> dict[str, pa.Table]:
    """Index tables (INDEX_SCHEMA) for SOURCES, lengths drawn in chunks so no float64 copy of them exists."""
    out = {}
    for k, (name, (share, mu, sigma)) in enumerate(SOURCES.items()):
        n = int(samples * share)
        rng = np.random.default_rng([seed, k])
        lengths = np.empty(n, dtype=np.uint32)
        for a in range(0, n, 1 << 20):
            b = min(n, a + (1 << 20))
            lengths[a:b] = np.clip(rng.lognormal(mu, sigma, b - a), 16, 100_000)
        out[name] = index_table(lengths)
    return out


def _steps(index: dict[str, pa.Table]) -> tuple[int, dict[str, float]]:
    tokens = {n: int(pc.sum(t["num_tokens"]).as_py()) for n, t in index.items()}
    total = sum(tokens.values())
    return max(1, total // (DP * MICRO_BATCHES * SEQ_LEN) - 1), {n: v / total for n, v in tokens.items()}


def child_loom(samples: int, workdir: Path) -> dict[str, Any]:
    from loomdata.planning import make_plan
    from loomdata.schemas import parse_spec

    base = _rss_mb()
    index = synthetic_index(samples)
    steps, weights = _steps(index)
    spec = parse_spec(
        {
            "name": "scale",
            "workdir": str(workdir),
            "sources": [{"name": n, "format": "parquet", "paths": ["x"], "tokens_field": "t"} for n in index],
            "mixture": {"weights": weights},
            "training": {"seq_len": SEQ_LEN, "steps": steps, "dp_size": DP, "micro_batches": MICRO_BATCHES},
        },
        workdir,
        check_paths=False,
    )
    t0 = time.perf_counter()
    res = make_plan(spec, index=index, fingerprints={n: f"synthetic-{samples}-{n}" for n in index})
    secs = time.perf_counter() - t0
    rows = sum(f.rows for f in res.meta.manifest)
    imb = res.meta.summary["imbalance"]
    return {
        "steps": steps,
        "seconds": secs,
        "rss_base_mb": base,
        "rss_peak_mb": _rss_mb(),
        "manifest_rows": rows,
        "files": len(res.meta.manifest),
        "imbalance_mean": imb["loomdata"]["mean"],
        "baseline_imbalance_mean": imb["baseline"]["mean"],
    }


def child_naive(samples: int, workdir: Path) -> dict[str, Any]:
    from loomdata.schemas.tables import MANIFEST_SCHEMA, TableKind, write_table

    base = _rss_mb()
    index = synthetic_index(samples)
    steps, _ = _steps(index)
    t0 = time.perf_counter()
    src = np.concatenate([np.full(t.num_rows, k, dtype=np.uint16) for k, t in enumerate(index.values())])
    sample = np.concatenate([t["sample"].to_numpy() for t in index.values()])
    length = np.concatenate([t["num_tokens"].to_numpy() for t in index.values()])
    perm = np.random.default_rng(0).permutation(len(src))
    src, sample, length = src[perm], sample[perm], length[perm]
    del perm
    start = np.cumsum(length, dtype=np.int64) - length
    seq = start // SEQ_LEN
    del start
    slots = DP * MICRO_BATCHES
    step = seq // slots
    keep = step < steps
    slot = seq[keep] % slots
    table = pa.Table.from_arrays(
        [
            pa.array(step[keep].astype(np.uint32)),
            pa.array((slot % DP).astype(np.uint32)),
            pa.array((slot // DP).astype(np.uint32)),
            pa.array(src[keep]),
            pa.array(sample[keep]),
            pa.array(np.zeros(int(keep.sum()), dtype=np.uint32)),
            pa.array(length[keep]),
            pa.array(np.zeros(int(keep.sum()), dtype=np.uint8)),
        ],
        schema=MANIFEST_SCHEMA,
    )
    write_table(table, workdir / "naive-manifest.parquet", TableKind.MANIFEST, row_group_size=1 << 17)
    secs = time.perf_counter() - t0
    return {
        "steps": steps,
        "seconds": secs,
        "rss_base_mb": base,
        "rss_peak_mb": _rss_mb(),
        "manifest_rows": table.num_rows,
        "files": 1,
    }


def run_child(kind: str, samples: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--samples", str(samples), "--dp", str(DP)],
        check=True,
        capture_output=True,
        text=True,
    )
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    r["samples_per_s"] = samples / r["seconds"]
    r["bytes_per_sample_raw"] = r["rss_peak_mb"] * 2**20 / samples
    r["bytes_per_sample"] = (r["rss_peak_mb"] - r["rss_base_mb"]) * 2**20 / samples
    return r


def main(argv: list[str] | None = None) -> int:
    global DP
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7])
    ap.add_argument("--child", choices=["loom", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dp", type=int, default=DP, help=f"data-parallel size (default {DP})")
    args = ap.parse_args(argv)
    DP = args.dp
    if args.child:
        with tempfile.TemporaryDirectory(prefix="loom-scale-") as d:
            fn = child_loom if args.child == "loom" else child_naive
            print(json.dumps(fn(args.samples, Path(d))))
        return 0
    print(
        f"{'samples':>11}{'steps':>7}{'planner':>9}{'seconds':>9}{'samples/s':>12}{'peak MB':>9}"
        f"{'B/sample':>10}{'raw B/s':>9}{'rows':>11}  vs naive",
        flush=True,
    )
    runs = []
    ok = True
    for size in args.sizes:
        n = int(size)
        loom, naive = run_child("loom", n), run_child("naive", n)
        for name, r in (("loomdata", loom), ("naive", naive)):
            ratio = f"{loom['seconds'] / naive['seconds']:.2f}x time" if name == "loomdata" else ""
            print(
                f"{n:>11,}{r['steps']:>7}{name:>9}{r['seconds']:>9.2f}{r['samples_per_s']:>12,.0f}"
                f"{r['rss_peak_mb']:>9.0f}{r['bytes_per_sample']:>10.1f}{r['bytes_per_sample_raw']:>9.1f}"
                f"{r['manifest_rows']:>11,}  {ratio}",
                flush=True,
            )
        meets = loom["samples_per_s"] >= GOAL_RATE and loom["bytes_per_sample"] <= GOAL_BYTES
        ok &= meets
        runs.append(
            {
                "samples": n,
                "dp": DP,
                "micro_batches": MICRO_BATCHES,
                "seq_len": SEQ_LEN,
                "loomdata": loom,
                "naive": naive,
                "time_ratio": loom["seconds"] / naive["seconds"],
                "meets_goal": meets,
            }
        )
    results = RESULTS if DP == 1024 else RESULTS.with_name(f"plan_scale_dp{DP}.json")
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps({"goal": {"samples_per_s": GOAL_RATE, "bytes_per_sample": GOAL_BYTES}, "runs": runs}, indent=1)
        + "\n"
    )
    print(f"wrote {results}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
