"""build_index on Parquet shards written by pyarrow, on a real LocalCluster: content, parts, metadata, tokenizers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client, get_task_stream
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers, trainers

from loomdata.indexing import build_index
from loomdata.schemas import IndexBuildError, IndexFiles, TableKind, read_index, read_table, table_metadata

LANGS = ["en", "de", "fr"]


def _write_tokens(path: Path, lengths: np.ndarray, seed: int, row_group_size: int = 50) -> None:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 50_000, size=int(k)).tolist() for k in lengths]
    table = pa.table(
        {
            "input_ids": pa.array(docs, type=pa.list_(pa.int32())),
            "quality": pa.array(np.arange(len(lengths), dtype=np.float32) / 10 + seed),
            "lang": pa.array([LANGS[i % 3] for i in range(len(lengths))]),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)


def _web_source(**kw: object) -> dict[str, object]:
    return {
        "name": "web",
        "format": "parquet",
        "paths": ["data/web/*.parquet"],
        "tokens_field": "input_ids",
        "metadata": ["quality", "lang"],
        **kw,
    }


def _write_web(root: Path, sizes: list[int]) -> list[np.ndarray]:
    """Shards web-0..web-k with the given row counts; returns each shard's true lengths."""
    out = []
    for i, n in enumerate(sizes):
        lengths = np.random.default_rng(100 + i).integers(0, 400, size=n)
        _write_tokens(root / "data" / "web" / f"web-{i}.parquet", lengths, seed=i)
        out.append(lengths)
    return out


def test_pretokenized_index_content_parts_and_metadata(tmp_path: Path, make_spec, dask_client: Client) -> None:
    truth = _write_web(tmp_path, [230, 0, 411, 97])
    spec = make_spec(_web_source())
    # Small parts force several tasks per shard: the assembled index must not depend on the split.
    with get_task_stream(dask_client) as ts:
        summary = build_index(spec, dask_client, part_bytes=20_000)
    scan_keys = [t["key"] for t in ts.data if "loom-scan" in str(t["key"])]
    assert len(scan_keys) > 4  # more tasks than shards: shards were split into parts

    s = summary.sources["web"]
    lengths = np.concatenate(truth)
    assert (s.shards, s.samples, s.tokens, s.image_tokens, s.skipped) == (4, len(lengths), int(lengths.sum()), 0, 0)
    assert (s.rescanned, s.reused, s.removed) == (4, 0, 0)

    samples, shards, fp = read_index(spec.workdir, "web")
    assert fp == s.fingerprint
    index_columns = ["sample", "shard", "row", "num_tokens", "num_image_tokens", "checksum"]
    assert samples.column_names == [*index_columns, "quality", "lang"]
    assert samples.column("sample").to_pylist() == list(range(len(lengths)))
    expected_shard = np.repeat(np.arange(4), [len(t) for t in truth])
    np.testing.assert_array_equal(samples.column("shard").to_numpy(), expected_shard)
    np.testing.assert_array_equal(samples.column("row").to_numpy(), np.concatenate([np.arange(len(t)) for t in truth]))
    np.testing.assert_array_equal(samples.column("num_tokens").to_numpy(), lengths)
    assert samples.column("num_image_tokens").to_numpy().sum() == 0
    expected_quality = np.concatenate([np.arange(len(t), dtype=np.float32) / 10 + i for i, t in enumerate(truth)])
    np.testing.assert_array_equal(samples.column("quality").to_numpy(), expected_quality)
    assert samples.column("lang").to_pylist() == [LANGS[r % 3] for t in truth for r in range(len(t))]

    assert shards.column("shard").to_pylist() == [0, 1, 2, 3]
    assert shards.column("path").to_pylist() == [str(tmp_path / "data" / "web" / f"web-{i}.parquet") for i in range(4)]
    assert shards.column("num_rows").to_pylist() == [230, 0, 411, 97]
    assert shards.column("size_bytes").to_pylist() == [
        (tmp_path / "data" / "web" / f"web-{i}.parquet").stat().st_size for i in range(4)
    ]
    assert not IndexFiles.of(spec.workdir, "web").errors.exists()
    assert summary.to_dict()["sources"]["web"]["samples"] == len(lengths)


def test_index_is_byte_identical_when_rebuilt_from_scratch(tmp_path: Path, make_spec, dask_client: Client) -> None:
    _write_web(tmp_path, [120, 80])
    spec = make_spec(_web_source())
    files = IndexFiles.of(spec.workdir, "web")
    build_index(spec, dask_client)
    first = files.samples.read_bytes(), files.shards.read_bytes()
    for p in files.root.rglob("*.parquet"):
        p.unlink()
    build_index(spec, dask_client, part_bytes=5_000)
    assert (files.samples.read_bytes(), files.shards.read_bytes()) == first


def _train_bpe(path: Path) -> HFTok:
    tok = HFTok(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(path))
    return tok


def test_raw_text_counts_follow_the_tokenizer_and_a_new_tokenizer_rescans(
    tmp_path: Path, make_spec, dask_client: Client
) -> None:
    rng = np.random.default_rng(3)
    words = ["the", "fox", "jumps", "über", "lazy", "dog", "🙂", "quick"]
    texts = [[" ".join(rng.choice(words, size=int(k))) for k in rng.integers(0, 60, size=n)] for n in (70, 55)]
    for i, t in enumerate(texts):
        (tmp_path / "data" / "code").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": t}), tmp_path / "data" / "code" / f"c{i}.parquet", row_group_size=16)
    source = {"name": "code", "format": "parquet", "paths": ["data/code/*.parquet"], "text_field": "text"}

    byte_spec = make_spec(source)
    s1 = build_index(byte_spec, dask_client).sources["code"]
    flat = [x for t in texts for x in t]
    byte_counts = [len(x.encode("utf-8")) for x in flat]
    samples, _, _ = read_index(byte_spec.workdir, "code")
    assert samples.column("num_tokens").to_pylist() == byte_counts
    assert s1.tokens == sum(byte_counts)

    hf = _train_bpe(tmp_path / "tok.json")
    hf_spec = make_spec(source, tokenizer={"kind": "huggingface", "path": "tok.json"})
    s2 = build_index(hf_spec, dask_client).sources["code"]
    assert (s2.rescanned, s2.reused) == (2, 0)
    assert s2.fingerprint != s1.fingerprint
    hf_counts = [len(e.ids) for e in hf.encode_batch(flat, add_special_tokens=False)]
    assert hf_counts != byte_counts
    samples, _, _ = read_index(hf_spec.workdir, "code")
    assert samples.column("num_tokens").to_pylist() == hf_counts
    # Only the current config's cached scans remain.
    assert len(list((IndexFiles.of(hf_spec.workdir, "code").root / "_parts").iterdir())) == 2


def test_sources_subset_and_unknown_source(tmp_path: Path, make_spec, dask_client: Client) -> None:
    _write_web(tmp_path, [10])
    (tmp_path / "data" / "other").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["ab", "cde"]}), tmp_path / "data" / "other" / "o.parquet")
    other = {"name": "other", "format": "parquet", "paths": ["data/other/*.parquet"], "text_field": "text"}
    spec = make_spec(_web_source(), other)
    summary = build_index(spec, dask_client, sources=["other"])
    assert list(summary.sources) == ["other"]
    assert summary.sources["other"].tokens == 5
    assert not IndexFiles.of(spec.workdir, "web").samples.exists()
    with pytest.raises(IndexBuildError, match=r"unknown source.*'nope'.*known: web, other"):
        build_index(spec, dask_client, sources=["nope"])
    stored = read_table(IndexFiles.of(spec.workdir, "other").samples, TableKind.INDEX)
    assert stored.num_rows == 2
    assert (
        table_metadata(IndexFiles.of(spec.workdir, "other").samples)["fingerprint"]
        == summary.sources["other"].fingerprint
    )
