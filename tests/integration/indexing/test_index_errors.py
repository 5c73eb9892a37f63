"""Bad input in build_index: `on_error: error` stops with the reader's error; `skip` skips, counts and lists."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.indexing import build_index
from loomdata.schemas import IndexFiles, SourceDataError, TableKind, read_index, read_table
from loomdata.sources import make_reader


def _good(path: Path, n: int = 20) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = [list(range(i + 1)) for i in range(n)]
    pq.write_table(pa.table({"ids": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=8)


def _corrupt(path: Path) -> None:
    path.write_bytes(b"PAR1" + bytes(range(256)) * 20)


def _truncated(path: Path) -> None:
    _good(path, 200)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _missing_field(path: Path) -> None:
    pq.write_table(pa.table({"other": pa.array([[1, 2]], pa.list_(pa.int32()))}), path)


def _wrong_type(path: Path) -> None:
    pq.write_table(pa.table({"ids": ["not", "tokens"]}), path)


BAD_SHARDS: dict[str, tuple[Callable[[Path], None], str]] = {
    "corrupt": (_corrupt, "not a readable Parquet file"),
    "truncated": (_truncated, "not a readable Parquet file"),
    "missing_field": (_missing_field, "no column 'ids'"),
    "wrong_type": (_wrong_type, "column 'ids' .*is string"),
}


def _source(on_error: str) -> dict[str, object]:
    return {
        "name": "web",
        "format": "parquet",
        "paths": ["data/*.parquet"],
        "tokens_field": "ids",
        "on_error": on_error,
    }


@pytest.mark.parametrize("case", sorted(BAD_SHARDS))
def test_bad_shard_stops_the_job_with_the_readers_error(
    case: str, tmp_path: Path, make_spec, dask_client: Client
) -> None:
    make, reason = BAD_SHARDS[case]
    _good(tmp_path / "data" / "a.parquet")
    bad = tmp_path / "data" / "b.parquet"
    make(bad)
    spec = make_spec(_source("error"))
    with pytest.raises(SourceDataError, match=reason) as exc:
        build_index(spec, dask_client)
    err = exc.value
    assert err.path == str(bad)
    assert str(err).startswith(f"{bad}: ")
    # The message is exactly the reader's own (with its "what to do" hint), as raised in-process.
    reader = make_reader(spec.source("web"), spec.tokenizer, spec.images)
    with pytest.raises(SourceDataError) as direct:
        reader.scan(bad, 0, reader.num_parts(bad, 64 << 20))
    assert (str(err), err.row, err.reason) == (str(direct.value), direct.value.row, direct.value.reason)
    assert not IndexFiles.of(spec.workdir, "web").samples.exists()

    # After the file is fixed the build succeeds; the good shard's scan may come from the cache.
    _good(bad, 5)
    s = build_index(spec, dask_client).sources["web"]
    assert (s.shards, s.samples, s.skipped) == (2, 25, 0)
    assert s.rescanned + s.reused == 2 and s.rescanned >= 1


@pytest.mark.parametrize("case", sorted(BAD_SHARDS))
def test_bad_shard_is_skipped_counted_and_listed(case: str, tmp_path: Path, make_spec, dask_client: Client) -> None:
    make, reason = BAD_SHARDS[case]
    _good(tmp_path / "data" / "a.parquet", 20)
    bad = tmp_path / "data" / "b.parquet"
    make(bad)
    _good(tmp_path / "data" / "c.parquet", 10)
    spec = make_spec(_source("skip"))
    s = build_index(spec, dask_client).sources["web"]
    assert (s.shards, s.samples, s.skipped, s.tokens) == (2, 30, 1, sum(range(1, 21)) + sum(range(1, 11)))
    files = IndexFiles.of(spec.workdir, "web")
    errors = read_table(files.errors, TableKind.ERRORS).to_pylist()
    assert len(errors) == 1
    assert errors[0]["path"] == str(bad) and errors[0]["row"] is None
    assert re.search(reason, errors[0]["message"])
    samples, shards, _ = read_index(spec.workdir, "web")
    assert shards.column("path").to_pylist() == [str(tmp_path / "data" / n) for n in ("a.parquet", "c.parquet")]
    assert samples.column("shard").to_pylist() == [0] * 20 + [1] * 10

    # The skip is cached like a scan: an unchanged bad shard is not scanned again, and still reported.
    again = build_index(spec, dask_client).sources["web"]
    assert (again.rescanned, again.skipped, again.fingerprint) == (0, 1, s.fingerprint)
    # Fixing it brings it in and removes the stale errors table.
    _good(bad, 4)
    fixed = build_index(spec, dask_client).sources["web"]
    assert (fixed.rescanned, fixed.shards, fixed.samples, fixed.skipped) == (1, 3, 34, 0)
    assert not files.errors.exists()


def _with_null_samples(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = [[1, 2], None, [3], [], None, [4, 5, 6]]
    pq.write_table(pa.table({"ids": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=2)


def test_bad_samples_stop_the_job_naming_the_row(tmp_path: Path, make_spec, dask_client: Client) -> None:
    bad = tmp_path / "data" / "a.parquet"
    _with_null_samples(bad)
    with pytest.raises(SourceDataError, match=r"row 1: column 'ids': null value") as exc:
        build_index(make_spec(_source("error")), dask_client)
    assert (exc.value.path, exc.value.row) == (str(bad), 1)


def test_bad_samples_are_skipped_counted_and_listed(tmp_path: Path, make_spec, dask_client: Client) -> None:
    bad = tmp_path / "data" / "a.parquet"
    _with_null_samples(bad)
    _good(tmp_path / "data" / "b.parquet", 3)
    spec = make_spec(_source("skip"))
    s = build_index(spec, dask_client, part_bytes=1).sources["web"]  # one part per row group
    assert (s.shards, s.samples, s.skipped, s.tokens) == (2, 7, 2, 6 + 6)
    errors = read_table(IndexFiles.of(spec.workdir, "web").errors, TableKind.ERRORS).to_pylist()
    assert [(e["path"], e["row"]) for e in errors] == [(str(bad), 1), (str(bad), 4)]
    assert all("null value" in e["message"] for e in errors)
    samples, _, _ = read_index(spec.workdir, "web")
    assert samples.column("row").to_pylist() == [0, 2, 3, 5, 0, 1, 2]
    assert samples.column("num_tokens").to_pylist() == [2, 1, 0, 3, 1, 2, 3]


def test_a_job_of_many_small_parts_finishes_and_counts_every_line(
    tmp_path: Path, make_spec, dask_client: Client
) -> None:
    """Hundreds of parts whose tasks are submitted while others finish (the loop once hung on such a job)."""
    from loomdata.indexing import build_index

    data = tmp_path / "data"
    data.mkdir()
    lines = [json.dumps({"text": "x" * (1 + i % 37)}) for i in range(3000)]
    (data / "a.jsonl").write_text("\n".join(lines) + "\n")
    spec = make_spec({"name": "books", "format": "jsonl", "paths": ["data/*.jsonl"], "text_field": "text"})
    summary = build_index(spec, dask_client, part_bytes=256)
    assert summary.sources["books"].samples == 3000
    samples, _, _ = read_index(spec.workdir, "books")
    assert samples.column("num_tokens").to_pylist() == [1 + i % 37 for i in range(3000)]


def test_a_bad_row_error_crosses_from_the_worker_with_file_row_and_hint(
    tmp_path: Path, make_spec, dask_client: Client
) -> None:
    """The SourceDataError raised in a worker process reaches the caller whole (path, row, hint), not rebuilt."""
    import struct

    import numpy as np

    from loomdata.sources.megatron import IDX_HEADER
    from loomdata.testing import write_megatron

    (tmp_path / "data").mkdir()
    prefix = tmp_path / "data" / "ds"
    write_megatron(prefix, [np.arange(1, 6) for _ in range(10)])
    idx = Path(f"{prefix}.idx")
    raw = bytearray(idx.read_bytes())
    at = IDX_HEADER.size + 4 * 10 + 8 * 3  # the pointer of sequence 3
    raw[at : at + 8] = struct.pack("<q", 2)
    idx.write_bytes(bytes(raw))
    spec = make_spec({"name": "papers", "format": "megatron", "paths": ["data/ds"]})
    with pytest.raises(SourceDataError) as exc:
        build_index(spec, dask_client)
    err = exc.value
    assert (err.path, err.row) == (str(idx), 3)
    assert str(err).startswith(f"{idx}, row 3: corrupt .idx: sequence pointer 2")
    assert err.hint is not None and "preprocess_data.py" in err.hint and err.hint in str(err)
