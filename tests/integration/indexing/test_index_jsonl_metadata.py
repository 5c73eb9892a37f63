"""build_index carries JSONL metadata fields into samples.parquet, one type per field over parts and shards."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from distributed import Client

from loomdata.indexing import build_index
from loomdata.schemas import IndexBuildError, IndexFiles, SourceDataError, Spec, read_index

SpecFactory = Callable[..., Spec]

META = ["url", "lang", "quality", "safe", "tags", "never"]


def _write(path: Path, objs: list[dict[str, object]]) -> None:
    data = ("\n".join(json.dumps(o, ensure_ascii=False) for o in objs) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    elif path.suffix == ".zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)


def _objs(shard: int, n: int) -> list[dict[str, object]]:
    """Shard 0 has integer qualities only late in the file, shard 1 floats, shard 2 none at all."""
    out: list[dict[str, object]] = []
    for i in range(n):
        o: dict[str, object] = {
            "text": f"shard {shard} doc {i} " + "w" * (i % 37),
            "url": f"https://ex.org/{shard}/{i}",
        }
        if i % 4:
            o["lang"] = ["en", "fr", "中文"][i % 3]
        if shard == 0 and i >= n // 2:
            o["quality"] = i
        elif shard == 1:
            o["quality"] = round(i / 3, 4)
        o["safe"] = i % 2 == 0
        if i % 5 == 0:
            o["tags"] = {"topics": ["a", str(i)], "score": i}
        elif i % 5 == 1:
            o["tags"] = "plain"
        o["noise"] = [1, {"x": None}]
        out.append(o)
    return out


def _carried(v: object) -> object:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int | float):
        return float(v)
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _web(paths: str = "web/*") -> dict[str, object]:
    return {"name": "web", "format": "jsonl", "paths": [paths], "text_field": "text", "metadata": META}


def test_jsonl_metadata_columns_in_samples(tmp_path: Path, make_spec: SpecFactory, dask_client: Client) -> None:
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    objs = {n: _objs(k, 300 + 40 * k) for k, n in enumerate(names)}
    for n in names:
        _write(tmp_path / "web" / n, objs[n])
    spec = make_spec(_web())
    s = build_index(spec, dask_client, part_bytes=3_000).sources["web"]  # the plain file splits into parts
    every = [o for n in names for o in objs[n]]
    assert (s.shards, s.samples, s.skipped) == (3, len(every), 0)
    samples, _, _ = read_index(spec.workdir, "web")
    assert samples.column_names == ["sample", "shard", "row", "num_tokens", "num_image_tokens", "checksum", *META]
    types = {m: samples.schema.field(m).type for m in META}
    assert types == {
        "url": pa.string(),
        "lang": pa.string(),
        "quality": pa.float64(),
        "safe": pa.bool_(),
        "tags": pa.string(),
        "never": pa.null(),
    }
    for m in META:
        assert samples.column(m).to_pylist() == [_carried(o.get(m)) for o in every], m
    assert samples.column("num_tokens").to_pylist() == [len(str(o["text"]).encode()) for o in every]
    stored = pq.read_schema(IndexFiles.of(spec.workdir, "web").samples)
    assert stored.field("quality").type == pa.float64()


def test_jsonl_metadata_kind_clash(tmp_path: Path, make_spec: SpecFactory, dask_client: Client) -> None:
    objs = _objs(1, 50)
    objs[30]["quality"] = "excellent"
    bad = tmp_path / "web" / "a.jsonl.gz"
    _write(bad, objs)
    with pytest.raises(SourceDataError, match=r"line 31: metadata field 'quality' holds text") as exc:
        build_index(make_spec(_web()), dask_client)
    assert (exc.value.path, exc.value.row) == (str(bad), 30)
    # Shards that each hold one kind but disagree with each other fail the job, naming the source.
    _write(bad, [{**o, "quality": "excellent"} for o in _objs(1, 50)])
    _write(tmp_path / "web" / "b.jsonl", _objs(1, 50))
    with pytest.raises(IndexBuildError, match=r"source 'web': shards disagree on a metadata column's type"):
        build_index(make_spec(_web()), dask_client)


def test_parts_of_one_file_that_disagree_name_the_file(
    tmp_path: Path, make_spec: SpecFactory, dask_client: Client
) -> None:
    """A plain JSONL file split into parts whose metadata kinds differ fails with a clear IndexBuildError."""
    path = tmp_path / "web" / "mixed.jsonl"
    path.parent.mkdir(parents=True)
    lines = [json.dumps({"text": "x" * 50, "q": 1.5}) for _ in range(100)]
    lines += [json.dumps({"text": "x" * 49, "q": "hi"}) for _ in range(100)]  # same length: parts split at line 100
    path.write_text("\n".join(lines) + "\n")
    spec = make_spec({**_web(), "metadata": ["q"]})
    with pytest.raises(IndexBuildError, match=r"mixed\.jsonl: parts of the file disagree on a metadata column's type"):
        build_index(spec, dask_client, part_bytes=len(lines[0]) * 100 + 100)
