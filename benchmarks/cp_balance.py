"""How evenly do long-lane sequences split over their context-parallel ranks, and what does sharding cost?

For bench-long-lanes (benchmarks/balance.py: the 32K long-tail mix as 8K sequences plus a 32K long
lane) with the long lane over cp 2, 4 and 8 ranks at dp 8, this plans with synthetic index tables
and reads the plan report's `context_parallel` figures: per long sequence, max CP rank cost / mean in
the served layout (Megatron's chunks i and 2cp-1-i of 2cp), and `time_ratio`, the long-lane
micro-batches' time (their costliest CP rank) over the even split the planner priced. Then it times
`shard_batch` on a full 32K micro-batch and counts the bytes one CP peer receives, whole vs shard.
Prints a table, writes benchmarks/results/cp_balance.json.

    .venv/bin/python benchmarks/cp_balance.py            # 48 steps per run, a few seconds
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from balance import CONFIGS, LANES_LONG_CONTEXT, LANES_MICRO_BATCHES, LANES_SEQ_LEN, synthetic_index
from loomdata.execution import pack_batch, shard_batch
from loomdata.planning import make_plan, plan_report
from loomdata.schemas import SEGMENT_DTYPE, load_spec

RESULTS = Path(__file__).resolve().parent / "results"


def plan_cp(cp: int, dp: int, steps: int, workdir: Path) -> dict[str, Any]:
    base = load_spec(CONFIGS["bench-long-lanes"], check_paths=False)
    training = base.training.model_copy(
        update={"dp_size": dp, "steps": steps, "seq_len": LANES_SEQ_LEN, "micro_batches": LANES_MICRO_BATCHES}
    )
    mixture = base.mixture
    if mixture.schedule is not None:
        ms = [m.model_copy(update={"step": m.step * steps // base.training.steps}) for m in mixture.schedule]
        mixture = mixture.model_copy(update={"schedule": ms})
    lc = LANES_LONG_CONTEXT.model_copy(update={"cp_size": cp})
    spec = base.model_copy(
        update={"training": training, "mixture": mixture, "long_context": lc, "workdir": workdir / f"cp{cp}"}
    )
    index = synthetic_index(spec, seed=0)
    res = make_plan(spec, index=index, fingerprints={n: f"synthetic-{n}" for n in index})
    t0 = time.perf_counter()
    rep = plan_report(res.plan_dir)
    return {"cp": cp, "dp": dp, "steps": steps, "report_seconds": time.perf_counter() - t0, **rep["context_parallel"]}


def shard_cost(cp: int, seq_len: int = 32768, repeats: int = 50) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    lengths = [9000, 12000, 6000, 5768]
    seg = np.zeros(len(lengths), dtype=SEGMENT_DTYPE)
    seg["length"] = lengths
    whole = pack_batch(
        step=0,
        dp_rank=0,
        micro_batch=0,
        lane=1,
        seq_len=seq_len,
        segments=seg,
        tokens=rng.integers(1, 50_000, sum(lengths), dtype=np.int32),
        pad_token_id=0,
    )
    t0 = time.perf_counter()
    for _ in range(repeats):
        shards = [shard_batch(whole, i, cp) for i in range(cp)]
    secs = (time.perf_counter() - t0) / repeats / cp
    return {
        "cp": cp,
        "shard_us": secs * 1e6,
        "whole_bytes": len(pickle.dumps(whole, protocol=5)),
        "shard_bytes": len(pickle.dumps(shards[0], protocol=5)),
    }


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        plans = [plan_cp(cp, args.dp, args.steps, Path(d)) for cp in args.cp]
    shards = [shard_cost(cp) for cp in args.cp]
    print(
        f"{'cp':>3} {'seqs':>5} {'max/mean mean':>14} {'p99':>6} {'max':>6} {'time ratio':>10} "
        f"{'shard us':>9} {'bytes whole':>12} {'bytes shard':>12}"
    )
    for p, s in zip(plans, shards, strict=True):
        im = p["imbalance"]
        print(
            f"{p['cp']:>3} {p['sequences']:>5} {im['mean']:>14.3f} {im['p99']:>6.3f} {im['max']:>6.3f} "
            f"{p['time_ratio']:>10.3f} {s['shard_us']:>9.1f} {s['whole_bytes']:>12} {s['shard_bytes']:>12}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cp_balance.json").write_text(json.dumps({"plans": plans, "sharding": shards}, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
