"""Index, plan and serve a corpus from a real S3-protocol server (moto, loopback), checked against the local copy.

The tiny demo corpus (Parquet, JSONL plain/gz/zst, Megatron, WebDataset) is uploaded with boto3; the same
spec is indexed and planned once from the local files and once from `s3://`. Identity is content, so both
indexes and manifests are equal; four ranks stream the S3 plan from a real executor and every token of the
Parquet and JSONL sources is checked against an independent read of the local files (the Megatron and
WebDataset samples are checked by the loaders against the per-sample checksums, equal to the local index's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import IndexFiles, LoomError, Spec, parse_spec, read_manifest, read_plan
from loomdata.storage import ObjectNotFoundError, request_stats, reset_request_stats
from loomdata.testing import generate_corpus
from loomtest.s3 import DroppingProxy, LocalOracle, S3Server

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
BUCKET = "loom-data"
PREFIX = f"s3://{BUCKET}/data"
_FIX = "re-run `loom index`"


@pytest.fixture(scope="module")
def corpus(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus") / "data"
    generate_corpus(root, "tiny", seed=0)
    s3.upload_dir(root, BUCKET, "data")
    return root


def _spec(tmp: Path, data: str, s3: S3Server | None) -> Spec:
    raw = yaml.safe_load(CONFIG.read_text().replace("../demo-work/data", data))
    raw["workdir"] = str(tmp / "work")
    raw["training"]["steps"] = 12
    if s3 is not None:  # the secret in the spec too: it must reach no file either
        for src in raw["sources"]:
            src["storage_options"] = {"s3": {"key": s3.key_id, "secret": s3.secret}}
    return parse_spec(raw, tmp)


def _index_tables(spec: Spec) -> dict[str, pa.Table]:
    cols = ["sample", "shard", "row", "num_tokens", "num_image_tokens", "checksum"]
    return {s.name: pq.read_table(str(IndexFiles.of(spec.workdir, s.name).samples), columns=cols) for s in spec.sources}


def _files_under(*roots: Path) -> list[Path]:
    return [p for r in roots if r.exists() for p in r.rglob("*") if p.is_file()]


def test_s3_corpus_indexes_plans_and_serves_like_the_local_copy(
    dask_client: Client, s3: S3Server, corpus: Path, tmp_path: Path
) -> None:
    local = _spec(tmp_path / "local", str(corpus), None)
    remote = _spec(tmp_path / "s3", PREFIX, s3)
    assert all(str(p).startswith(PREFIX) for s in remote.sources for p in remote.resolve_paths(s))
    build_index(local, dask_client)
    first = build_index(remote, dask_client)
    assert all(s.rescanned > 0 for s in first.sources.values())
    assert _index_tables(local) == _index_tables(remote)  # identity is content: same rows, checksums, shards

    local_plan, remote_plan = make_plan(local).plan_dir, make_plan(remote).plan_dir
    meta = read_plan(remote_plan)
    assert read_plan(local_plan).index_fingerprints == meta.index_fingerprints
    assert read_manifest(local_plan, read_plan(local_plan)).equals(read_manifest(remote_plan, meta))

    # An incremental re-run: one listing per pattern and one HEAD per object, no byte of data read.
    reset_request_stats()
    again = build_index(remote, dask_client)
    stats = request_stats()
    assert all(s.rescanned == 0 for s in again.sources.values()), again
    assert stats.get("get", 0) == 0 and stats.get("get_bytes", 0) == 0 and stats["head"] > 0, stats

    oracle = LocalOracle(remote, corpus, PREFIX)
    assert meta.dp_size == 4
    checked = {name: 0 for name in oracle.docs}
    served = 0
    with Executor(remote_plan, dask_client, constructors=2):
        for rank in range(meta.dp_size):
            with StreamClient(remote_plan, rank, retry_s=30) as stream:
                for b in stream:
                    served += 1
                    starts = b.cu_seqlens[:-1]
                    for k, (src, sample, off, ln) in enumerate(b.segments.tolist()):
                        name = meta.sources[src]
                        if name in oracle.docs:
                            want = oracle.docs[name][sample][off : off + ln]
                            np.testing.assert_array_equal(b.input_ids[starts[k] : starts[k] + ln], want)
                            checked[name] += ln
    assert served == meta.steps * meta.dp_size * meta.micro_batches
    assert all(n > 0 for n in checked.values()), checked

    # No credential in any file loomdata wrote: index, plans, serve.json, telemetry, the object cache.
    written = _files_under(remote.workdir, s3.cache_dir)
    assert any(p.name == "plan.json" for p in written) and len(written) > 10
    leaks = [p for p in written if s3.secret.encode() in p.read_bytes()]
    assert leaks == []


def _one_parquet(path: Path, seed: int, rows: int = 64) -> None:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 1000, size=int(n), dtype=np.int32) for n in rng.integers(20, 200, size=rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=16)


def _small_spec(tmp: Path, url: str, options: dict[str, Any] | None = None) -> Spec:
    source: dict[str, Any] = {"name": "web", "format": "parquet", "paths": [url], "tokens_field": "tokens"}
    if options:
        source["storage_options"] = options
    raw = {
        "name": "s3-small",
        "workdir": str(tmp / "work"),
        "sources": [source],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 256, "steps": 4, "dp_size": 2, "micro_batches": 1},
    }
    return parse_spec(raw, tmp)


def test_an_object_rewritten_after_indexing_is_refused_naming_its_url(
    dask_client: Client, s3: S3Server, tmp_path: Path
) -> None:
    _one_parquet(tmp_path / "a.parquet", seed=1)
    s3.upload_dir(tmp_path, BUCKET, "rewrite")
    url = f"s3://{BUCKET}/rewrite/a.parquet"
    spec = _small_spec(tmp_path / "spec", f"s3://{BUCKET}/rewrite/*.parquet")
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    _one_parquet(tmp_path / "a.parquet", seed=2, rows=80)  # other rows: another size, ETag and content
    s3.boto3().upload_file(str(tmp_path / "a.parquet"), BUCKET, "rewrite/a.parquet")
    with pytest.raises(LoomError) as err, Executor(plan_dir, dask_client, constructors=1):
        for rank in range(2):
            with StreamClient(plan_dir, rank, retry_s=20) as stream:
                list(stream)
    msg = str(err.value)
    assert url in msg and _FIX in msg, msg


def test_connection_resets_mid_response_are_retried(dask_client: Client, s3: S3Server, tmp_path: Path) -> None:
    _one_parquet(tmp_path / "data" / "b.parquet", seed=3, rows=200)
    s3.upload_dir(tmp_path / "data", BUCKET, "flaky")
    direct = _small_spec(tmp_path / "direct", f"s3://{BUCKET}/flaky/*.parquet")
    build_index(direct, dask_client)
    proxy = DroppingProxy(s3.port, drops=4, cut=300)
    try:
        flaky = _small_spec(
            tmp_path / "flaky", f"s3://{BUCKET}/flaky/*.parquet", {"s3": {"endpoint_url": proxy.endpoint}}
        )
        build_index(flaky, dask_client)
    finally:
        proxy.close()
    assert proxy.dropped >= 1, (proxy.dropped, proxy.connections)
    assert _index_tables(flaky) == _index_tables(direct)


def test_a_missing_bucket_is_an_error_naming_the_url(tmp_path: Path, s3: S3Server) -> None:
    with pytest.raises(ObjectNotFoundError, match=r"s3://no-such-bucket/web/\*\.parquet: bucket 'no-such-bucket'"):
        _small_spec(tmp_path, "s3://no-such-bucket/web/*.parquet")


def test_a_same_size_rewrite_with_the_same_edges_is_refused_by_its_etag(
    dask_client: Client, s3: S3Server, tmp_path: Path
) -> None:
    """`verify: shard` reads no sample checksums: only the ETag can tell this rewrite apart."""
    rng = np.random.default_rng(5)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    texts = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(300, 600, size=500)]
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    assert len(body) > 3 * 64 * 1024
    s3.boto3().put_object(Bucket=BUCKET, Key="etag/books.jsonl", Body=body)
    url = f"s3://{BUCKET}/etag/books.jsonl"
    source = {"name": "books", "format": "jsonl", "paths": [url], "text_field": "text", "verify": "shard"}
    raw = {
        "name": "etag",
        "workdir": str(tmp_path / "work"),
        "sources": [source],
        "mixture": {"weights": {"books": 1.0}},
        "training": {"seq_len": 512, "steps": 6, "dp_size": 2, "micro_batches": 2},
    }
    spec = parse_spec(raw, tmp_path)
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    lines = body.split(b"\n")
    for i in range(len(lines) * 2 // 5, len(lines) * 3 // 5):  # swap a and b: same size, same 64 KiB edges
        lines[i] = lines[i].replace(b"a", b"#").replace(b"b", b"a").replace(b"#", b"b")
    changed = b"\n".join(lines)
    assert len(changed) == len(body) and changed[:65536] == body[:65536] and changed[-65536:] == body[-65536:]
    s3.boto3().put_object(Bucket=BUCKET, Key="etag/books.jsonl", Body=changed)
    with pytest.raises(LoomError) as err, Executor(plan_dir, dask_client, constructors=1):
        for rank in range(2):
            with StreamClient(plan_dir, rank, retry_s=20) as stream:
                list(stream)
    msg = str(err.value)
    assert url in msg and "ETag/version changed" in msg and _FIX in msg, msg
