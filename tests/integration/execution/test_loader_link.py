"""The loader link: constructors read loaders on other workers of their host over a Unix socket, not Dask calls.

On the shared LocalCluster (2 worker processes) reads that cross workers go over the link and every batch
still matches an independent read; in one process, a real link answers what the loader answers, refuses
what it must (a key that is not a live loader, a folder open to others), carries a retired loader's
`LoaderRetired`, and fails reads in flight when it breaks.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.execution import _loader_link as link_mod
from loomdata.execution._loader import REQUEST_DTYPE, LoaderRetired, SourceLoader
from loomdata.execution._loader_link import Link, LinkEndpoint, LinkRefused, NotServed, _connect, _Server, link_for
from loomdata.execution._outcome import Kind, sort_read_failure
from loomdata.execution._partition import partition_source
from loomdata.schemas import IndexFiles, Spec, read_plan


def _worker_stats(client: Client) -> dict[str, dict[str, int]]:
    return client.run(link_mod.stats)  # type: ignore[no-any-return]


def test_cross_worker_reads_go_over_the_link(dask_client: Client, stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)
    before = _worker_stats(dask_client)
    with Executor(stream_plan, dask_client, constructors=2, loaders_per_source=2):
        total = 0
        for r in range(oracle.meta.dp_size):
            with StreamClient(stream_plan, r) as stream:
                got = list(stream)
            assert len(got) == oracle.meta.steps * oracle.meta.micro_batches
            total += sum(oracle.check(b) for b in got)
    after = _worker_stats(dask_client)
    delta = {k: sum(after[w][k] - before[w][k] for w in after) for k in ("served", "read", "not_served", "no_link")}
    assert total > 0
    assert delta["read"] > 0, f"no read crossed workers over the link: {delta}"
    assert delta["served"] == delta["read"] and delta["not_served"] == 0 and delta["no_link"] == 0, delta


def _loaders(plan_dir: Path, cls: type[SourceLoader] = SourceLoader) -> list[SourceLoader]:
    meta = read_plan(plan_dir)
    spec = Spec.model_validate(meta.spec)
    name = meta.sources[0]
    shards = pq.read_table(str(IndexFiles.of(spec.workdir, name).samples), columns=["shard"]).column(0).to_numpy()
    return [cls(str(plan_dir), p) for p in partition_source(0, name, shards, 1)]


def _request(loader: SourceLoader, n: int) -> np.ndarray:
    first = int(loader.partition.first_sample)
    req = np.zeros(n, dtype=REQUEST_DTYPE)
    req["sample"] = np.arange(first, first + n, dtype=np.uint64)
    req["length"] = 3
    return req


async def _link_to(held: dict[str, Any]) -> tuple[_Server, Link]:
    server = _Server(held.get)
    endpoint = await server.open()
    assert endpoint is not None
    assert (os.stat(Path(endpoint.path).parent).st_mode & 0o777) == 0o700
    return server, await _connect(endpoint.path, "tls://worker-a:1")


def test_a_link_answers_what_the_loader_answers(stream_plan: Path) -> None:
    (loader,) = _loaders(stream_plan)
    req = _request(loader, 5)
    want = loader.read_now(req)

    async def run() -> tuple[Any, list[Any], BaseException | None]:
        server, link = await _link_to({"loader-a": loader})
        assert server.endpoint is not None
        got = await link.read("loader-a", req)
        many = await asyncio.gather(*(link.read("loader-a", req[: k + 1]) for k in range(5)))  # in flight together
        with pytest.raises(NotServed):
            await link.read("loader-gone", req)  # a released actor: the caller reads through Dask
        await loader.close()
        try:
            await link.read("loader-a", req)
            retired = None
        except LoaderRetired as e:
            retired = e
        link.close()
        server.close()
        return got, many, retired

    got, many, retired = asyncio.run(run())
    assert got.tokens.dtype == want.tokens.dtype and got.tokens.tolist() == want.tokens.tolist()
    assert len(got.tokens) == 15
    assert [len(m.tokens) for m in many] == [3, 6, 9, 12, 15]
    assert many[2].tokens.tolist() == want.tokens[:9].tolist()
    assert isinstance(retired, LoaderRetired) and sort_read_failure(retired) is Kind.REFUSED


def test_a_broken_link_fails_reads_in_flight_as_lost(stream_plan: Path) -> None:
    """A worker that dies under a read: the read fails with ConnectionError, which `_reads` retries."""

    async def run() -> tuple[BaseException, bool, int]:
        (loader,) = _loaders(stream_plan, _Hanging)
        assert isinstance(loader, _Hanging)
        server, link = await _link_to({"k": loader})
        pending = asyncio.ensure_future(link.read("k", _request(loader, 2)))
        while not loader.waiting:
            await asyncio.sleep(0.01)
        server.close()  # as the worker's death would
        with pytest.raises(ConnectionError) as caught:
            await asyncio.wait_for(pending, 5)
        loader.gate.set()
        return caught.value, link.closed, len(link._pending)

    error, closed, pending = asyncio.run(run())
    assert closed and pending == 0 and sort_read_failure(error) is Kind.LOST


class _Hanging(SourceLoader):
    """A loader whose reads wait until told to go on."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gate, self.waiting = asyncio.Event(), False

    async def read(self, request: np.ndarray) -> Any:
        self.waiting = True
        await self.gate.wait()


def test_a_link_folder_open_to_others_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)

    async def run() -> None:
        await _connect(str(folder / "loader.sock"), "tls://worker-b:1")

    with pytest.raises(LinkRefused, match="closed to others"):
        asyncio.run(run())


class _ElsewhereLoader:
    """A loader handle whose worker's link is on another host (another `host_id`)."""

    _address = "tls://10.0.0.9:4000"
    key = "loader-x"

    def __init__(self) -> None:
        self.asked = 0

    async def link_endpoint(self) -> LinkEndpoint:
        self.asked += 1
        return LinkEndpoint("/nonexistent/loader.sock", "another-host/boot")


def test_a_loader_on_another_host_is_read_through_dask() -> None:
    async def run() -> tuple[Any, Any, int]:
        loader = _ElsewhereLoader()
        first = link_for(loader)
        assert isinstance(first, asyncio.Future)
        opened = await first
        return opened, link_for(loader), loader.asked  # decided once: no second endpoint call

    opened, again, asked = asyncio.run(run())
    assert opened is None and again is None and asked == 1


def test_a_garbage_frame_drops_only_that_connection(stream_plan: Path) -> None:
    (loader,) = _loaders(stream_plan)
    req = _request(loader, 2)

    async def run() -> tuple[bytes, int]:
        server, link = await _link_to({"k": loader})
        assert server.endpoint is not None
        reader, writer = await asyncio.open_unix_connection(server.endpoint.path)
        writer.write(b"GET / HTTP/1.0\r\n\r\n" * 4)
        dropped = await asyncio.wait_for(reader.read(), 5)  # closed by the server: EOF
        answer = await link.read("k", req)  # the other connection still served
        link.close()
        server.close()
        return dropped, len(answer.tokens)

    dropped, n = asyncio.run(run())
    assert dropped == b"" and n == 6
