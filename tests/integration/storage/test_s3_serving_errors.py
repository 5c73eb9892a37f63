"""A loader's error says what went wrong at its shard check: credentials, a missing object, never "changed" (issue 9).

moto on loopback checks every request's signature (`S3Server.require_auth`: an IAM user of its own); the bucket
is indexed and planned with the credentials in the spec only (no `AWS_*` variable in this process nor in the
cluster's worker, started without them). Then a serve whose loaders cannot read the objects the index read:

- no credentials at all in the worker, the executor's host able to list the bucket (its environment has them:
  the executor's start check lists the globs there) -> AccessDeniedError naming the shard's URL and the source,
  "no credentials found", and the fix (credentials for the workers, or `loom serve --spec`);
- a wrong secret in the worker's environment -> "access denied", the same fix, and no secret shown;
- an object deleted once serving started -> ObjectNotFoundError naming the URL, "missing", restore or re-index;
- a store that drops every response (a loopback proxy resetting each one) -> TransientStorageError naming the URL,
  the attempts and the last error, after the retries with back-off (a Source Loader in this process, as a worker
  runs it: botocore's own retries set to 1 to keep it short).

None says "the file changed after indexing": the index is not at fault in the first two. Without credentials
anywhere, serving fails at its start check, saying so (no credentials), naming the glob.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor, open_cluster
from loomdata.execution._loader import REQUEST_DTYPE, SourceLoader
from loomdata.execution._partition import partition_source
from loomdata.execution._storage_options import SourceOptions
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import IndexFiles, LoomError, Spec, parse_spec, read_manifest, read_plan
from loomdata.storage import AccessDeniedError, ObjectNotFoundError, TransientStorageError
from loomtest.s3 import DroppingProxy, S3Server, _apply_env
from loomtest.stream import write_corpus

BUCKET = "loom-serve-errors"
CHANGED = "changed after indexing"
_SETTINGS: dict[str, Any] = {"window": 2, "bytes_in_flight": 0, "loader_memory": 0, "loader_prefetch": 0}


@dataclass
class Served:
    server: S3Server
    client: Client
    spec: Spec
    plan_dir: Path
    shards: dict[int, str]  # shard id -> URL

    def env(self, secret: str | None = None) -> dict[str, str | None]:
        """`AWS_*` variables reaching the server with these credentials (`secret` instead of the right one)."""
        return {
            "AWS_ACCESS_KEY_ID": self.server.key_id,
            "AWS_SECRET_ACCESS_KEY": secret or self.server.secret,
            "AWS_ENDPOINT_URL": self.server.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


@contextlib.contextmanager
def _here(env: dict[str, str | None]) -> Iterator[None]:
    """`env` in this process (the executor's host: its start check lists the globs here), put back afterwards."""
    old = _apply_env(env)
    try:
        yield
    finally:
        _apply_env(old)


@contextlib.contextmanager
def _in_workers(client: Client, env: dict[str, str | None]) -> Iterator[None]:
    """`env` in the cluster's worker processes (where the loaders run), put back afterwards."""
    old = client.run(_apply_env, env)
    try:
        yield
    finally:
        client.run(_apply_env, next(iter(old.values())))  # the workers started alike: one cluster, one environment


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve-errors")
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.upper().startswith("AWS_")]:
            mp.delenv(name)  # before the cluster starts: its worker inherits none
        mp.setenv("LOOMDATA_CACHE_DIR", str(tmp / "cache"))
        server = S3Server(tmp / "cache", set_env=False).start()
        try:
            data = tmp / "data"
            write_corpus(data, "web", n_files=3, rows=40, seed=4)
            server.upload_dir(data, BUCKET, "corpus")
            server.require_auth()  # from here on, every request is checked against the server's IAM
            raw = {
                "name": "serve-errors",
                "workdir": str(tmp / "work"),
                "sources": [
                    {
                        "name": "web",
                        "format": "parquet",
                        "paths": [f"s3://{BUCKET}/corpus/web/*.parquet"],
                        "tokens_field": "tokens",
                        "storage_options": server.options(),  # the only credentials anywhere
                    }
                ],
                "mixture": {"weights": {"web": 1.0}},
                "training": {"seq_len": 256, "steps": 12, "dp_size": 2, "micro_batches": 2},
            }
            spec = parse_spec(raw, tmp)
            with open_cluster(n_workers=1, local_directory=tmp / "dask") as client:
                build_index(spec, client)
                plan_dir = make_plan(spec).plan_dir
                table = IndexFiles.of(spec.workdir, "web").shard_table()
                shards = dict(zip(table.column("shard").to_pylist(), table.column("path").to_pylist(), strict=True))
                assert len(shards) == 3 and all(p.startswith(f"s3://{BUCKET}/") for p in shards.values())
                yield Served(server, client, spec, Path(plan_dir), shards)
        finally:
            server.stop()


def _serve_error(s: Served, **executor: Any) -> LoomError:
    """What a rank sees streaming the plan from a real executor on the cluster (which must fail)."""
    meta = read_plan(s.plan_dir)
    with pytest.raises(LoomError) as err, Executor(s.plan_dir, s.client, constructors=1, **_SETTINGS, **executor):
        for rank in range(meta.dp_size):
            with StreamClient(s.plan_dir, rank, retry_s=20) as stream:
                list(stream)
    return err.value


def _assert_names_a_shard(s: Served, msg: str) -> None:
    assert any(url in msg for url in s.shards.values()), msg
    assert "source 'web'" in msg and CHANGED not in msg and "re-run `loom index`" not in msg, msg
    assert s.server.secret not in msg, "the secret must never be shown"


def test_a_worker_without_credentials_is_told_so_not_that_the_file_changed(served: Served) -> None:
    with _here(served.env()):  # this host lists the bucket (the start check); the worker has no AWS_* at all
        err = _serve_error(served)
    msg = str(err)
    assert isinstance(err, AccessDeniedError), msg
    _assert_names_a_shard(served, msg)
    assert "no credentials found" in msg and "was given no storage_options" in msg, msg
    assert "loom serve PLAN_DIR --spec SPEC.yaml" in msg and "AWS_ACCESS_KEY_ID" in msg, msg


def test_a_worker_with_a_wrong_secret_is_told_access_is_denied(served: Served) -> None:
    wrong = "wrong" + secrets.token_hex(16)
    with _here(served.env()), _in_workers(served.client, served.env(secret=wrong)):
        err = _serve_error(served)
    msg = str(err)
    assert isinstance(err, AccessDeniedError), msg
    _assert_names_a_shard(served, msg)
    assert "access denied" in msg and "loom serve PLAN_DIR --spec SPEC.yaml" in msg and wrong not in msg, msg


def test_no_credentials_anywhere_fails_the_serve_at_its_start_saying_so(served: Served) -> None:
    with pytest.raises(AccessDeniedError) as err:
        Executor(served.plan_dir, served.client, constructors=1).start()
    msg = str(err.value)
    assert f"s3://{BUCKET}/corpus/web/*.parquet" in msg and "no credentials found" in msg, msg
    assert "--spec SPEC.yaml" in msg and CHANGED not in msg, msg


def test_an_object_deleted_while_serving_is_named_missing(served: Served, tmp_path: Path) -> None:
    meta = read_plan(served.plan_dir)
    last = read_manifest(served.plan_dir, meta, meta.steps - 1, meta.steps - 1, columns=["sample"])
    samples = pq.read_table(str(IndexFiles.of(served.spec.workdir, "web").samples), columns=["sample", "shard"])
    shard_of = dict(zip(samples.column("sample").to_pylist(), samples.column("shard").to_pylist(), strict=True))
    shard = shard_of[last.column("sample")[0].as_py()]  # read in the last step: after the window of the start
    url = served.shards[shard]
    body = served.server.boto3().get_object(Bucket=BUCKET, Key=url.split("/", 3)[3])["Body"].read()
    try:
        with Executor(served.plan_dir, served.client, constructors=1, spec=served.spec, **_SETTINGS):
            served.server.boto3().delete_object(Bucket=BUCKET, Key=url.split("/", 3)[3])
            with pytest.raises(LoomError) as err:
                for rank in range(meta.dp_size):
                    with StreamClient(served.plan_dir, rank, retry_s=20) as stream:
                        list(stream)
    finally:  # put back for the other tests of the module
        served.server.boto3().put_object(Bucket=BUCKET, Key=url.split("/", 3)[3], Body=body)
    msg = str(err.value)
    assert isinstance(err.value, ObjectNotFoundError), msg
    assert url in msg and "source 'web'" in msg and CHANGED not in msg, msg
    assert "no such bucket or object" in msg and "is missing now" in msg and "restore the object" in msg, msg
    assert served.server.secret not in msg


def test_a_store_failing_through_every_retry_is_named_with_the_attempts(served: Served) -> None:
    proxy = DroppingProxy(served.server.port, drops=10**6, cut=100)  # every response reset mid-way
    try:
        options = {
            "s3": {
                **served.server.options()["s3"],
                "endpoint_url": proxy.endpoint,
                "config_kwargs": {"retries": {"max_attempts": 1}},  # botocore's own retries: loomdata's are tested
            }
        }
        meta = read_plan(served.plan_dir)
        files = IndexFiles.of(served.spec.workdir, "web")
        (part,) = partition_source(0, "web", files.sample_shards().column("shard").to_numpy(), 1)
        loader = SourceLoader(str(served.plan_dir), part, storage=SourceOptions({"web": options}))
        request = np.zeros(1, dtype=REQUEST_DTYPE)
        request["length"] = 1
        with pytest.raises(TransientStorageError) as err:
            loader.read_now(request)
    finally:
        proxy.close()
    msg = str(err.value)
    assert meta.sources == ["web"] and proxy.dropped >= 6, (proxy.dropped, proxy.connections)
    assert served.shards[0] in msg and "shard 0 of source 'web'" in msg and "failed 6 times, the last with" in msg, msg
    assert "retry with back-off" in msg and CHANGED not in msg and served.server.secret not in msg, msg
