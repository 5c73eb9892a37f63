"""build_index on JSONL (plain, gzip, zstd) and Megatron (.bin/.idx by megatron-core) shards, with bad input."""

from __future__ import annotations

import gzip
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import zstandard
from distributed import Client

from loomdata.indexing import build_index
from loomdata.schemas import IndexFiles, SourceDataError, TableKind, read_index, read_table

with warnings.catch_warnings():  # megatron-core warns that Transformer Engine / Apex are absent
    warnings.simplefilter("ignore")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "γάμμα", "delta", "日本", "eps", "\n", '"q"']
    return [" ".join(rng.choice(words, size=int(k))) for k in rng.integers(0, 300, size=n)]


def _write_jsonl(path: Path, lines: list[str]) -> None:
    data = ("\n".join(lines) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    elif path.suffix == ".zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)


def _books(on_error: str = "error") -> dict[str, object]:
    return {"name": "books", "format": "jsonl", "paths": ["books/*"], "text_field": "text", "on_error": on_error}


def test_jsonl_plain_and_compressed(tmp_path: Path, make_spec, dask_client: Client) -> None:
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    texts = {n: _texts(150 + 20 * i, seed=i) for i, n in enumerate(names)}
    for n in names:
        _write_jsonl(tmp_path / "books" / n, [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[n])])
    spec = make_spec(_books())
    s = build_index(spec, dask_client, part_bytes=4_000).sources["books"]  # the plain file splits into parts
    counts = [len(t.encode()) for n in names for t in texts[n]]
    assert (s.shards, s.samples, s.tokens, s.skipped) == (3, len(counts), sum(counts), 0)
    samples, shards, _ = read_index(spec.workdir, "books")
    assert samples.column("num_tokens").to_pylist() == counts
    assert shards.column("num_rows").to_pylist() == [len(texts[n]) for n in names]
    rows = samples.column("row").to_numpy()
    # Plain JSONL rows are byte offsets of the lines, compressed ones line numbers.
    plain = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts["a.jsonl"])]
    offsets = np.concatenate([[0], np.cumsum([len(x.encode()) + 1 for x in plain])[:-1]])
    np.testing.assert_array_equal(rows[: len(plain)], offsets)
    np.testing.assert_array_equal(rows[len(plain) : len(plain) + 170], np.arange(170))


BAD_LINES = {
    "bad_json": ('{"text": "unclosed', "not valid JSON"),
    "missing_field": ('{"title": "no text"}', "no field 'text'"),
    "wrong_type": ('{"text": 42}', "field 'text' is int"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_jsonl_bad_line_error_and_skip(case: str, tmp_path: Path, make_spec, dask_client: Client) -> None:
    bad_line, why = BAD_LINES[case]
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(30)]
    lines.insert(12, bad_line)
    bad = tmp_path / "books" / "a.jsonl.gz"
    _write_jsonl(bad, lines)
    _write_jsonl(tmp_path / "books" / "b.jsonl", [json.dumps({"text": "fine"})])

    with pytest.raises(SourceDataError, match=why) as exc:
        build_index(make_spec(_books("error")), dask_client)
    assert (exc.value.path, exc.value.row) == (str(bad), 12)
    assert "line 13" in str(exc.value)

    spec = make_spec(_books("skip"))
    s = build_index(spec, dask_client).sources["books"]
    assert (s.shards, s.samples, s.skipped) == (2, 31, 1)
    assert s.tokens == sum(len(f"doc {i}") for i in range(30)) + 4
    (err,) = read_table(IndexFiles.of(spec.workdir, "books").errors, TableKind.ERRORS).to_pylist()
    assert err["path"] == str(bad) and err["row"] == 12 and why in err["message"]


def test_jsonl_truncated_compressed_shard_is_skipped_whole(tmp_path: Path, make_spec, dask_client: Client) -> None:
    lines = [json.dumps({"text": "x" * 300 + str(i)}) for i in range(400)]
    bad = tmp_path / "books" / "a.jsonl.zst"
    _write_jsonl(bad, lines)
    bad.write_bytes(bad.read_bytes()[:200])
    _write_jsonl(tmp_path / "books" / "b.jsonl", lines[:5])
    spec = make_spec(_books("skip"))
    s = build_index(spec, dask_client).sources["books"]
    assert (s.shards, s.samples, s.skipped) == (1, 5, 1)
    (err,) = read_table(IndexFiles.of(spec.workdir, "books").errors, TableKind.ERRORS).to_pylist()
    assert err["path"] == str(bad) and err["row"] is None and "truncated or corrupt" in err["message"]
    with pytest.raises(SourceDataError, match="truncated or corrupt"):
        build_index(make_spec(_books("error")), dask_client)


def _megatron(prefix: Path, docs: list[list[np.ndarray]]) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for sentences in docs:
        for s in sentences:
            builder.add_item(torch.from_numpy(s.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def _docs(seed: int, n: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, 60_000, size=int(k)) for k in rng.integers(1, 300, size=int(m))]
        for m in rng.integers(1, 4, size=n)
    ]


def test_megatron_sequences_documents_and_incremental_bin_change(
    tmp_path: Path, make_spec, dask_client: Client
) -> None:
    docs = {p: _docs(i, 40 + 10 * i) for i, p in enumerate(["m0", "m1"])}
    for p, d in docs.items():
        _megatron(tmp_path / "papers" / p, d)
    source = {"name": "papers", "format": "megatron", "paths": ["papers/*"], "metadata": ["document"]}
    spec = make_spec(source)
    s = build_index(spec, dask_client, part_bytes=512).sources["papers"]
    lengths = [len(x) for p in docs for d in docs[p] for x in d]
    doc_of = [j for p in docs for j, d in enumerate(docs[p]) for _ in d]
    assert (s.shards, s.samples, s.tokens) == (2, len(lengths), sum(lengths))
    samples, shards, _ = read_index(spec.workdir, "papers")
    assert samples.column("num_tokens").to_pylist() == lengths
    assert samples.column("document").to_pylist() == doc_of
    assert shards.column("path").to_pylist() == [str(tmp_path / "papers" / p) for p in docs]
    m1 = tmp_path / "papers" / "m1"
    assert shards.column("size_bytes").to_pylist()[1] == sum(os.path.getsize(f"{m1}.{e}") for e in ("idx", "bin"))

    # A change to the .bin alone (same size, same mtime) in its first 64 KiB: the prefix is rescanned.
    bin_path = Path(f"{m1}.bin")
    st = os.stat(bin_path)
    data = bytearray(bin_path.read_bytes())
    data[0] ^= 1
    bin_path.write_bytes(bytes(data))
    os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = build_index(spec, dask_client).sources["papers"]
    assert (again.rescanned, again.reused) == (1, 1)
    assert again.fingerprint != s.fingerprint


def test_megatron_truncated_bin_error_and_skip(tmp_path: Path, make_spec, dask_client: Client) -> None:
    _megatron(tmp_path / "papers" / "ok", _docs(1, 10))
    bad = tmp_path / "papers" / "bad"
    _megatron(bad, _docs(2, 10))
    Path(f"{bad}.bin").write_bytes(Path(f"{bad}.bin").read_bytes()[:100])
    source = {"name": "papers", "format": "megatron", "paths": ["papers/*"]}
    with pytest.raises(SourceDataError) as exc:
        build_index(make_spec(source), dask_client)
    assert str(bad) in exc.value.path
    spec = make_spec({**source, "on_error": "skip"})
    s = build_index(spec, dask_client).sources["papers"]
    assert (s.shards, s.skipped) == (1, 1)
    (err,) = read_table(IndexFiles.of(spec.workdir, "papers").errors, TableKind.ERRORS).to_pylist()
    assert err["path"] == str(bad) and err["row"] is None


def test_generated_corpus_all_five_sources(tmp_path: Path, make_spec, dask_client: Client) -> None:
    """The seeded demo corpus, all formats in one job: sample counts match what the generator wrote."""
    from loomdata.testing import generate_corpus

    corpus = generate_corpus(tmp_path / "c", "tiny", seed=1)
    sources = [
        {"name": "web", "format": "parquet", "paths": ["c/web/*.parquet"], "tokens_field": "input_ids"},
        {"name": "code", "format": "parquet", "paths": ["c/code/*.parquet"], "text_field": "text"},
        {"name": "books", "format": "jsonl", "paths": ["c/books/*.jsonl*"], "text_field": "text"},
        {"name": "papers", "format": "megatron", "paths": ["c/papers/*.idx"]},
        {
            "name": "captions",
            "format": "webdataset",
            "paths": ["c/captions/*.tar"],
            "text_field": "txt",
            "image_field": ["jpg", "png"],
        },
    ]
    summary = build_index(make_spec(*sources), dask_client)
    for name, s in summary.sources.items():
        assert (s.samples, s.shards, s.skipped) == (corpus.sources[name].samples, corpus.sources[name].files, 0), name
        assert s.tokens > 0
    assert summary.sources["captions"].image_tokens > 0
    assert all(s.image_tokens == 0 for n, s in summary.sources.items() if n != "captions")
