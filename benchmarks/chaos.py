"""Chaos: N random worker kills plus one `loom serve` restart while 4 ranks stream; nothing lost or repeated.

Generates the tiny demo corpus, indexes and plans it (dp 4) on an embedded TLS cluster, runs
`loom serve` in a process group of its own, and starts 4 rank processes, each a StreamClient that
records every batch's segments and arrival time. Meanwhile it SIGKILLs `--kills` random worker
processes of the serve (nannies restart them; the executor recreates the lost actors) and, half-way,
SIGKILLs the whole serve and starts a new one (new port, new certificates: the ranks re-read
serve.json). Prints kills survived, segments lost and duplicated against the manifest, and the
longest stall per rank; writes benchmarks/results/chaos.json.

    .venv/bin/python benchmarks/chaos.py               # about 1-2 minutes
    .venv/bin/python benchmarks/chaos.py --kills 5 --steps 40
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from loomdata.testing._processes import is_resource_tracker, kill_session

COLS = ("source", "sample", "offset", "length")
RANKS = 4


def _rank(plan_dir: str, rank: int, out: Any) -> None:
    """One rank: stream the whole plan, sending segments and the longest wait between batches."""
    from loomdata.client import StreamClient

    segments: list[tuple[int, ...]] = []
    longest, last = 0.0, time.monotonic()
    error = None
    try:
        with StreamClient(plan_dir, rank, retry_s=120) as s:
            for b in s:
                now = time.monotonic()
                longest, last = max(longest, now - last), now
                segments.extend(zip(*(b.segments[c].tolist() for c in COLS), strict=True))
    except Exception as e:  # reported, counted as a failed rank
        error = f"{type(e).__name__}: {e}"
    out.put({"rank": rank, "segments": segments, "longest_stall_s": longest, "error": error})


def _serve(plan_dir: Path, log: Any) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "loomdata.cli", "serve", str(plan_dir), "--json", "--no-autoscale", "--workers", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    assert proc.stdout is not None
    if not proc.stdout.readline():
        raise SystemExit(f"loom serve exited {proc.wait()}; see {log.name}")
    return proc


def _workers(serve: subprocess.Popen[str]) -> list[psutil.Process]:
    """The serve's Dask worker processes (children of its nannies' process), not resource trackers."""
    kids = psutil.Process(serve.pid).children(recursive=True)
    return [k for k in kids if not is_resource_tracker(k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "chaos.json"))
    args = ap.parse_args()

    from loomdata.execution import open_cluster
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan
    from loomdata.schemas import load_spec, read_manifest, read_plan
    from loomdata.testing import generate_corpus

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="loom-chaos-"))
    repo = Path(__file__).resolve().parents[1]
    generate_corpus(root / "demo-work" / "data", "tiny", seed=0)
    shutil.copytree(repo / "configs", root / "configs")  # the demo spec's paths are relative to it
    spec = load_spec(root / "configs" / "demo.yaml")
    spec = spec.model_copy(
        update={"training": spec.training.model_copy(update={"dp_size": RANKS, "steps": args.steps})}
    )
    t0 = time.perf_counter()
    with open_cluster(n_workers=2, local_directory=root / "dask") as client:
        build_index(spec, client)
    plan_dir = make_plan(spec).plan_dir
    meta = read_plan(plan_dir)
    print(f"planned {meta.steps} steps x {RANKS} ranks in {time.perf_counter() - t0:.1f}s: {plan_dir}", flush=True)

    log = open(root / "serve.log", "a")  # noqa: SIM115 - closed at the end
    serve = _serve(plan_dir, log)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(str(plan_dir), r, out)) for r in range(RANKS)]
    for p in ranks:
        p.start()
    kills = 0
    restart_at = args.kills // 2
    for i in range(args.kills + 1):
        time.sleep(rng.uniform(0.5, 1.5))
        if i == restart_at:
            kill_session(serve)  # the whole group but its resource trackers, which unlink its semaphores
            t = time.perf_counter()
            serve = _serve(plan_dir, log)
            print(f"loom serve killed and restarted ({time.perf_counter() - t:.1f}s to serve again)", flush=True)
            continue
        workers = _workers(serve)
        if workers:
            victim = rng.choice(workers)
            victim.kill()
            kills += 1
            print(f"killed worker process {victim.pid}", flush=True)
    rows = sorted((out.get(timeout=300) for _ in ranks), key=lambda r: r["rank"])
    for p in ranks:
        p.join(timeout=30)
    serve.send_signal(signal.SIGTERM)
    serve.wait(timeout=60)
    log.close()

    lost = duplicated = 0
    report: dict[str, Any] = {"kills": kills, "serve_restarts": 1, "ranks": {}}
    for r in rows:
        man = read_manifest(plan_dir, meta, dp_ranks=[r["rank"]])
        want = Counter(zip(*(man.column(c).to_numpy().astype(int).tolist() for c in COLS), strict=True))
        seen = Counter(tuple(s) for s in r["segments"])
        rank_lost, rank_dup = sum((want - seen).values()), sum((seen - want).values())
        lost, duplicated = lost + rank_lost, duplicated + rank_dup
        report["ranks"][r["rank"]] = {
            "longest_stall_s": round(r["longest_stall_s"], 2),
            "lost": rank_lost,
            "duplicated": rank_dup,
            "error": r["error"],
        }
    survived = all(r["error"] is None for r in rows)
    report.update(kills_survived=kills if survived else 0, segments_lost=lost, segments_duplicated=duplicated)
    print(
        f"kills survived {report['kills_survived']}/{kills} (+1 serve restart); segments lost {lost}, "
        f"duplicated {duplicated}"
    )
    for rank, row in report["ranks"].items():
        print(
            f"  rank {rank}: longest stall {row['longest_stall_s']:.2f}s"
            + (f"  ERROR {row['error']}" if row["error"] else "")
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
