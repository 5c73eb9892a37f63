"""Hybrid encoder/backbone balancing: does `cost.balance: both` shorten a multimodal step whose vision
encoder and language backbone run on different stages?

A captions source (each sample one image, some two, at 448 px with 14 px patches: an image is scaled
down, aspect kept, to at most 448 x 448 pixels, so it has up to 32 x 32 = 1024 patches, fewer when it is
small or not square; a caption of ~40 tokens) beside web text, on synthetic index tables (no data files).
The cost model is a ViT-L/14 beside a 7B backbone (CostSpec.VIT_L14_448: encoder attention within each
image, encoder_window 1024). Each config is planned with `balance: sum` and `balance: both` on the same
membership, and the plan's own report (summary `hybrid`, planning._report) gives, for loomdata and the two
baselines (concat-and-chunk, packed): encoder and backbone max/mean and max/LB, the hybrid objective
max(enc max / enc LB, bb max / bb LB) and the hybrid step time (each stage sized so that its mean
per-rank load takes the same time, so a step waits for max(enc max / enc mean, bb max / bb mean) times
that; summed over steps in backbone cost units), with its gain over sum balancing and over the
baselines; `step_time_equal_speed` (sum of max(enc max, bb max): stages of equal speed, where the backbone
dominates) is reported too.
Writes benchmarks/results/balance_multimodal.json.

    .venv/bin/python benchmarks/balance_multimodal.py             # 48 steps per run, dp 8, 64, 512
    .venv/bin/python benchmarks/balance_multimodal.py --steps 100 --dp 8 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from loomdata.planning import make_plan, plan_report
from loomdata.schemas import Spec
from loomdata.schemas.spec import CostSpec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMAGE_PX, PATCH_PX = 448, 14
CAPTIONS_WEIGHT = 0.5  # token share of the captions source (image tokens count as tokens)
# (seq_len, micro_batches) per config
SHAPES = {"mm-4k": (4096, 2), "mm-8k": (8192, 4)}


def image_patches(rng: np.random.Generator, n: int) -> np.ndarray:
    """Patches of n images: aspect ratio log-normal around 4:3 or 3:4, a third smaller than 448 x 448 px,
    scaled down (aspect kept) to at most IMAGE_PX^2 pixels, one patch per PATCH_PX x PATCH_PX."""
    aspect = np.exp(rng.normal(0.0, 0.35, n))
    side = np.where(rng.random(n) < 0.33, rng.uniform(160, IMAGE_PX, n), 2000.0)  # the short side, px
    area = np.minimum(side * side * np.maximum(aspect, 1 / aspect), IMAGE_PX * IMAGE_PX)
    w = np.sqrt(area * aspect)
    h = area / w
    return (np.floor(w / PATCH_PX) * np.floor(h / PATCH_PX)).astype(np.int64)


def _table(num_tokens: np.ndarray, num_image_tokens: np.ndarray) -> pa.Table:
    n = len(num_tokens)
    return pa.table(
        {
            "sample": pa.array(np.arange(n, dtype=np.uint64)),
            "shard": pa.array(np.zeros(n, dtype=np.uint32)),
            "row": pa.array(np.arange(n, dtype=np.uint64)),
            "num_tokens": pa.array(num_tokens.astype(np.uint32)),
            "num_image_tokens": pa.array(num_image_tokens.astype(np.uint32)),
        }
    )


def synthetic_index(total_tokens: int, seed: int) -> dict[str, pa.Table]:
    """captions (image tokens + caption) and web text, sized for about one epoch of each."""
    rng = np.random.default_rng([seed, 1])
    n_cap = int(1.1 * total_tokens * CAPTIONS_WEIGHT / 1100) + 1000
    n_img = np.where(rng.random(n_cap) < 0.15, 2, 1)
    first = image_patches(rng, n_cap)
    second = np.where(n_img == 2, image_patches(rng, n_cap), 0)
    img = first + second
    caption = np.clip(rng.lognormal(3.7, 0.6, n_cap), 5, 400).astype(np.int64)
    rng = np.random.default_rng([seed, 2])
    n_web = int(1.1 * total_tokens * (1 - CAPTIONS_WEIGHT) / 1100) + 1000
    web = np.clip(rng.lognormal(6.2, 1.1, n_web), 16, 100_000).astype(np.int64)
    return {"captions": _table(img + caption, img), "web": _table(web, np.zeros(n_web, dtype=np.int64))}


def make_spec(workdir: Path, seq_len: int, micro_batches: int, dp: int, steps: int, balance: str) -> Spec:
    raw: dict[str, Any] = {
        "name": "bench-multimodal",
        "workdir": str(workdir),
        "seed": 0,
        "sources": [
            {"name": "captions", "format": "parquet", "paths": ["none/*.parquet"], "tokens_field": "ids"},
            {"name": "web", "format": "parquet", "paths": ["none/*.parquet"], "tokens_field": "ids"},
        ],
        "mixture": {"weights": {"captions": CAPTIONS_WEIGHT, "web": 1 - CAPTIONS_WEIGHT}},
        "training": {"seq_len": seq_len, "steps": steps, "dp_size": dp, "micro_batches": micro_batches},
        "cost": {"attention": 1.0, "linear": 24576.0, **CostSpec.VIT_L14_448, "balance": balance},
    }
    return parse_spec(raw, workdir, check_paths=False)


def run(config: str, dp: int, steps: int, workdir: Path) -> dict[str, Any]:
    """Plan one config with sum and both balancing; the hybrid figures of both plans side by side."""
    seq_len, mb = SHAPES[config]
    index = synthetic_index(dp * mb * seq_len * steps, seed=dp)
    out: dict[str, Any] = {"config": config, "dp": dp, "seq_len": seq_len, "micro_batches": mb, "steps": steps}
    for balance in ("sum", "both"):
        spec = make_spec(workdir / f"{config}-{dp}-{balance}", seq_len, mb, dp, steps, balance)
        t0, c0 = time.perf_counter(), time.process_time()
        res = make_plan(spec, index=index)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        rep = plan_report(res.plan_dir)
        h = rep["hybrid"]
        out[balance] = {
            "plan_seconds": secs,
            "plan_cpu_seconds": cpu,
            "summed_max_over_lb": rep["imbalance"]["loomdata"]["mean"],
            **{k: _brief(h[k]) for k in ("loomdata", "concat_chunk", "packed")},
        }
    s, b = out["sum"], out["both"]
    t_both = b["loomdata"]["step_time"]
    out["gain_both_over_sum"] = s["loomdata"]["step_time"] / t_both
    out["gain_both_over_concat"] = b["concat_chunk"]["step_time"] / t_both
    out["gain_both_over_packed"] = b["packed"]["step_time"] / t_both
    out["gain_sum_over_stronger_baseline"] = (
        min(s["concat_chunk"]["step_time"], s["packed"]["step_time"]) / (s["loomdata"]["step_time"])
    )
    return out


def _brief(h: dict[str, Any]) -> dict[str, float]:
    return {
        "enc_max_over_mean": h["encoder"]["max_over_mean"]["mean"],
        "enc_max_over_lb": h["encoder"]["max_over_lb"]["mean"],
        "bb_max_over_mean": h["backbone"]["max_over_mean"]["mean"],
        "bb_max_over_lb": h["backbone"]["max_over_lb"]["mean"],
        "objective": h["objective"]["mean"],
        "objective_max": h["objective"]["max"],
        "step_time": h["step_time"],
        "step_time_equal_speed": h["step_time_equal_speed"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--configs", nargs="+", default=list(SHAPES))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for config in args.configs:
            for dp in args.dp:
                r = run(config, dp, args.steps, Path(d))
                rows.append(r)
                s, b = r["sum"]["loomdata"], r["both"]["loomdata"]
                print(
                    f"{config:6s} dp {dp:4d}  enc max/LB sum {s['enc_max_over_lb']:.3f} both {b['enc_max_over_lb']:.3f}"
                    f"  bb max/LB sum {s['bb_max_over_lb']:.3f} both {b['bb_max_over_lb']:.3f}"
                    f"  objective sum {s['objective']:.3f} both {b['objective']:.3f}"
                    f"  hybrid step time both vs sum {r['gain_both_over_sum']:.3f}x, vs concat "
                    f"{r['gain_both_over_concat']:.3f}x, vs packed {r['gain_both_over_packed']:.3f}x"
                    f"  plan cpu s sum {r['sum']['plan_cpu_seconds']:.1f} both {r['both']['plan_cpu_seconds']:.1f}",
                    flush=True,
                )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "balance_multimodal.json"
    out.write_text(json.dumps({"steps": args.steps, "runs": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
