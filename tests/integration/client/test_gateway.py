"""Ranks through the rank gateway: a whole plan streamed by a process that never imports Dask, exact.

The rank process reads serve.json, connects to its constructor's gateway with the TLS files it names and
yields every micro-batch; its batches are compared, array by array, with those a rank on Dask calls
(LOOM_TRANSPORT=dask) receives from the same executor. A gateway that goes away mid-stream (its
connection dropped) is reconnected to, and nothing is lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.schemas import Batch

_RANK = """
import hashlib, json, sys
from loomdata.client import StreamClient
out = []
with StreamClient(sys.argv[1], int(sys.argv[2])) as s:
    for b in s:
        h = hashlib.sha256()
        for a in (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.segments):
            h.update(a.tobytes())
        out.append([b.step, b.micro_batch, h.hexdigest()])
    calls = s.calls
print(json.dumps({"batches": out, "calls": calls, "dask": any(m.split(".")[0] in ("distributed", "dask", "tornado")
      for m in sys.modules)}))
"""


def _digest(b: Batch) -> list[Any]:
    h = hashlib.sha256()
    for a in (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.segments):
        h.update(np.ascontiguousarray(a).tobytes())
    return [b.step, b.micro_batch, h.hexdigest()]


def test_a_rank_without_dask_streams_exactly_what_a_dask_rank_gets(
    dask_client: Client, stream_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Executor(stream_plan, dask_client) as ex:
        assert ex.info is not None and all(c.gateway for c in ex.info.constructors)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        env.pop("LOOM_TRANSPORT", None)
        proc = subprocess.run(
            [sys.executable, "-c", _RANK, str(stream_plan), "1"], capture_output=True, text=True, env=env, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        direct = json.loads(proc.stdout.splitlines()[-1])
        monkeypatch.setenv("LOOM_TRANSPORT", "dask")
        with StreamClient(stream_plan, 1) as s:
            via_dask = [_digest(b) for b in s]
            assert s.dask_client is not None
    assert not direct["dask"], "the gateway rank imported Dask"
    assert direct["calls"] >= 1
    assert direct["batches"] == via_dask and len(via_dask) == s.meta.steps * s.meta.micro_batches


def test_a_dropped_gateway_connection_is_reconnected(
    dask_client: Client, stream_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TLS (a dropped same-host connection: test_gateway_local)."""
    from loomdata.client._direct import DirectConstructor
    from loomtest.stream import check_exact, stream_with_fault

    monkeypatch.setenv("LOOM_TRANSPORT", "tls")

    dropped: list[DirectConstructor] = []

    def fault(streams: dict[int, Any]) -> None:
        conn = streams[0]._actor
        assert isinstance(conn, DirectConstructor) and conn.local is None
        conn._sock.close()  # as a reset connection: calls in flight and later ones fail, the client reconnects
        dropped.append(conn)

    def after(streams: dict[int, Any]) -> None:
        assert isinstance(streams[0]._actor, DirectConstructor) and streams[0]._actor is not dropped[0]
        assert streams[0].transport == "tls"

    with Executor(stream_plan, dask_client, window=2, bytes_in_flight=0):
        got, _ = stream_with_fault(stream_plan, fault, after)
    check_exact(stream_plan, got)


def test_a_gateway_on_the_same_address_with_another_id_counts_as_replaced(
    dask_client: Client, stream_plan: Path
) -> None:
    """A gateway restarted on its old address draws another id: the rank stops waiting on the old one."""
    from loomdata.client._direct import DirectConstructor
    from loomdata.execution.protocol import read_serve_info, write_serve_info

    with Executor(stream_plan, dask_client) as ex:
        assert ex.info is not None
        ids = {c.gateway: c.gateway_id for c in ex.info.constructors}
        assert all(ids.values()) and len(set(ids.values())) == len(ids)  # one id per gateway, drawn at its start
        with StreamClient(stream_plan, 0) as s:
            first = next(s)
            assert isinstance(s._actor, DirectConstructor) and not s._replaced()
            info = read_serve_info(stream_plan)
            mine = info.constructor_for(0)
            restarted = mine.model_copy(update={"gateway_id": "f" * 16})  # same address, another gateway behind it
            others = [restarted if c.name == mine.name else c for c in info.constructors]
            write_serve_info(stream_plan, info.model_copy(update={"constructors": others}))
            assert s._replaced()
            write_serve_info(stream_plan, info)
            assert not s._replaced()
            assert [b.step for b in [first, *s]][-1] == s.meta.steps - 1
