"""A real S3-protocol server (moto on loopback) per test module, whose objects the cluster's workers can read."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from distributed import Client

from loomtest.s3 import S3Server


@pytest.fixture(scope="module")
def s3(dask_client: Client, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3cache"), dask_client).start()
    try:
        yield server
    finally:
        server.stop()
