"""The loader link: constructors read loaders on other workers of their host over a Unix socket, not Dask calls.

On the shared LocalCluster (2 worker processes) reads that cross workers go over the link and every batch
still matches an independent read; in one process, a real link answers what the loader answers, refuses
what it must (a key that is not a live loader, a folder open to others, a peer of another uid on either end),
carries a retired loader's `LoaderRetired`, fails only the read whose answer does not unpickle, falls back to Dask
for a key it does not serve, and fails reads in flight when it breaks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import distributed
import numpy as np
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.execution import _loader_link as link_mod
from loomdata.execution._loader import REQUEST_DTYPE, LoaderRetired, SourceLoader
from loomdata.execution._loader_link import (
    Link,
    LinkEndpoint,
    LinkRefused,
    NotServed,
    _connect,
    _Server,
    close_links,
    link_for,
)
from loomdata.execution._outcome import Kind, sort_read_failure
from loomdata.execution._partition import partition_source
from loomdata.execution._reads import _call_read
from loomdata.execution._wire import HEADER, MAGIC, REQUEST, lengths_format
from loomdata.execution.protocol import host_id
from loomdata.schemas import IndexFiles, Spec, read_plan
from loomdata.schemas.errors import ExecutionError


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
        await _until(lambda: loader.waiting)
        server.close()  # as the worker's death would
        with pytest.raises(ConnectionError) as caught:
            await asyncio.wait_for(pending, 5)
        loader.gate.set()
        return caught.value, link.closed, len(link._pending)

    error, closed, pending = asyncio.run(run())
    assert closed and pending == 0 and sort_read_failure(error) is Kind.LOST


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until `cond()` holds; a regression fails with TimeoutError instead of hanging the test."""

    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


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


def _request_frame(key: str | bytes, rows: np.ndarray, request_id: int = 1) -> bytes:
    """A raw link request frame (header, lengths, JSON body, rows)."""
    body = key if isinstance(key, bytes) else json.dumps({"key": key}).encode()
    data = rows.tobytes()
    return HEADER.pack(MAGIC, REQUEST, request_id, 1) + lengths_format(1).pack(len(body), len(data)) + body + data


def test_a_deeply_nested_request_drops_only_that_connection(
    stream_plan: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """JSON nested past the recursion limit: that connection is dropped (logged at info), no fatal asyncio error."""
    (loader,) = _loaders(stream_plan)
    req = _request(loader, 2)

    async def run() -> tuple[bytes, int, list[dict[str, Any]]]:
        errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        server, link = await _link_to({"k": loader})
        assert server.endpoint is not None
        reader, writer = await asyncio.open_unix_connection(server.endpoint.path)
        writer.write(_request_frame(b"[" * 200_000, req))
        dropped = await asyncio.wait_for(reader.read(), 5)
        answer = await asyncio.wait_for(link.read("k", req), 5)  # the other connection still served
        writer.close()
        link.close()
        server.close()
        return dropped, len(answer.tokens), errors

    with caplog.at_level(logging.INFO, logger=link_mod.__name__):
        dropped, n, errors = asyncio.run(run())
    assert dropped == b"" and n == 6
    assert errors == [], errors
    assert any("RecursionError" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


class _TwoArgError(Exception):
    """An exception that pickles but does not unpickle (its __init__ takes two arguments, its args hold one)."""

    def __init__(self, what: str, where: str) -> None:
        super().__init__(f"{what} at {where}")


class _Failing(SourceLoader):
    async def read(self, request: np.ndarray) -> Any:
        raise _TwoArgError("broken", "here")


def test_an_undecodable_answer_fails_that_read_and_keeps_the_link(stream_plan: Path) -> None:
    (loader,) = _loaders(stream_plan)
    (failing,) = _loaders(stream_plan, _Failing)
    req = _request(loader, 2)

    async def run() -> tuple[BaseException, int, bool]:
        server, link = await _link_to({"k": loader, "bad": failing})
        with pytest.raises(ExecutionError) as caught:
            await asyncio.wait_for(link.read("bad", req), 5)  # hung forever before: its future was dropped
        answer = await asyncio.wait_for(link.read("k", req), 5)
        closed = link.closed
        link.close()
        server.close()
        return caught.value, len(answer.tokens), closed

    error, n, closed = asyncio.run(run())
    assert "undecodable answer from tls://worker-a:1" in str(error) and "TypeError" in str(error)
    assert isinstance(error, Exception) and sort_read_failure(error) is Kind.ERROR  # the step fails, naming it
    assert n == 6 and not closed


def test_the_server_refuses_a_peer_of_another_uid(stream_plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (loader,) = _loaders(stream_plan)
    req = _request(loader, 2)

    async def run() -> tuple[bytes, int]:
        server = _Server({"k": loader}.get)
        endpoint = await server.open()
        assert endpoint is not None
        served = link_mod.stats()["served"]
        monkeypatch.setattr(link_mod, "peer_uid", lambda sock: os.getuid() + 1)
        reader, writer = await asyncio.open_unix_connection(endpoint.path)
        writer.write(_request_frame("k", req))  # a valid request: answered were the peer of this uid
        try:
            got = await asyncio.wait_for(reader.read(), 5)  # dropped: EOF ...
        except ConnectionResetError:  # ... or reset (aborted with the request unread)
            got = b""
        writer.close()
        server.close()
        return got, link_mod.stats()["served"] - served

    got, served = asyncio.run(run())
    assert got == b"" and served == 0


class _StandIn:
    """A loader actor handle on another worker of this host: its link endpoint given, its Dask reads recorded."""

    def __init__(self, endpoint: LinkEndpoint | None, key: str, address: str = "tls://worker-c:1") -> None:
        self._address, self.key, self.endpoint = address, key, endpoint
        self.asked = 0
        self.reads: list[np.ndarray] = []

    async def link_endpoint(self) -> LinkEndpoint | None:
        self.asked += 1
        return self.endpoint

    async def read(self, request: np.ndarray) -> str:
        self.reads.append(request)
        return "through dask"


def test_the_constructor_refuses_a_server_of_another_uid(stream_plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (loader,) = _loaders(stream_plan)

    async def run() -> tuple[BaseException, Any, Any, int]:
        server = _Server({"k": loader}.get)
        endpoint = await server.open()
        assert endpoint is not None
        monkeypatch.setattr(link_mod, "peer_uid", lambda sock: os.getuid() + 1)
        with pytest.raises(LinkRefused) as caught:
            await _connect(endpoint.path, "tls://worker-a:1")
        stand_in = _StandIn(LinkEndpoint(endpoint.path, host_id()), "k")
        first = link_for(stand_in)
        assert isinstance(first, asyncio.Future)
        opened = await first
        again = link_for(stand_in)  # refused for good: not asked again
        close_links()
        server.close()
        return caught.value, opened, again, stand_in.asked

    error, opened, again, asked = asyncio.run(run())
    assert f"served by uid {os.getuid() + 1}" in str(error)
    assert opened is None and again is None and asked == 1


def test_a_key_the_link_does_not_serve_is_read_through_dask(stream_plan: Path) -> None:
    (loader,) = _loaders(stream_plan)
    req = _request(loader, 3)

    async def run() -> tuple[Any, _StandIn, int, int]:
        server = _Server({"k": loader}.get)
        endpoint = await server.open()
        assert endpoint is not None
        before = link_mod.stats()
        stand_in = _StandIn(LinkEndpoint(endpoint.path, host_id()), "released")  # a key the worker no longer holds
        answer = await asyncio.wait_for(_call_read(stand_in, req), 5)
        after = link_mod.stats()
        close_links()
        server.close()
        return answer, stand_in, after["not_served"] - before["not_served"], after["read"] - before["read"]

    answer, stand_in, not_served, read = asyncio.run(run())
    assert not_served == 1 and read == 1  # asked over the link first
    assert answer == "through dask" and len(stand_in.reads) == 1
    assert stand_in.reads[0].tolist() == req.tolist()


def test_a_loader_on_the_own_worker_gets_no_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A released loader of the constructor's own worker (no local instance): read through Dask, not a link to
    itself."""
    monkeypatch.setattr(distributed, "get_worker", lambda: SimpleNamespace(address="tls://me:1"))

    async def run() -> tuple[Any, Any, int, int]:
        own, other = _StandIn(None, "own", "tls://me:1"), _StandIn(None, "other", "tls://them:1")
        mine = link_for(own)
        theirs = link_for(other)
        assert isinstance(theirs, asyncio.Future)  # another worker: a link is tried
        opened = await theirs
        close_links()
        return mine, opened, own.asked, other.asked

    mine, opened, own_asked, other_asked = asyncio.run(run())
    assert mine is None and own_asked == 0
    assert opened is None and other_asked == 1
