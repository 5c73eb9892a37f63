"""Ranks on the gateway's host: its Unix socket instead of TLS, the same batches, and only for this user.

A rank process (no Dask imported) streams a whole plan through the local socket and again with TLS forced
(LOOM_TRANSPORT=tls): the batches are compared array by array. The socket's folder is private (0700, this
user's), the TCP address still speaks only TLS, a serve.json naming a socket of an open folder or another
host is not followed (the rank uses TLS), and a dropped local connection is reconnected without loss.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.client._direct import DirectConstructor, LocalRefused
from loomdata.execution import Executor
from loomdata.execution._wire import HEADER, encode_request
from loomdata.execution.protocol import LocalGateway, host_id, read_serve_info, write_serve_info

_RANK = """
import hashlib, json, sys
from loomdata.client import StreamClient
out, transports = [], set()
with StreamClient(sys.argv[1], int(sys.argv[2])) as s:
    for b in s:
        transports.add(s.transport)
        h = hashlib.sha256()
        for a in (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.segments):
            h.update(a.tobytes())
        out.append([b.step, b.micro_batch, h.hexdigest()])
print(json.dumps({"batches": out, "transports": sorted(transports),
      "dask": any(m.split(".")[0] in ("distributed", "dask", "tornado") for m in sys.modules)}))
"""


def _rank(plan: Path, dp_rank: int, **env: str) -> dict[str, Any]:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env}
    if "LOOM_TRANSPORT" not in env:
        full.pop("LOOM_TRANSPORT", None)
    proc = subprocess.run(
        [sys.executable, "-c", _RANK, str(plan), str(dp_rank)], capture_output=True, text=True, env=full, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return out


def test_a_rank_on_the_host_streams_through_the_socket_exactly_what_tls_gives(
    dask_client: Client, stream_plan: Path
) -> None:
    with Executor(stream_plan, dask_client):
        local = _rank(stream_plan, 1)
        tls = _rank(stream_plan, 1, LOOM_TRANSPORT="tls")
    assert local["transports"] == ["local"] and tls["transports"] == ["tls"]
    assert not local["dask"] and not tls["dask"], "a gateway rank imported Dask"
    assert local["batches"] == tls["batches"] and len(local["batches"]) > 2


def test_the_socket_folder_is_private_and_tcp_still_needs_tls(dask_client: Client, stream_plan: Path) -> None:
    with Executor(stream_plan, dask_client) as ex:
        assert ex.info is not None
        c = ex.info.constructors[0]
        assert c.local is not None and c.gateway is not None and c.local.host_id == host_id()
        folder = Path(c.local.path).parent
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert stat.S_ISSOCK(os.stat(c.local.path).st_mode)
        request = encode_request(1, c.name, "record_telemetry", [c.ranks[0], []], {})
        # the same plain request: answered on the Unix socket, not on the TCP address (it speaks only TLS)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(c.local.path)
            sock.sendall(request)
            assert len(sock.recv(HEADER.size, socket.MSG_WAITALL)) == HEADER.size
        host, _, port = c.gateway.removeprefix("tls://").rpartition(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(request)
            try:
                head = sock.recv(HEADER.size)
            except ConnectionResetError:
                head = b""
        assert head == b"" or not head.startswith(b"LOM1"), "the TCP gateway answered without TLS"


def test_a_socket_in_an_open_folder_or_on_another_host_is_not_used(
    dask_client: Client, stream_plan: Path, tmp_path: Path
) -> None:
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    open_folder.chmod(0o755)
    with Executor(stream_plan, dask_client):
        info = read_serve_info(stream_plan)
        mine = info.constructor_for(0)
        assert mine.local is not None and mine.gateway is not None
        impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        impostor.bind(str(open_folder / "gateway.sock"))
        impostor.listen(1)
        with pytest.raises(LocalRefused, match="closed to others"):
            DirectConstructor(mine.gateway, mine.name, None, 5.0, local=str(open_folder / "gateway.sock"))
        forged = [
            LocalGateway(path=str(open_folder / "gateway.sock"), host_id=host_id()),
            LocalGateway(path=mine.local.path, host_id="another-host/boot"),
        ]
        try:
            for local in forged:
                others = [c.model_copy(update={"local": local}) for c in info.constructors]
                write_serve_info(stream_plan, info.model_copy(update={"constructors": others}))
                with StreamClient(stream_plan, 0) as s:
                    next(s)
                    assert s.transport == "tls", local
        finally:
            write_serve_info(stream_plan, info)
            impostor.close()


def test_forcing_tls_in_process(dask_client: Client, stream_plan: Path) -> None:
    with Executor(stream_plan, dask_client), StreamClient(stream_plan, 0, local_gateway=False) as s:
        next(s)
        assert s.transport == "tls"


def test_a_dropped_local_connection_is_reconnected(dask_client: Client, stream_plan: Path) -> None:
    from loomtest.stream import check_exact, stream_with_fault

    dropped: list[DirectConstructor] = []

    def fault(streams: dict[int, Any]) -> None:
        conn = streams[0]._actor
        assert isinstance(conn, DirectConstructor) and conn.local is not None
        conn._sock.close()  # as a reset connection: calls in flight and later ones fail, the client reconnects
        dropped.append(conn)

    def after(streams: dict[int, Any]) -> None:
        assert streams[0]._actor is not dropped[0] and streams[0].transport == "local"

    with Executor(stream_plan, dask_client, window=2, bytes_in_flight=0):
        got, _ = stream_with_fault(stream_plan, fault, after)
    check_exact(stream_plan, got)
