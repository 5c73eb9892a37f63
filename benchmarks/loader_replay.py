"""Source Loaders alone, two source trees side by side: replay a plan's reads in one process, no cluster.

`stream_throughput.py` measures the loader path among a scheduler, two workers, a constructor and the
ranks, in runs of a second or less on a shared 2-core machine: a 20% change in its loader time is
noise there. This script takes the loaders out: it writes stream_throughput's two sources (or
`--sources N` of memory.py's shape), indexes and plans them once with this checkout, then each tree
(`--ab SRC` vs this checkout, alternating subprocesses with PYTHONPATH set) builds one `SourceLoader`
per source with serving's cache policy (`ServeConfig` defaults: budget, window, read-ahead) and calls
`read_now` for every step group of the plan in order, as a constructor does (one request per source
and group of `--group` steps). Reported per run: process CPU seconds (all threads: the read-ahead's
too), wall seconds, row groups decoded and the tokens in them (over the tokens read: the read
amplification), tokens and one CRC over them (both trees must agree), the anonymous memory once
every loader has warmed up and at the end (Arrow on jemalloc, as in the workers), and the thread CPU seconds
of the loaders' bookkeeping (`bookkeeping_cpu_s`: counting served reads off, counting planned chunks in).
`--plan-window` serves with the window the Executor widens to for the plan (512 steps at 4096 tokens a
step: a plan reach of about 2,000 steps, what the delivery benchmark's loaders hold), not `ServeConfig`'s 2.
`--shuffle block` plans stream_throughput's sources with its block shuffle instead of the global one.

    .venv/bin/python benchmarks/loader_replay.py --ab ../main/src --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
RESULTS = HERE / "results" / "loader_replay.json"


def _prepare(root: Path, args: argparse.Namespace) -> Path:
    """Data, index and plan (this checkout), as stream_throughput.py or memory.py writes them."""
    sys.path.insert(0, str(HERE))
    from loomdata.execution import open_cluster
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan

    if args.sources:
        import memory

        memory.write_data(root, args.sources, 4, 2000, 200.0, seed=args.sources)
        spec = memory.make_spec(root, args.sources, args.ranks, args.steps, args.seq_len)
    else:
        import stream_throughput as st

        st._write_data(root, args.docs, seed=0)
        spec = st._spec(root, args.seq_len, args.steps, args.micro_batches, shuffle=args.shuffle)
    with open_cluster(n_workers=2, local_directory=root / "dask") as client:
        build_index(spec, client)
    return Path(make_plan(spec).plan_dir)


def _child(plan_dir: Path, group: int, plan_window: bool = False) -> dict[str, Any]:
    """One replay with the loomdata on sys.path: every source's loader reads every step group in order.

    `plan_window`: the cache policy of the window the Executor serves the plan with (`ServeConfig.for_plan`: 512
    steps at 4096 tokens a step), not `ServeConfig`'s own (2 steps): the loaders' plan reach and what they hold."""
    import numpy as np

    from loomdata.execution._config import ServeConfig
    from loomdata.execution._loader import REQUEST_DTYPE, SourceLoader
    from loomdata.execution._loader_cache import CachePolicy
    from loomdata.execution._partition import partition_source
    from loomdata.schemas import read_manifest, read_plan
    from loomdata.schemas.layout import IndexFiles
    from loomdata.sources import parquet

    decodes = [0, 0]  # row groups decoded, tokens in them
    original = parquet.ParquetReader._decode_row_group

    def counted(self: Any, *a: Any) -> Any:
        arr = original(self, *a)
        decodes[0] += 1
        decodes[1] += len(arr.values)
        return arr

    parquet.ParquetReader._decode_row_group = counted  # type: ignore[method-assign]
    book = _time_bookkeeping()
    meta = read_plan(plan_dir)
    table = read_manifest(plan_dir, meta, columns=["step", "source", "sample", "offset", "length"])
    cols = {k: table.column(k).to_numpy() for k in ("step", "source", "sample", "offset", "length")}
    config = ServeConfig()
    if plan_window:
        config = config.for_plan(meta.seq_len, meta.micro_batches, meta.dp_size, long_seq_len=meta.long_seq_len)
    policy = CachePolicy.serving(config)
    t_open = time.perf_counter()
    loaders = {}
    for sid, src in enumerate(meta.sources):
        shards = IndexFiles.of(meta.spec.workdir, src).sample_shards().column(0).to_numpy()
        (part,) = partition_source(sid, src, shards, 1)
        loaders[sid] = SourceLoader(str(plan_dir), part, policy)
    for lo in loaders.values():
        if lo._warm is not None:
            lo._warm.result()
    open_s = time.perf_counter() - t_open
    warm_anon = _anonymous_mib()
    cpu0, t0 = time.process_time(), time.perf_counter()
    crc, tokens = 0, 0
    order = np.lexsort((cols["source"], cols["step"]))
    step, source = cols["step"][order], cols["source"][order]
    bounds = np.searchsorted(step, np.arange(0, meta.steps + group, group))
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        idx = order[a:b]
        for sid in np.unique(source[a:b]).tolist():
            sel = idx[source[a:b] == sid]
            req = np.empty(len(sel), dtype=REQUEST_DTYPE)
            for k in ("sample", "offset", "length", "step"):
                req[k] = cols[k][sel]
            out = loaders[sid].read_now(req)
            crc = zlib.crc32(out.tokens.tobytes(), crc)
            tokens += len(out.tokens)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    counts: dict[str, int] = {}
    for lo in loaders.values():
        for k, v in lo._prefetch_counts().items():
            counts[k] = counts.get(k, 0) + v
    anon = _anonymous_mib()
    own = [lo._decode_counts() for lo in loaders.values() if hasattr(lo, "_decode_counts")]  # LoaderMetrics' (s30)
    return {
        "metrics_tokens_decoded": sum(d["tokens_decoded"] for d in own) if own else None,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "open_s": round(open_s, 3),
        "decodes": decodes[0],
        "decoded_tokens": decodes[1],
        "tokens": tokens,
        "read_amplification": round(decodes[1] / tokens, 2) if tokens else None,
        "crc": crc,
        "tokens_per_cpu_s": round(tokens / cpu) if cpu > 0 else None,
        "anonymous_mib": anon,
        "warm_anonymous_mib": warm_anon,
        "prefetch": counts,
        "bookkeeping_cpu_s": {k: round(v, 3) for k, v in book.items()},
    }


def _time_bookkeeping() -> dict[str, float]:
    """Thread CPU seconds spent in the loaders' bookkeeping, filled in as the replay runs: counting served reads off
    (`PlanAhead.served`, on the read path) and counting a chunk's planned reads (`PlanAhead._plan_chunk`, the
    plan-ahead's). Both methods exist in every tree compared; a call inside another of the same is not counted twice."""
    from loomdata.execution._plan_ahead import PlanAhead

    spent = {"served": 0.0, "plan_chunk": 0.0}
    for label, name in (("served", "served"), ("plan_chunk", "_plan_chunk")):
        original = getattr(PlanAhead, name)

        def timed(self: Any, *a: Any, _f: Any = original, _label: str = label) -> Any:
            t0 = time.thread_time()
            try:
                return _f(self, *a)
            finally:
                spent[_label] += time.thread_time() - t0

        setattr(PlanAhead, name, timed)
    return spent


def _anonymous_mib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) // 1024
    return 0


def _run(src: Path, plan_dir: Path, group: int, plan_window: bool = False) -> dict[str, Any]:
    # Arrow's allocator as in the embedded cluster's workers (`_cluster.worker_env`)
    env = {"ARROW_DEFAULT_MEMORY_POOL": "jemalloc", **os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, "--child", str(plan_dir), "--group", str(group)]
    cmd += ["--plan-window"] if plan_window else []
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ab", type=Path, required=False, help="the other tree's src folder (before)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4], help="steps per request")
    ap.add_argument("--docs", type=int, default=16000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--sources", type=int, default=0, help="N sources of memory.py's shape instead (0: stream's two)")
    ap.add_argument("--ranks", type=int, default=16, help="with --sources: dp ranks of the plan")
    ap.add_argument(
        "--shuffle", choices=["global", "block"], default="global", help="stream's two sources' shuffle (see --sources)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--data", type=Path, default=None, help="keep data, index and plan in this folder (reused)")
    ap.add_argument(
        "--plan-window",
        action="store_true",
        help="serve with the window the Executor widens to for the plan (ServeConfig.for_plan), not ServeConfig's own",
    )
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--group", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args.child, args.group, args.plan_window)))
        return
    trees = {"after": SRC} if args.ab is None else {"before": args.ab.resolve(), "after": SRC}
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = str(args.data) if args.data else stack.enter_context(tempfile.TemporaryDirectory(prefix="loom-replay-"))
        plan_dir = _prepare(Path(tmp), args)
        for r in range(args.rounds):
            for group in args.groups:
                for name, src in trees.items() if r % 2 == 0 else reversed(trees.items()):
                    load = _load()
                    got = _run(src, plan_dir, group, args.plan_window)
                    runs.append({"round": r, "group": group, "tree": name, "load": load, **got})
                    print(json.dumps(runs[-1]), flush=True)
    summary = []
    for group in args.groups:
        row: dict[str, Any] = {"group": group}
        for name in trees:
            mine = [x for x in runs if x["group"] == group and x["tree"] == name]
            cpu = sorted(x["cpu_s"] for x in mine)
            row[name] = {"cpu_s_median": cpu[len(cpu) // 2], "cpu_s_min": cpu[0], "decodes": mine[0]["decodes"]}
            for part in ("served", "plan_chunk"):  # the bookkeeping's thread CPU (absent in older results)
                got = sorted(x.get("bookkeeping_cpu_s", {}).get(part, 0.0) for x in mine)
                row[name][f"{part}_cpu_s_range"] = [got[0], got[-1]]
            row[name]["crc"] = sorted({x["crc"] for x in mine})
        if "before" in trees:
            row["cpu_after_over_before_median"] = round(row["after"]["cpu_s_median"] / row["before"]["cpu_s_median"], 3)
            row["same_tokens"] = row["after"]["crc"] == row["before"]["crc"]
        summary.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "loader_replay",
                "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "child"},
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
