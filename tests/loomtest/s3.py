"""A real S3-protocol server on loopback for tests: moto's ThreadedMotoServer, credentials for the test only.

`S3Server.start()` binds a free 127.0.0.1 port, sets `AWS_*` variables (a fresh random secret key, the
endpoint) in this process and, through `client.run`, in the Dask workers, and clears the s3fs instance
cache so no filesystem made for another endpoint survives. `stop()` puts every variable back. With
`set_env=False` it sets none: the endpoint and credentials reach loomdata only as `options()` in a spec.
`require_auth()` makes the server check every request's signature (moto's IAM authentication): the
credentials become those of a user of the server's own IAM allowed `s3:*`; a wrong secret, an unknown key or
no signature is refused with a 403, as S3 does.
`DroppingProxy` forwards TCP to the server and cuts the first N responses mid-body with a reset.
`LocalOracle` reads what a bucket copy's samples hold from the local copy (pyarrow, json, the tokenizer).
"""

from __future__ import annotations

import gzip
import json
import os
import secrets
import socket
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import zstandard

from loomdata.schemas import IndexFiles, Spec
from loomdata.sources.tokenizer import make_tokenizer

_ENV_KEYS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ENDPOINT_URL",
    "AWS_DEFAULT_REGION",
    "AWS_EC2_METADATA_DISABLED",
    "LOOMDATA_CACHE_DIR",
)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _apply_env(env: dict[str, str | None]) -> dict[str, str | None]:
    """Set (or, for None, remove) variables; return their previous values. Also runs in Dask workers."""
    import s3fs

    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    s3fs.S3FileSystem.clear_instance_cache()
    return old


@dataclass
class S3Server:
    """moto's S3 server on a loopback port, with this test's credentials in the environment."""

    cache_dir: Path
    dask_client: Any = None
    secret: str = field(default_factory=lambda: "loomSECRET" + secrets.token_hex(12))
    key_id: str = "loomtestkeyid"
    port: int = 0
    set_env: bool = True
    _server: Any = None
    _old: dict[str, str | None] = field(default_factory=dict)
    _auth_before: str | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str | None]:
        return {
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "LOOMDATA_CACHE_DIR": str(self.cache_dir),
        }

    def start(self) -> S3Server:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        if self.set_env:
            self._old = _apply_env(self.env())
            if self.dask_client is not None:
                self.dask_client.run(_apply_env, self.env())
        return self

    def _reset_auth(self, count: str) -> str:
        """Set moto's count of requests let through unauthenticated (process-wide); returns the one before."""
        url = f"{self.endpoint}/moto-api/reset-auth"  # a plain body: a form's would be parsed away
        req = urllib.request.Request(url, data=count.encode(), headers={"Content-Type": "text/plain"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return str(json.loads(r.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])

    def require_auth(self) -> S3Server:
        """From now on every request must be signed by an IAM user of the server's: `key_id`/`secret` become one's.

        Upload before (or with the new credentials). `stop()` turns authentication off again (the setting is
        moto's, per process). Only with `set_env=False` (the environment would keep the old credentials).
        """
        import boto3

        assert not self.set_env, "require_auth needs set_env=False"
        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret,
        )
        iam.create_user(UserName="loomtest")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="loomtest", PolicyName="s3-all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="loomtest")["AccessKey"]
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self._auth_before = self._reset_auth("0")
        return self

    def options(self) -> dict[str, dict[str, str]]:
        """`storage_options` naming this server and its credentials (for a spec: no environment needed)."""
        return {"s3": {"endpoint_url": self.endpoint, "key": self.key_id, "secret": self.secret}}

    def stop(self) -> None:
        if self.set_env:
            if self.dask_client is not None:
                self.dask_client.run(_apply_env, self._old)
            _apply_env(self._old)
        if self._server is not None:
            if self._auth_before is not None:
                self._reset_auth(self._auth_before)
                self._auth_before = None
            self._server.stop()

    def boto3(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret,
        )

    def upload_dir(self, local: Path, bucket: str, prefix: str) -> list[str]:
        """Upload every file under `local` to `s3://bucket/prefix/<relative path>` (bucket created); returns keys."""
        s3 = self.boto3()
        existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)
        keys = []
        for p in sorted(local.rglob("*")):
            if p.is_file():
                key = f"{prefix}/{p.relative_to(local).as_posix()}"
                s3.upload_file(str(p), bucket, key)
                keys.append(key)
        return keys


class DroppingProxy:
    """A loopback TCP proxy to `target` that cuts the first `drops` responses after `cut` bytes with a reset."""

    def __init__(self, target_port: int, drops: int, cut: int = 200) -> None:
        self.target_port = target_port
        self.drops_left = drops
        self.dropped = 0
        self.connections = 0
        self.cut = cut
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            with self._lock:
                self.connections += 1
                drop = self.drops_left > 0
                self.drops_left -= int(drop)
            threading.Thread(target=self._pipe, args=(conn, drop), daemon=True).start()

    def _pipe(self, conn: socket.socket, drop: bool) -> None:
        up = socket.create_connection(("127.0.0.1", self.target_port), timeout=3)
        conn.settimeout(3)

        def forward_requests() -> None:
            try:
                while data := conn.recv(65536):
                    up.sendall(data)
            except OSError:
                pass

        reader = threading.Thread(target=forward_requests, daemon=True)
        reader.start()
        sent = 0
        try:
            while data := up.recv(65536):
                if drop and sent + len(data) > self.cut:
                    conn.sendall(data[: max(0, self.cut - sent)])
                    # A reset, not a clean close: linger 0; SHUT_RD wakes the request thread's recv (a socket
                    # is only really closed once no thread is blocked on it), then close() sends the RST.
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    conn.shutdown(socket.SHUT_RD)
                    reader.join(timeout=2)
                    with self._lock:
                        self.dropped += 1
                    break
                conn.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            up.close()
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


def _line_texts(path: Path) -> dict[int, str]:
    """Row -> text of a JSONL file: byte offsets (plain) or line numbers (compressed), read with the stdlib."""
    if path.suffix == ".gz":
        lines = gzip.decompress(path.read_bytes()).split(b"\n")
        return {i: json.loads(x)["text"] for i, x in enumerate(lines) if x.strip()}
    if path.suffix == ".zst":
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
        return {i: json.loads(x)["text"] for i, x in enumerate(raw.split(b"\n")) if x.strip()}
    out, pos = {}, 0
    for line in path.read_bytes().split(b"\n"):
        if line.strip():
            out[pos] = json.loads(line)["text"]
        pos += len(line) + 1
    return out


class LocalOracle:
    """Tokens of a sample of the Parquet and JSONL sources, from the local copy (pyarrow, json, the tokenizer).

    `docs[source][sample]`: the index (of the bucket copy, whose shards are URLs under `prefix`) maps each
    sample to a shard and row; the row is read from the same file under `local_root`, never through
    loomdata's readers or storage layer.
    """

    def __init__(self, spec: Spec, local_root: Path, prefix: str) -> None:
        self.tok = make_tokenizer(spec.tokenizer)
        self.docs: dict[str, list[np.ndarray]] = {}
        for src in spec.sources:
            if src.format.value not in ("parquet", "jsonl"):
                continue
            files = IndexFiles.of(spec.workdir, src.name)
            idx = pq.read_table(str(files.samples), columns=["sample", "shard", "row"]).sort_by("sample")
            shards = pq.read_table(str(files.shards))
            local = {
                int(s): Path(str(p).replace(prefix, str(local_root)))
                for s, p in zip(shards.column("shard").to_pylist(), shards.column("path").to_pylist(), strict=True)
            }
            assert all(str(p).startswith(prefix) for p in shards.column("path").to_pylist())
            texts: dict[int, Any] = {}
            for s, p in local.items():
                if src.format.value == "jsonl":
                    texts[s] = _line_texts(p)
                else:
                    texts[s] = pq.read_table(p, columns=[src.tokens_field or src.text_field or ""]).column(0)
            out = []
            for shard, row in zip(idx.column("shard").to_pylist(), idx.column("row").to_pylist(), strict=True):
                value = texts[shard][row]
                if src.tokens_field is not None:
                    out.append(np.asarray(value.as_py(), dtype=np.int32))
                else:
                    text = value if isinstance(value, str) else value.as_py()
                    out.append(np.asarray(self.tok.encode_batch([text])[0], dtype=np.int32))
            self.docs[src.name] = out
