"""`loom demo`: the main job end to end on the embedded default (or a given scheduler).

Generates a tiny multi-source corpus, indexes it (Dask job), plans it (global, cost-balanced),
serves it (Source Loader + Data Constructor actors) and runs `ranks` real training processes, each a
`torch.distributed` (gloo) rank taking DistributedDataParallel steps of a tiny model on its batches.
Like cli.py, this module wires stages together; nothing else does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_demo"]

_BUCKETS = 512  # the tiny model predicts next-token ids modulo this (keeps its output layer small)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank_main(rank: int, world: int, plan_dir: str, port: int, results: Any) -> None:
    """One training rank: pull batches through LoomDataset, take DDP steps, report figures."""
    import torch
    import torch.distributed as dist

    from loomdata.schemas import read_plan
    from loomdata.torch import LoomDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    meta = read_plan(plan_dir)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(_BUCKETS, 16), torch.nn.Linear(16, _BUCKETS))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100)

    data = iter(LoomDataset(plan_dir, rank))
    tokens = 0
    wait_s = 0.0
    losses: list[float] = []
    t_start = time.perf_counter()
    for _step in range(meta.steps):
        opt.zero_grad(set_to_none=True)
        for mb in range(meta.micro_batches):
            t0 = time.perf_counter()
            batch = next(data)
            wait_s += time.perf_counter() - t0
            ids = batch["input_ids"].long() % _BUCKETS
            labels = batch["labels"].long()
            labels = torch.where(labels >= 0, labels % _BUCKETS, labels)
            tokens += int(batch["cu_seqlens"][-1])
            sync = mb == meta.micro_batches - 1
            ctx = ddp.no_sync() if not sync else _Null()
            with ctx:
                loss = loss_fn(ddp(ids), labels) / meta.micro_batches
                loss.backward()
            losses.append(loss.item() * meta.micro_batches)
        opt.step()
    elapsed = time.perf_counter() - t_start
    check = torch.tensor([float(tokens)])
    dist.all_reduce(check)  # proves every rank ran to the end
    results.put(
        {
            "rank": rank,
            "tokens": tokens,
            "elapsed_s": elapsed,
            "data_wait_s": wait_s,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "all_ranks_tokens": int(check.item()),
        }
    )
    dist.destroy_process_group()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_demo(
    *,
    spec_path: Path,
    data_dir: Path,
    size: str = "tiny",
    ranks: int = 4,
    scheduler: str | None = None,
    progress: bool = False,
    echo: Callable[[str], None] = print,
    tls: Any = None,
    insecure: bool = False,
    dashboard: bool = False,
) -> dict[str, Any]:
    """Run every stage once and return the figures it printed.

    The embedded cluster uses TLS with credentials made in WORKDIR/.loom-tls (the ranks find them
    through serve.json); `tls` reaches a given `scheduler`; `insecure` is plain TCP (ranks too).
    """
    from loomdata.execution import Executor, ServeConfig, open_cluster
    from loomdata.execution._dask_client import live_workers
    from loomdata.execution._security import TLS_DIR
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan, plan_report
    from loomdata.schemas import load_spec
    from loomdata.testing import generate_corpus

    report: dict[str, Any] = {}
    t0 = time.perf_counter()
    if not (data_dir / ".complete").exists():
        echo(f"[1/5] generating a {size} corpus in {data_dir}")
        generate_corpus(data_dir, size, seed=0)
        (data_dir / ".complete").write_text(size)
    else:
        echo(f"[1/5] corpus already in {data_dir}")
    report["generate_s"] = round(time.perf_counter() - t0, 2)

    spec = load_spec(spec_path)
    if spec.training.dp_size != ranks:
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"dp_size": ranks})})
    scratch = tempfile.mkdtemp(prefix="loom-demo-")
    config = ServeConfig()  # the demo serves with the defaults: fixed loaders, recovery on
    if insecure:
        os.environ["LOOM_INSECURE"] = "1"  # the spawned ranks accept the plain-TCP scheduler too
    cluster = open_cluster(
        scheduler,
        n_workers=config.n_workers,
        local_directory=scratch,
        tls=tls,
        tls_dir=spec.workdir / TLS_DIR,
        insecure=insecure,
        dashboard=dashboard,
    )
    with cluster as client:
        t = time.perf_counter()
        index = build_index(spec, client, progress=progress).to_dict()
        report["index"] = index
        total = sum(int(s["samples"]) for s in index["sources"].values())
        echo(f"[2/5] indexed {total:,} samples of {len(index['sources'])} sources in {time.perf_counter() - t:.2f}s")

        t = time.perf_counter()
        result = make_plan(spec, progress=progress)
        plan = plan_report(result.plan_dir)
        report["plan"] = plan
        took = time.perf_counter() - t
        echo(f"[3/5] planned {spec.training.steps} steps x {ranks} ranks in {took:.2f}s: {result.plan_dir}")
        imb = plan["imbalance"]
        echo(
            f"       rank cost imbalance (max/lower bound, mean over steps): loomdata "
            f"{imb['loomdata']['mean']:.3f}, baseline {imb['baseline']['mean']:.3f}; "
            f"simulated step-time gain {plan['simulated_gain']:.2f}x; "
            f"worst mixture error {plan['worst_mixture_error_pp']:.2f} pp"
        )

        with Executor(result.plan_dir, client, config, spec=spec) as executor:
            echo(f"[4/5] serving with loaders and constructors on {len(live_workers(client))} workers")
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            port = _free_port()
            env_tmp = os.environ.get("TMPDIR")
            os.environ["TMPDIR"] = scratch
            procs = [
                ctx.Process(target=_rank_main, args=(r, ranks, str(result.plan_dir), port, results))
                for r in range(ranks)
            ]
            t = time.perf_counter()
            for p in procs:
                p.start()
            rank_rows = [results.get(timeout=600) for _ in procs]
            for p in procs:
                p.join(timeout=60)
            if env_tmp is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = env_tmp
            wall = time.perf_counter() - t
            metrics = executor.metrics()
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            from loomdata.schemas import ExecutionError

            raise ExecutionError(f"{len(bad)} training rank(s) failed (exit codes {bad}); see their output above")

    rank_rows.sort(key=lambda r: r["rank"])
    echo(f"[5/5] {ranks} ranks trained {spec.training.steps} steps in {wall:.1f}s")
    echo("       rank    tokens   tokens/s   data wait   first loss   last loss")
    for r in rank_rows:
        echo(
            f"       {r['rank']:>4} {r['tokens']:>9,} {r['tokens'] / r['elapsed_s']:>10,.0f} "
            f"{r['data_wait_s']:>10.2f}s {r['first_loss']:>12.3f} {r['last_loss']:>11.3f}"
        )
    report["ranks"] = rank_rows
    report["executor"] = metrics.to_dict()  # the JSON edge: `loom demo --json`
    report["total_s"] = round(time.perf_counter() - t0, 2)
    echo(
        f"       {len(metrics.loaders)} Source Loader actors hold the file state once: "
        f"{metrics.loader_memory_bytes:,} bytes "
        f"(a loader per rank and DataLoader worker, ranks x 2 workers, would hold {2 * ranks} copies); "
        f"{metrics.loader_calls:,} batched loader calls for {metrics.loader_samples:,} samples; "
        f"worker processes' RSS {metrics.loader_rss_bytes / 2**20:,.0f} MiB"
    )
    echo(f"done in {report['total_s']:.1f}s")
    return report
