"""CPU per cross-worker loader read: a Dask actor call against the same-host loader link (`execution/_loader_link`).

A caller actor on worker 0 reads a real SourceLoader on worker 1 (`loom serve`'s embedded cluster: TLS, 2 worker
processes) `--reads` times, `--concurrency` reads in flight at once, through Dask or over the link, alternating
modes `--rounds` times. Each worker's process CPU (getrusage) is taken around each run: CPU per read on the caller's
worker and on the loader's, the loader's own read included (the same in both modes: `read_now` alone is
measured too, in the loader's worker, as `loader_own_ms`).

    .venv/bin/python benchmarks/loader_link.py --out benchmarks/results/loader_link_s21.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Caller:
    """Reads a loader on another worker, as a constructor does (`_reads._call_read`)."""

    async def run(self, loader: Any, request: Any, n: int, concurrency: int, mode: str) -> float:
        from loomdata.execution import _loader_link, _reads
        from loomdata.execution._dask_actors import detach

        _loader_link.ENABLED = mode == "link"
        detach([loader])
        t0 = time.perf_counter()
        for _ in range(n // concurrency):
            answers = await asyncio.gather(*(_reads._call_read(loader, request) for _ in range(concurrency)))
            assert len(answers[0].tokens) == int(request["length"].sum())
        return time.perf_counter() - t0


def _own(key: str, request: Any, n: int, dask_worker: Any = None) -> float:
    """CPU ms of the loader's own `read_now`, in its worker."""
    loader = dask_worker.state.actors[key]
    t0 = time.process_time()
    for _ in range(n):
        loader.read_now(request)
    return (time.process_time() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reads", type=int, default=400)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--tile", type=int, default=1, help="repeat the request's rows this often (1: ~4K tokens; 12: ~50K, a window's)"
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "loader_link_s21.json")
    args = ap.parse_args()

    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from loomdata.execution import open_cluster
    from loomdata.execution._loader import REQUEST_DTYPE
    from loomdata.execution._loader_link import LinkedLoader
    from loomdata.execution._partition import partition_source
    from loomdata.schemas import IndexFiles, read_plan
    from loomdata.schemas.plan_view import read_manifest
    from loomtest.stream import index_and_plan, make_spec

    with (
        tempfile.TemporaryDirectory(prefix="loom-bench-link-") as tmp,
        open_cluster(n_workers=2, local_directory=Path(tmp) / "dask") as client,
    ):
        spec = make_spec(Path(tmp) / "plan", steps=8, dp_size=1, micro_batches=4, seq_len=1024)
        plan_dir = index_and_plan(spec, client)
        meta = read_plan(plan_dir)
        shards = pq.read_table(str(IndexFiles.of(spec.workdir, "web").samples), columns=["shard"]).column(0).to_numpy()
        (part,) = partition_source(meta.sources.index("web"), "web", shards, 1)
        rows = read_manifest(plan_dir, meta, 0, 1)  # two steps of the source's segments: one constructor request
        rows = rows.filter(pc.equal(rows.column("source"), part.source_id))
        req = np.zeros(rows.num_rows, dtype=REQUEST_DTYPE)
        for name in ("sample", "offset", "length", "step"):
            req[name] = rows.column(name).to_numpy()
        req = np.tile(req, args.tile)
        w0, w1 = sorted(client.scheduler_info()["workers"])
        loader = client.submit(LinkedLoader, str(plan_dir), part, actor=True, workers=[w1]).result()
        caller = client.submit(Caller, actor=True, workers=[w0]).result()
        caller.run(loader, req, 20, 1, "link").result()  # open the link, warm both
        caller.run(loader, req, 20, 1, "dask").result()
        own = client.run(_own, loader.key, req, 200, workers=[w1])[w1]
        runs: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            for conc in args.concurrency:
                for mode in ("dask", "link") if rnd % 2 == 0 else ("link", "dask"):
                    before = client.run(_cpu)
                    wall = caller.run(loader, req, args.reads, conc, mode).result()
                    after = client.run(_cpu)
                    n = args.reads // conc * conc
                    row = {
                        "round": rnd,
                        "mode": mode,
                        "concurrency": conc,
                        "reads": n,
                        "wall_ms_per_read": round(wall / n * 1e3, 4),
                        "caller_cpu_ms_per_read": round((after[w0] - before[w0]) / n * 1e3, 4),
                        "loader_worker_cpu_ms_per_read": round((after[w1] - before[w1]) / n * 1e3, 4),
                    }
                    row["both_cpu_ms_per_read"] = round(
                        row["caller_cpu_ms_per_read"] + row["loader_worker_cpu_ms_per_read"], 4
                    )
                    runs.append(row)
                    print(json.dumps(row))
    summary: dict[str, Any] = {}
    for conc in args.concurrency:
        for mode in ("dask", "link"):
            both = sorted(r["both_cpu_ms_per_read"] for r in runs if r["mode"] == mode and r["concurrency"] == conc)
            summary[f"{mode}_c{conc}_both_cpu_ms_per_read"] = both
    out = {
        "benchmark": "loader_link",
        "note": (
            f"`{' '.join(sys.argv)}` on {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"load {os.getloadavg()[0]:.1f} at the end; request {len(req)} rows, {int(req['length'].sum())} tokens"
        ),
        "loader_own_ms": round(own, 4),
        "summary": summary,
        "runs": runs,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1), f"\nloader's own read_now: {own:.3f} ms\nwrote {args.out}")


if __name__ == "__main__":
    main()
