"""Starting an executor over many sources opens few connections from the serving process to the workers.

Routes reach a constructor in one `set_routes` call: a call per source (300 sources) opened as many connections
to the constructor's worker at once, which the client's connection pool and the worker then kept open, idle,
for the whole run (benchmarks/memory.py: 305 connections, memory in both processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.execution._dask_client import live_workers
from loomdata.schemas import parse_spec

N_SOURCES = 12


def _many_sources_plan(tmp: Path, client: Client, loomtest: Any) -> Path:
    names = [f"s{i:02d}" for i in range(N_SOURCES)]
    for i, n in enumerate(names):
        loomtest.write_corpus(tmp / "data", n, n_files=1, rows=24, seed=i, max_len=120)
    spec = parse_spec(
        {
            "name": "many-sources",
            "workdir": str(tmp / "work"),
            "seed": 3,
            "sources": [
                {"name": n, "format": "parquet", "paths": [f"{tmp}/data/{n}/*.parquet"], "tokens_field": "tokens"}
                for n in names
            ],
            "mixture": {"weights": {n: 1.0 / N_SOURCES for n in names}},
            "training": {"seq_len": 256, "steps": 4, "dp_size": 1, "micro_batches": 1},
        },
        tmp,
    )
    return Path(loomtest.index_and_plan(spec, client))


def _connections(client: Client) -> dict[str, int]:
    """This process's established TCP connections to each worker's listening port (client and scheduler alike)."""
    import psutil

    ports = {int(a.rsplit(":", 1)[1]): a for a in live_workers(client)}
    out = dict.fromkeys(ports.values(), 0)
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port in ports:
            out[ports[c.raddr.port]] += 1
    return out


def test_routes_reach_a_constructor_in_one_call(dask_client: Client, tmp_path: Path, loomtest: Any) -> None:
    plan = _many_sources_plan(tmp_path, dask_client, loomtest)
    oracle = loomtest.Oracle(plan)
    before = _connections(dask_client)
    with Executor(plan, dask_client, bytes_in_flight=0) as ex:
        opened = {a: n - before.get(a, 0) for a, n in _connections(dask_client).items()}
        assert ex.info is not None and len(ex.info.loaders) == N_SOURCES
        with StreamClient(plan, 0) as stream:
            got = list(stream)
    # the constructor's worker: creation, start, one set_routes call, the gateway; never one per source
    assert max(opened.values()) < N_SOURCES // 2, opened
    assert len(got) == oracle.meta.steps * oracle.meta.micro_batches
    for b in got:
        oracle.check(b)
