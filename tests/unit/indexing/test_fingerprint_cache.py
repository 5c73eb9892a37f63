"""Shard fingerprints, scan-config hashes and the per-shard scan cache (no cluster)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.indexing import fingerprint_file
from loomdata.indexing._cache import ShardScan, load_scan, store_scan
from loomdata.indexing._fingerprint import (
    cache_key,
    index_fingerprint,
    samples_content_hash,
    scan_config_hash,
    stat_shard,
)
from loomdata.schemas import SourceDataError, SourceFormat, Spec, parse_spec

KIB = 1024


def _rewrite_keep_mtime(path: Path, data: bytes) -> None:
    st = os.stat(path)
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_fingerprint_is_content_head_tail_size_and_the_cache_key_adds_path_and_mtime(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    data = bytearray(os.urandom(300 * KIB))
    path.write_bytes(bytes(data))
    fp = fingerprint_file(path)
    assert fp == fingerprint_file(path)  # stable

    for offset in (10, len(data) - 10):  # a byte in the first or the last 64 KiB
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        _rewrite_keep_mtime(path, bytes(changed))
        assert fingerprint_file(path) != fp
    # The middle is not read (the cost is bounded per shard); size and mtime guard normal rewrites.
    changed = bytearray(data)
    changed[150 * KIB] ^= 0xFF
    _rewrite_keep_mtime(path, bytes(changed))
    assert fingerprint_file(path) == fp

    _rewrite_keep_mtime(path, bytes(data) + b"x")
    assert fingerprint_file(path) != fp
    _rewrite_keep_mtime(path, bytes(data))
    assert fingerprint_file(path) == fp
    key = cache_key(stat_shard(path), "cfg")
    assert cache_key(stat_shard(path), "cfg") == key
    assert cache_key(stat_shard(path), "other") != key
    # Identity is content: a touched or moved file keeps its fingerprint; the scan cache sees both changes.
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert fingerprint_file(path) == fp
    touched = cache_key(stat_shard(path), "cfg")
    assert touched != key
    moved = path.rename(tmp_path / "b.bin")
    assert fingerprint_file(moved) == fp
    assert cache_key(stat_shard(moved), "cfg") != touched
    # The same bytes elsewhere: the same fingerprint.
    copy = tmp_path / "sub" / "c.bin"
    copy.parent.mkdir()
    copy.write_bytes(bytes(data))
    assert fingerprint_file(copy) == fp


def test_small_file_and_megatron_prefix(tmp_path: Path) -> None:
    (tmp_path / "p.idx").write_bytes(b"idx")
    (tmp_path / "p.bin").write_bytes(b"bin")
    stat = stat_shard(tmp_path / "p", SourceFormat.MEGATRON)
    assert stat.size_bytes == 6
    assert stat.mtime_ns == max(os.stat(tmp_path / f"p.{e}").st_mtime_ns for e in ("idx", "bin"))
    _rewrite_keep_mtime(tmp_path / "p.bin", b"BIN")
    assert fingerprint_file(tmp_path / "p", SourceFormat.MEGATRON) != stat.fingerprint
    (tmp_path / "p.bin").unlink()
    with pytest.raises(SourceDataError, match=r"p\.bin: cannot read the file"):
        stat_shard(tmp_path / "p", SourceFormat.MEGATRON)


def _spec(tmp: Path, tokenizer: dict[str, object] | None = None, **images: object) -> Spec:
    data: dict[str, object] = {
        "name": "t",
        "workdir": "w",
        "sources": [
            {"name": "web", "format": "parquet", "paths": ["x"], "tokens_field": "ids"},
            {"name": "code", "format": "parquet", "paths": ["x"], "text_field": "text"},
            {"name": "code_q", "format": "parquet", "paths": ["x"], "text_field": "text", "metadata": ["q"]},
            {"name": "img", "format": "webdataset", "paths": ["x"], "text_field": "txt", "image_field": "jpg"},
        ],
        "mixture": {"weights": {"web": 1}},
        "training": {"seq_len": 8, "steps": 1, "dp_size": 1},
        "images": images,
    }
    if tokenizer:
        data["tokenizer"] = tokenizer
    return parse_spec(data, tmp, check_paths=False)


def test_scan_config_hash_holds_exactly_the_fields_that_change_scan_output(tmp_path: Path) -> None:
    (tmp_path / "tok.json").write_text("{}")
    base = _spec(tmp_path)
    hf = _spec(tmp_path, {"kind": "huggingface", "path": "tok.json"})
    patch = _spec(tmp_path, patch_size=16)

    def h(spec: Spec, name: str) -> str:
        return scan_config_hash(spec, spec.source(name))

    assert h(base, "web") == h(hf, "web") == h(patch, "web")  # pre-tokenized: no tokenizer, no images
    assert h(base, "code") != h(hf, "code")
    assert h(base, "code") != h(base, "code_q")  # metadata list
    assert h(base, "img") != h(patch, "img")
    assert h(base, "code") == h(patch, "code")
    # The tokenizer file's content counts, not only its path.
    before = h(hf, "code")
    (tmp_path / "tok.json").write_text('{"other": 1}')
    assert h(hf, "code") != before
    # ... and only its content: the same tokenizer.json elsewhere, or another pad id, scans the same.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "tok.json").write_text('{"other": 1}')
    moved = _spec(tmp_path, {"kind": "huggingface", "path": "sub/tok.json"})
    padded = _spec(tmp_path, {"kind": "huggingface", "path": "tok.json", "pad_token_id": 7})
    assert h(moved, "code") == h(padded, "code") == h(hf, "code")


def test_index_fingerprint_depends_on_order_config_and_columns() -> None:
    assert index_fingerprint("c", ["a", "b"]) != index_fingerprint("c", ["b", "a"])
    assert index_fingerprint("c", ["a", "b"]) != index_fingerprint("d", ["a", "b"])
    assert index_fingerprint("c", ["ab"]) != index_fingerprint("c", ["a", "b"])
    assert index_fingerprint("c", ["a"], "x") != index_fingerprint("c", ["a"], "y")


def test_samples_content_hash_sees_every_index_column_not_chunking() -> None:
    cols = {
        "sample": pa.array([0, 1, 2], pa.uint64()),
        "shard": pa.array([0, 0, 1], pa.uint32()),
        "row": pa.array([0, 1, 0], pa.uint64()),
        "num_tokens": pa.array([5, 7, 9], pa.uint32()),
        "num_image_tokens": pa.array([0, 0, 4], pa.uint32()),
        "checksum": pa.array([11, 12, 13], pa.uint32()),
    }
    h = samples_content_hash(pa.table(cols))
    chunked = pa.concat_tables([pa.table(cols).slice(0, 1), pa.table(cols).slice(1)])
    assert samples_content_hash(chunked) == h
    for name in cols:
        changed = dict(cols)
        values = changed[name].to_pylist()
        values[1] += 1
        changed[name] = pa.array(values, changed[name].type)
        assert samples_content_hash(pa.table(changed)) != h, name


def test_cache_roundtrip_and_bad_files_are_misses(tmp_path: Path) -> None:
    rows = pa.table(
        {
            "row": pa.array([0, 2], pa.uint64()),
            "num_tokens": pa.array([5, 7], pa.uint32()),
            "num_image_tokens": pa.array([0, 0], pa.uint32()),
            "checksum": pa.array([1, 2], pa.uint32()),
            "lang": ["en", "de"],
        }
    )
    path = tmp_path / "_parts" / "k.parquet"
    store_scan(path, ShardScan(rows, [(1, "bad row"), (None, "x")], skipped=False))
    got = load_scan(path)
    assert got is not None
    assert got.rows.equals(rows) and got.errors == [(1, "bad row"), (None, "x")] and not got.skipped
    assert [p.name for p in path.parent.iterdir()] == ["k.parquet"]  # no temp file left behind

    assert load_scan(tmp_path / "missing.parquet") is None
    path.write_bytes(b"garbage")
    assert load_scan(path) is None
    pq.write_table(rows, path)  # a Parquet file, but not one of ours
    assert load_scan(path) is None


def test_a_cached_scan_of_another_checksum_definition_is_a_miss(tmp_path: Path) -> None:
    rows = pa.table({c: pa.array([1], pa.uint32()) for c in ("row", "num_tokens", "num_image_tokens", "checksum")})
    path = tmp_path / "k.parquet"
    store_scan(path, ShardScan(rows))
    assert load_scan(path) is not None
    table = pq.read_table(path)
    for name in (b"crc32-int32le", None):  # an older definition, or none recorded
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"loomdata.checksum"}
        if name is not None:
            meta[b"loomdata.checksum"] = name
        pq.write_table(table.replace_schema_metadata(meta), path)
        assert load_scan(path) is None
