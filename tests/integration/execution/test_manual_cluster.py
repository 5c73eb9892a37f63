"""A cluster started by hand (`dask scheduler` + `dask worker` processes) serves like the embedded one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loomdata.client import StreamClient
from loomdata.execution import Executor, open_cluster
from loomdata.execution._security import TlsFiles, make_certs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def certs(tmp_path: Path) -> Any:
    """`loom certs`' CA and scheduler, worker and client certificates."""
    return make_certs(tmp_path / "certs", ["127.0.0.1"])


def _tls_args(certs: Any, role: str) -> list[str]:
    cert, key = certs.roles[role]
    return ["--tls-ca-file", str(certs.ca_file), "--tls-cert", str(cert), "--tls-key", str(key)]


@pytest.fixture
def manual_cluster(tmp_path: Path, certs: Any) -> Iterator[str]:
    """A TLS scheduler and two TLS workers started by hand with the certificates of `loom certs`."""
    dask = str(Path(sys.executable).with_name("dask"))
    port = _free_port()
    address = f"tls://127.0.0.1:{port}"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    log = open(tmp_path / "cluster.log", "w")  # noqa: SIM115 - closed below
    procs = [
        subprocess.Popen(
            [
                dask,
                "scheduler",
                "--host",
                "tls://127.0.0.1",
                "--port",
                str(port),
                "--no-dashboard",
                *_tls_args(certs, "scheduler"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    ]
    for i in range(2):
        procs.append(
            subprocess.Popen(
                [
                    dask,
                    "worker",
                    address,
                    "--no-nanny",
                    "--nthreads",
                    "1",
                    "--host",
                    "127.0.0.1",
                    "--no-dashboard",
                    "--local-directory",
                    str(tmp_path / f"w{i}"),
                    *_tls_args(certs, "worker"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
    try:
        yield address
    finally:
        for p in reversed(procs):  # workers first, each to its end, while the scheduler still answers:
            p.terminate()  # a worker that loses its scheduler first retries connecting for ~20 s
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


def test_hand_started_cluster_serves_exact_batches(
    manual_cluster: str, certs: Any, stream_plan: Path, loomtest: Any
) -> None:
    oracle = loomtest.Oracle(stream_plan)
    cert, key = certs.roles["client"]
    with open_cluster(manual_cluster, tls=TlsFiles(str(certs.ca_file), str(cert), str(key))) as client:
        client.wait_for_workers(2, timeout=60)
        with Executor(stream_plan, client, constructors=2, loaders_per_source=2) as ex:
            assert ex.info is not None and ex.info.scheduler == manual_cluster
            assert len({lo.worker for lo in ex.info.loaders}) == 2  # spread over both hand-started workers
            with StreamClient(stream_plan, 0, scheduler=manual_cluster) as a, StreamClient(stream_plan, 1) as b:
                got = list(a) + list(b)
    assert len(got) == 2 * oracle.meta.steps * oracle.meta.micro_batches
    assert sum(oracle.check(x) for x in got) > 0
