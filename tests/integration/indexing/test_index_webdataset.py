"""build_index on WebDataset tars written by webdataset.TarWriter with real Pillow images."""

from __future__ import annotations

import gzip
import io
import math
from pathlib import Path

import pytest
import webdataset as wds
from distributed import Client
from PIL import Image

from loomdata.indexing import build_index
from loomdata.schemas import IndexFiles, SourceDataError, TableKind, read_index, read_table

SIZES = [(640, 480), (37, 91), (1200, 300), (14, 14), (450, 445), (100, 50)]


def _image(w: int, h: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (w % 255, h % 255, 90)).save(buf, format=fmt)
    return buf.getvalue()


def _tokens(w: int, h: int, patch: int, max_pixels: int) -> int:
    """Image tokens by the documented rule (sources/images.py), computed here in plain Python."""
    s = min(1.0, math.sqrt(max_pixels / (w * h)))
    gw, gh = max(math.ceil(w * s / patch), 1), max(math.ceil(h * s / patch), 1)
    if gw * gh * patch * patch > max_pixels:
        gw, gh = max(math.floor(w * s / patch), 1), max(math.floor(h * s / patch), 1)
    return gw * gh


def _write_shard(path: Path, start: int, n: int, drop_text_at: int | None = None) -> list[tuple[str, tuple[int, int]]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    with wds.TarWriter(str(path)) as sink:
        for i in range(start, start + n):
            w, h = SIZES[i % len(SIZES)]
            caption = f"caption {i} " * (i % 5 + 1)
            sample: dict[str, object] = {"__key__": f"s{i:05d}", "jpg": _image(w, h, "JPEG")}
            if i != drop_text_at:
                sample["txt"] = caption
            sink.write(sample)
            written.append((caption, (w, h)))
    return written


def _source(on_error: str = "error") -> dict[str, object]:
    return {
        "name": "captions",
        "format": "webdataset",
        "paths": ["caps/*.tar"],
        "text_field": "txt",
        "image_field": ["jpg"],
        "on_error": on_error,
    }


def test_webdataset_image_and_text_tokens_and_patch_size_change(tmp_path: Path, make_spec, dask_client: Client) -> None:
    truth = _write_shard(tmp_path / "caps" / "a.tar", 0, 9) + _write_shard(tmp_path / "caps" / "b.tar", 9, 7)
    spec = make_spec(_source(), images={"patch_size": 14, "max_pixels": 50176})
    s = build_index(spec, dask_client).sources["captions"]
    image_tokens = [_tokens(w, h, 14, 50176) for _, (w, h) in truth]
    text_tokens = [len(c.encode()) for c, _ in truth]
    assert (s.shards, s.samples, s.image_tokens) == (2, 16, sum(image_tokens))
    assert s.tokens == sum(image_tokens) + sum(text_tokens)
    samples, _, _ = read_index(spec.workdir, "captions")
    assert samples.column("num_image_tokens").to_pylist() == image_tokens
    assert samples.column("num_tokens").to_pylist() == [a + b for a, b in zip(image_tokens, text_tokens, strict=True)]

    bigger = make_spec(_source(), images={"patch_size": 28, "max_pixels": 50176})
    s2 = build_index(bigger, dask_client).sources["captions"]
    assert (s2.rescanned, s2.image_tokens) == (2, sum(_tokens(w, h, 28, 50176) for _, (w, h) in truth))
    assert s2.fingerprint != s.fingerprint


def test_webdataset_bad_sample_and_compressed_shard(tmp_path: Path, make_spec, dask_client: Client) -> None:
    _write_shard(tmp_path / "caps" / "a.tar", 0, 6, drop_text_at=3)
    gz = tmp_path / "caps" / "c.tar"
    _write_shard(tmp_path / "tmp" / "c.tar", 20, 2)
    gz.write_bytes(gzip.compress((tmp_path / "tmp" / "c.tar").read_bytes()))

    only_a = {**_source("error"), "paths": ["caps/a.tar"]}
    with pytest.raises(SourceDataError, match=r"sample 's00003' at byte \d+: no \.txt member") as exc:
        build_index(make_spec(only_a), dask_client)
    assert exc.value.path == str(tmp_path / "caps" / "a.tar") and exc.value.row is not None
    only_c = {**_source("error"), "paths": ["caps/c.tar"]}
    with pytest.raises(SourceDataError, match="gzip-compressed tar") as exc:
        build_index(make_spec(only_c), dask_client)
    assert exc.value.path == str(gz)

    spec = make_spec(_source("skip"))
    s = build_index(spec, dask_client).sources["captions"]
    assert (s.shards, s.samples, s.skipped) == (1, 5, 2)
    errors = read_table(IndexFiles.of(spec.workdir, "captions").errors, TableKind.ERRORS).to_pylist()
    assert [(e["path"], e["row"] is None) for e in errors] == [
        (str(tmp_path / "caps" / "a.tar"), False),
        (str(gz), True),
    ]
    assert "gzip-compressed tar" in errors[1]["message"]
    samples, _, _ = read_index(spec.workdir, "captions")
    assert errors[0]["row"] not in samples.column("row").to_pylist()
