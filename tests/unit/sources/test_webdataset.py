"""WebDataset shards written by webdataset.TarWriter with real Pillow images; our writer read by webdataset."""

from __future__ import annotations

import gzip
import io
import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import webdataset as wds
from PIL import Image

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec, OnError, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import make_reader
from loomdata.sources.images import image_tokens
from loomdata.sources.webdataset import WebDatasetReader
from loomdata.testing import write_webdataset_shard

SPEC = ImageSpec(patch_size=14, max_pixels=200_704, placeholder_token_id=32_000)
SIZES = [(640, 480), (37, 91), (1200, 300), (14, 14), (450, 445), (100, 50), (300, 800)]


def image_bytes(w: int, h: int, fmt: str, colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format=fmt)
    return buf.getvalue()


def make_samples(n: int = 14) -> list[dict[str, Any]]:
    """Text-only, JPEG-only, PNG-only and JPEG+PNG samples of varied sizes, with unicode text."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        s: dict[str, Any] = {"__key__": f"s{i:04d}", "txt": f"caption {i} héllo ✓ " * (i % 5 + 1), "cls": str(i % 3)}
        w, h = SIZES[i % len(SIZES)]
        if i % 4 in (1, 3):
            s["jpg"] = image_bytes(w, h, "JPEG", (10 * i % 256, 50, 200))
        if i % 4 in (2, 3):
            s["png"] = image_bytes(h, w, "PNG", (200, 10 * i % 256, 50))
        out.append(s)
    return out


def expected_image_tokens(s: dict[str, Any]) -> list[int]:
    """Image tokens from the sizes the sample was generated with (jpg before png, as image_field lists)."""
    i = int(s["__key__"][1:])
    w, h = SIZES[i % len(SIZES)]
    out = []
    if "jpg" in s:
        out.append(image_tokens(w, h, SPEC))
    if "png" in s:
        out.append(image_tokens(h, w, SPEC))
    return out


def write_with_tarwriter(path: Path, samples: list[dict[str, Any]]) -> None:
    with wds.TarWriter(str(path), encoder=False, mtime=0) as tw:
        for s in samples:
            tw.write({k: (v.encode() if isinstance(v, str) and k != "__key__" else v) for k, v in s.items()})


def reader(
    on_error: OnError = OnError.ERROR, metadata: list[str] | None = None, images: list[str] | None = None
) -> WebDatasetReader:
    src = SourceSpec(
        name="wd",
        format=SourceFormat.WEBDATASET,
        paths=["x"],
        text_field="txt",
        image_field=["jpg", "png"] if images is None else images,
        metadata=metadata or [],
        on_error=on_error,
    )
    r = make_reader(src, TokenizerSpec(), SPEC)
    assert isinstance(r, WebDatasetReader)
    return r


def first_member_offsets(path: Path) -> dict[str, int]:
    """Offset of each key's first member header, straight from tarfile."""
    out: dict[str, int] = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            out.setdefault(m.name.split(".", 1)[0], m.offset)
    return out


@pytest.fixture
def shard(tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    samples = make_samples()
    path = tmp_path / "shard-000.tar"
    write_with_tarwriter(path, samples)
    return path, samples


def test_scan_counts_text_and_image_tokens(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, samples = shard
    r = reader(metadata=["__key__", "cls", "json"])
    assert r.num_parts(path, 1) == 1
    res = r.scan(path, 0, 1)
    assert res.errors == []
    t = res.rows
    assert t.column_names == ["row", "num_tokens", "num_image_tokens", "checksum", "__key__", "cls", "json"]
    assert t.schema.field("row").type == pa.uint64()
    offsets = first_member_offsets(path)
    assert t.column("__key__").to_pylist() == [s["__key__"] for s in samples]
    assert t.column("row").to_pylist() == [offsets[s["__key__"]] for s in samples]
    img = [sum(expected_image_tokens(s)) for s in samples]
    assert t.column("num_image_tokens").to_pylist() == img
    assert t.column("num_tokens").to_pylist() == [len(s["txt"].encode()) + k for s, k in zip(samples, img, strict=True)]
    assert t.column("cls").to_pylist() == [s["cls"] for s in samples]
    assert t.column("json").null_count == len(samples)  # absent extension: null, not an error
    assert sum(img) > 0 and min(img) == 0  # the fixture mixes text-only and image samples


def test_hand_computed_image_tokens_in_a_sample(tmp_path: Path) -> None:
    path = tmp_path / "one.tar"
    write_with_tarwriter(path, [{"__key__": "a", "txt": "abc", "jpg": image_bytes(640, 480, "JPEG", (0, 0, 0))}])
    t = reader().scan(path, 0, 1).rows
    assert t.column("num_image_tokens").to_pylist() == [972]  # 36 x 27 patches, see test_images
    assert t.column("num_tokens").to_pylist() == [975]


def test_read_returns_placeholders_then_text_and_resized_images(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, samples = shard
    r = reader()
    t = r.scan(path, 0, 1).rows
    rows = t.column("row").to_numpy()
    order = np.array([3, 0, 13, 3, 7, 2])
    got = r.read(path, rows[order])
    for i, sample in zip(order.tolist(), got, strict=True):
        s = samples[i]
        per_image = expected_image_tokens(s)
        n_img = sum(per_image)
        assert sample.tokens.dtype == np.int32
        assert len(sample.tokens) == t.column("num_tokens")[i].as_py()
        assert (sample.tokens[:n_img] == SPEC.placeholder_token_id).all()
        assert sample.tokens[n_img:].tolist() == list(s["txt"].encode())
        assert len(sample.images) == len(per_image)
        for arr, k in zip(sample.images, per_image, strict=True):
            assert arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3
            assert (arr.shape[0] // 14) * (arr.shape[1] // 14) == k
        if "jpg" in s:
            want = np.array([10 * i % 256, 50, 200])
            assert np.abs(sample.images[0].reshape(-1, 3).mean(axis=0) - want).max() < 4
    assert r.read(path, np.array([], dtype=np.uint64)) == []
    r.close()


def test_image_field_order_and_subset(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, samples = shard
    only_png = reader(images=["png"]).scan(path, 0, 1).rows
    want = [image_tokens(*SIZES[i % len(SIZES)][::-1], SPEC) if "png" in s else 0 for i, s in enumerate(samples)]
    assert only_png.column("num_image_tokens").to_pylist() == want
    # both images: png first when image_field says so
    r = reader(images=["png", "jpg"])
    i = 3  # has jpg (640x480) and png (480x640... same token count, transposed shape)
    row = r.scan(path, 0, 1).rows.column("row")[i].as_py()
    imgs = r.read(path, np.array([row]))[0].images
    assert imgs[0].mean(axis=(0, 1))[0] > 150  # the png is red-dominant, the jpg blue-dominant
    assert imgs[1].mean(axis=(0, 1))[2] > 150


def test_our_writer_is_read_identically_by_webdataset(tmp_path: Path) -> None:
    samples = make_samples(9)
    samples[2]["seg.txt"] = "a multi-dot extension"
    path = tmp_path / "ours.tar"
    assert write_webdataset_shard(path, samples) == 9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seen = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [d["__key__"] for d in seen] == [s["__key__"] for s in samples]
    for d, s in zip(seen, samples, strict=True):
        payload = {k: v for k, v in d.items() if not k.startswith("__")}
        want = {k: (v.encode() if isinstance(v, str) else v) for k, v in s.items() if k != "__key__"}
        assert payload == want
    # and our reader agrees with a TarWriter shard of the same samples, sample by sample
    ref = tmp_path / "ref.tar"
    write_with_tarwriter(ref, samples)
    a, b = reader(metadata=["__key__"]).scan(path, 0, 1).rows, reader(metadata=["__key__"]).scan(ref, 0, 1).rows
    assert a.drop_columns(["row"]).equals(b.drop_columns(["row"]))
    # deterministic: the same samples give the same bytes
    again = tmp_path / "again.tar"
    write_webdataset_shard(again, samples)
    assert again.read_bytes() == path.read_bytes()


def test_writer_refuses_ambiguous_keys_and_payloads(tmp_path: Path) -> None:
    p = tmp_path / "x.tar"
    with pytest.raises(ValueError, match=r"without '\.' in its basename"):
        write_webdataset_shard(p, [{"__key__": "a.b", "txt": "x"}])
    with pytest.raises(ValueError, match="repeats the previous sample's key"):
        write_webdataset_shard(p, [{"__key__": "a", "txt": "x"}, {"__key__": "a", "txt": "y"}])
    with pytest.raises(ValueError, match="bad extension '_meta'"):
        write_webdataset_shard(p, [{"__key__": "a", "_meta": "x"}])
    with pytest.raises(TypeError, match="payload must be bytes or str"):
        not_bytes: Any = 3
        write_webdataset_shard(p, [{"__key__": "a", "txt": not_bytes}])
    assert not list(tmp_path.iterdir())


def test_keys_with_folders_dots_and_pax_headers(tmp_path: Path) -> None:
    """Webdataset's key rule on names tarfile writes in PAX format (long names need extra headers)."""
    long_dir = "d" * 150
    path = tmp_path / "pax.tar"
    members = [
        (f"{long_dir}/k1.txt", b"one"),
        (f"{long_dir}/k1.meta.json", b"{}"),
        ("sub/k2.TXT", b"two!"),  # extensions are lower-cased
        ("sub", None),  # a directory in between is skipped
        ("__index__", b"ignored"),  # webdataset metadata member, skipped
        ("k3.txt", b"three"),
    ]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            if data is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    r = reader(metadata=["__key__", "meta.json"])
    t = r.scan(path, 0, 1).rows
    assert t.column("__key__").to_pylist() == [f"{long_dir}/k1", "sub/k2", "k3"]
    assert t.column("num_tokens").to_pylist() == [3, 4, 5]
    assert t.column("meta.json").to_pylist() == ["{}", None, None]
    got = r.read(path, t.column("row").to_numpy()[::-1])
    assert [bytes(s.tokens.astype(np.uint8)) for s in got] == [b"three", b"two!", b"one"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [d["__key__"] for d in wds.WebDataset(str(path), shardshuffle=False)] == t.column("__key__").to_pylist()


# ---- bad input ------------------------------------------------------------------------------------


def test_truncated_tar(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, _ = shard
    raw = path.read_bytes()
    offsets = sorted(first_member_offsets(path).values())
    cases = {
        # s0005's members: cls (header + 1 block), then jpg: cut inside the jpg's data
        "mid-member": (raw[: offsets[5] + 1024 + 600], r"truncated tar: member 's0005\.jpg' at byte \d+ needs"),
        "at a member boundary": (raw[: offsets[5]], rf"truncated tar: no end-of-archive marker at byte {offsets[5]}"),
        "mid-header": (raw[: offsets[5] + 100], rf"truncated tar: partial header at byte {offsets[5]}"),
    }
    for data, pattern in cases.values():
        path.write_bytes(data)
        for mode in OnError:  # a whole-shard problem raises in both modes; the index job skips the shard
            with pytest.raises(SourceDataError, match=pattern) as e:
                reader(on_error=mode).scan(path, 0, 1)
            assert e.value.path == str(path)


def test_corrupt_header_and_not_a_tar(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, _ = shard
    raw = bytearray(path.read_bytes())
    third = sorted(first_member_offsets(path).values())[2]
    raw[third : third + 8] = b"garbage!"
    path.write_bytes(bytes(raw))
    with pytest.raises(SourceDataError, match=rf"corrupt tar header at byte {third}"):
        reader().scan(path, 0, 1)
    path.write_bytes(np.random.default_rng(0).bytes(5000))
    with pytest.raises(SourceDataError, match="not a readable tar file"):
        reader().scan(path, 0, 1)
    path.write_bytes(b"")
    with pytest.raises(SourceDataError, match="not a readable tar file"):
        reader().scan(path, 0, 1)
    with pytest.raises(SourceDataError, match="cannot open the tar shard"):
        reader().scan(path.with_name("missing.tar"), 0, 1)


def test_compressed_tar_is_refused_with_a_fix(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    path, _ = shard
    gz = path.with_suffix(".tar.gz")
    gz.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(SourceDataError, match=r"gzip-compressed tar: .*decompress the shard"):
        reader().scan(gz, 0, 1)


def bad_samples() -> list[dict[str, Any]]:
    samples = make_samples(8)
    del samples[2]["txt"]  # no text member
    samples[4]["jpg"] = b"\xff\xd8 this is not a jpeg"  # undecodable image header
    samples[6]["txt"] = b"\xff\xfe not utf-8"
    return samples


@pytest.mark.parametrize(
    ("index", "pattern"),
    [
        (2, r"sample 's0002' at byte \d+: no \.txt member \(text_field\); members: cls, png"),
        (4, r"sample 's0004' at byte \d+: \.jpg member is not a readable image \(UnidentifiedImageError"),
        (6, r"sample 's0006' at byte \d+: \.txt member is not UTF-8 text"),
    ],
)
def test_bad_samples_raise_naming_tar_key_and_offset(tmp_path: Path, index: int, pattern: str) -> None:
    samples = bad_samples()
    good = [s for i, s in enumerate(samples) if i in (0, 1, index)]
    path = tmp_path / "bad.tar"
    write_with_tarwriter(path, good)
    with pytest.raises(SourceDataError, match=pattern) as e:
        reader().scan(path, 0, 1)
    assert e.value.path == str(path)
    assert e.value.row == first_member_offsets(path)[samples[index]["__key__"]]


def test_skip_mode_counts_and_leaves_out_bad_samples(tmp_path: Path) -> None:
    samples = bad_samples()
    path = tmp_path / "bad.tar"
    write_with_tarwriter(path, samples)
    res = reader(on_error=OnError.SKIP, metadata=["__key__"]).scan(path, 0, 1)
    offsets = first_member_offsets(path)
    assert [row for row, _ in res.errors] == [offsets["s0002"], offsets["s0004"], offsets["s0006"]]
    assert all(msg.startswith("sample 's000") for _, msg in res.errors)
    assert res.rows.column("__key__").to_pylist() == ["s0000", "s0001", "s0003", "s0005", "s0007"]
    kept = [samples[i] for i in (0, 1, 3, 5, 7)]
    want = [len(s["txt"].encode()) + sum(expected_image_tokens(s)) for s in kept]
    assert res.rows.column("num_tokens").to_pylist() == want


def test_duplicate_member_in_a_sample(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tf:
        for name, data in [("a.txt", b"x"), ("a.TXT", b"y"), ("b.txt", b"z")]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    with pytest.raises(SourceDataError, match=r"sample 'a' at byte 0: duplicate member 'a\.TXT'"):
        reader().scan(path, 0, 1)
    res = reader(on_error=OnError.SKIP).scan(path, 0, 1)
    assert len(res.errors) == 1 and res.rows.column("num_tokens").to_pylist() == [1]


def test_read_at_a_stale_offset_and_a_truncated_image(tmp_path: Path) -> None:
    png = image_bytes(300, 200, "PNG", (1, 2, 3))
    samples: list[dict[str, Any]] = [
        {"__key__": "a", "txt": "hi", "png": png[: len(png) // 2]},
        {"__key__": "b", "txt": "yo"},
    ]
    path = tmp_path / "t.tar"
    write_with_tarwriter(path, samples)
    r = reader()
    t = r.scan(path, 0, 1).rows  # the header is intact, so the scan counts it
    assert t.column("num_image_tokens").to_pylist() == [image_tokens(300, 200, SPEC), 0]
    with pytest.raises(SourceDataError, match=r"t\.tar:a\.png: cannot decode image"):
        r.read(path, t.column("row").to_numpy()[:1])
    b_row = t.column("row")[1].as_py()
    for bad, pattern in [(b_row + 512, "corrupt tar header|no sample starts"), (7, "not a member header offset")]:
        with pytest.raises(SourceDataError, match=rf"row {bad}: .*(?:{pattern}).*re-run `loom index`"):
            r.read(path, np.array([bad]))
    assert r.read(path, np.array([b_row]))[0].tokens.tolist() == list(b"yo")


def test_reader_sees_a_rewritten_shard(tmp_path: Path) -> None:
    path = tmp_path / "r.tar"
    write_webdataset_shard(path, [{"__key__": "a", "txt": "first"}])
    r = reader()
    assert r.read(path, np.array([0]))[0].tokens.tolist() == list(b"first")
    write_webdataset_shard(path, [{"__key__": "a", "txt": "second version"}])
    assert r.read(path, np.array([0]))[0].tokens.tolist() == list(b"second version")


def _bytes_read() -> int:
    """Bytes this process has read through read(2) so far (Linux /proc accounting)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc I/O accounting")
def test_scan_reads_image_headers_not_pixels(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples: list[dict[str, Any]] = []
    for i in range(12):
        noise = Image.fromarray(rng.integers(0, 255, (400, 500, 3), dtype=np.uint8))
        buf = io.BytesIO()
        noise.save(buf, format="PNG" if i % 2 else "JPEG", quality=95)
        samples.append({"__key__": f"k{i}", "txt": "short", "png" if i % 2 else "jpg": buf.getvalue()})
    path = tmp_path / "big.tar"
    write_webdataset_shard(path, samples)
    size = path.stat().st_size
    assert size > 12 * 100_000  # noise does not compress: the images dominate the file
    reader().scan(path, 0, 1)  # warm up: the first scan also reads Pillow's plugin modules from disk
    before = _bytes_read()
    t = reader().scan(path, 0, 1).rows
    read = _bytes_read() - before
    assert t.column("num_image_tokens").to_pylist() == [image_tokens(500, 400, SPEC)] * 12
    assert read < size / 10, f"scan read {read} of {size} bytes"  # measured: about 3%


def test_concurrent_reads_from_threads_agree(shard: tuple[Path, list[dict[str, Any]]]) -> None:
    """Dask may call one reader from several threads; the shared file position must not mix samples up."""
    from concurrent.futures import ThreadPoolExecutor

    path, _ = shard
    r = reader(images=[])  # text only: the race is in file access, image decoding only slows the test
    rows = r.scan(path, 0, 1).rows.column("row").to_numpy()
    want = [s.tokens.tolist() for s in r.read(path, rows)]
    batches = [np.roll(rows, k)[:5] for k in range(96)]  # without the lock this fails most runs
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: [s.tokens.tolist() for s in r.read(path, b)], batches))
    for k, g in enumerate(got):
        assert g == [want[i] for i in np.roll(np.arange(len(rows)), k % len(rows))[:5]]
