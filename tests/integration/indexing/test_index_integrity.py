"""The index sees every change: rewrites that keep size and mtime, touched files, empty compressed files."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import zstandard
from distributed import Client

from loomdata.indexing import build_index
from loomdata.schemas import IndexFiles, SourceDataError, TableKind, read_table


def _jsonl(path: Path, lines: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list("abcdefgh"), size=int(n))) for n in rng.integers(400, 600, size=lines)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _source(pattern: str = "data/*.jsonl") -> dict[str, object]:
    return {"name": "books", "format": "jsonl", "paths": [pattern], "text_field": "text"}


def _split_middle_line(path: Path) -> None:
    """Split the middle line into two lines of the same total size (`{"text":"..."}` twice, one byte per newline)."""
    lines = path.read_bytes().split(b"\n")
    mid = len(lines) // 2
    line = lines[mid]
    text = json.loads(line)["text"]
    first = json.dumps({"text": text[:100]}).encode()
    rest = len(line) - len(first) - 1 - len(json.dumps({"text": ""}).encode())
    second = json.dumps({"text": text[100 : 100 + rest]}).encode()
    assert len(first) + 1 + len(second) == len(line)
    lines[mid : mid + 1] = [first, second]
    path.write_bytes(b"\n".join(lines))


def test_a_rewrite_keeping_size_and_mtime_is_rescanned(tmp_path: Path, make_spec, dask_client: Client) -> None:
    path = tmp_path / "data" / "b.jsonl"
    _jsonl(path, 400)
    assert path.stat().st_size > 3 * 64 * 1024  # the split line is outside the fingerprinted edges
    spec = make_spec(_source())
    first = build_index(spec, dask_client).sources["books"]
    assert first.samples == 400
    st = os.stat(path)
    _split_middle_line(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # what `cp -p` and `rsync -t` leave behind
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    again = build_index(spec, dask_client).sources["books"]
    assert (again.samples, again.rescanned) == (401, 1)
    assert again.fingerprint != first.fingerprint


def test_a_touched_file_keeps_its_identity_and_updates_the_shard_times(
    tmp_path: Path, make_spec, dask_client: Client
) -> None:
    path = tmp_path / "data" / "b.jsonl"
    _jsonl(path, 50)
    spec = make_spec(_source())
    first = build_index(spec, dask_client).sources["books"]
    os.utime(path, ns=(1, 10**18))
    again = build_index(spec, dask_client).sources["books"]
    assert again.fingerprint == first.fingerprint  # identity is content
    shards = read_table(IndexFiles.of(spec.workdir, "books").shards, TableKind.SHARDS)
    assert shards.column("mtime_ns").to_pylist() == [10**18]  # what loaders compare a shard with


def test_checksums_are_part_of_the_identity(tmp_path: Path, make_spec, dask_client: Client) -> None:
    """Same lengths and file edges, other tokens: the index fingerprint changes (plans on the old content go stale)."""
    path = tmp_path / "data" / "b.jsonl"
    _jsonl(path, 400, seed=1)
    spec = make_spec(_source())
    first = build_index(spec, dask_client).sources["books"]
    data = path.read_bytes()
    lo, hi = len(data) * 2 // 5, len(data) * 3 // 5
    path.write_bytes(data[:lo] + data[lo:hi].replace(b"a", b"b") + data[hi:])
    again = build_index(spec, dask_client).sources["books"]
    assert (again.samples, again.tokens) == (first.samples, first.tokens)
    assert again.fingerprint != first.fingerprint


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_zero_byte_compressed_file_is_a_bad_file(tmp_path: Path, make_spec, dask_client: Client, suffix: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / f"empty{suffix}").write_bytes(b"")
    good = b'{"text": "hello"}\n'
    (data / f"good{suffix}").write_bytes(gzip.compress(good) if suffix.endswith("gz") else zstandard.compress(good))
    with pytest.raises(SourceDataError, match=r"empty.*zero bytes"):
        build_index(make_spec(_source(f"data/*{suffix}")), dask_client)
    skip = {**_source(f"data/*{suffix}"), "on_error": "skip"}
    summary = build_index(make_spec(skip), dask_client).sources["books"]
    assert (summary.samples, summary.skipped) == (1, 1)
