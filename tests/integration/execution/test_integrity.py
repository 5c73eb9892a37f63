"""Content-verified serving: a file changed, deleted or truncated after indexing fails the step, never serves.

Every case writes real files in one format, indexes and plans them with the real job and planner, changes
a file the way a user would (rewritten in place, mtime put back as `cp -p` or `rsync -t` do, deleted,
truncated) and streams every rank from a real executor on the session's LocalCluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.execution._loader import REQUEST_DTYPE, SourceLoader
from loomdata.execution._partition import partition_source
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import Batch, IndexFiles, LoomError, SourceDataError, Spec, parse_spec, read_plan
from loomdata.testing import write_megatron, write_webdataset_shard

_FIX = "the file changed after indexing: re-run `loom index` and `loom plan`"
_TEXT = "abcdefghijklmnopqrstuvwxyz"


def _spec(tmp: Path, source: dict[str, Any], **training: int) -> Spec:
    raw = {
        "name": "integrity",
        "workdir": str(tmp / "work"),
        "seed": 3,
        "sources": [source],
        "mixture": {"weights": {source["name"]: 1.0}},
        "training": {"seq_len": 512, "steps": 6, "dp_size": 2, "micro_batches": 2, **training},
    }
    return parse_spec(raw, tmp)


def _stream_all(plan_dir: Path, client: Client) -> list[Batch]:
    """Every batch of every rank, from a real executor (raises what a rank would see)."""
    meta = read_plan(plan_dir)
    out: list[Batch] = []
    with Executor(plan_dir, client, constructors=1):
        for r in range(meta.dp_size):
            with StreamClient(plan_dir, r, retry_s=20) as stream:
                out.extend(stream)
    return out


def _jsonl(path: Path, lines: int, seed: int) -> list[str]:
    """A plain JSONL file of `lines` texts of 300-600 letters (over 192 KiB for 500 lines)."""
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list(_TEXT), size=int(n))) for n in rng.integers(300, 600, size=lines)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def _keep_times(path: Path, change: Any) -> None:
    """Apply `change(path)` and put the file's atime and mtime back (what `cp -p`/`rsync -t` leave)."""
    st = os.stat(path)
    change(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _edit_middle_lines(path: Path) -> None:
    """Swap two letters in the texts of the middle fifth of the lines: same size, same first and last 64 KiB."""
    lines = path.read_bytes().split(b"\n")
    for i in range(len(lines) * 2 // 5, len(lines) * 3 // 5):
        lines[i] = lines[i].replace(b"a", b"#").replace(b"b", b"a").replace(b"#", b"b")
    path.write_bytes(b"\n".join(lines))


def _jsonl_case(tmp: Path, verify: str) -> tuple[Spec, Path]:
    path = tmp / "data" / "books.jsonl"
    _jsonl(path, 500, seed=1)
    assert path.stat().st_size > 3 * 64 * 1024  # the middle line is outside the fingerprinted edges
    source = {"name": "books", "format": "jsonl", "paths": [str(path)], "text_field": "text"}
    if verify != "sample":  # the default
        source["verify"] = verify
    return _spec(tmp, source, steps=60), path


def test_same_size_rewrite_with_kept_mtime_fails_the_step(dask_client: Client, tmp_path: Path) -> None:
    spec, path = _jsonl_case(tmp_path, "sample")
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    _keep_times(path, _edit_middle_lines)
    with pytest.raises(LoomError) as err:
        _stream_all(plan_dir, dask_client)
    msg = str(err.value)
    assert str(path) in msg and "sample " in msg and "checksum" in msg and _FIX in msg, msg


def test_verify_shard_and_off_do_not_see_a_kept_mtime_rewrite(dask_client: Client, tmp_path: Path) -> None:
    """What `verify: shard | off` give up: the same rewrite is served (so the default's check is what catches it)."""
    spec, path = _jsonl_case(tmp_path, "shard")
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    before = _stream_all(plan_dir, dask_client)
    _keep_times(path, _edit_middle_lines)
    after = _stream_all(plan_dir, dask_client)
    assert len(after) == len(before)
    assert any(not np.array_equal(a.input_ids, b.input_ids) for a, b in zip(after, before, strict=True))


def _parquet(tmp: Path) -> tuple[dict[str, Any], Path]:
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 30_000, size=int(n), dtype=np.int32) for n in rng.integers(20, 400, size=120)]
    path = tmp / "data" / "web.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"ids": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=16)
    return {"name": "web", "format": "parquet", "paths": [str(path)], "tokens_field": "ids"}, path


def _parquet_plus_one(path: Path) -> None:
    col = pq.read_table(path).column("ids").combine_chunks()
    bumped = pa.ListArray.from_arrays(col.offsets, pa.compute.add(col.values, 1))
    pq.write_table(pa.table({"ids": bumped}), path, row_group_size=16)


def _megatron(tmp: Path) -> tuple[dict[str, Any], Path]:
    rng = np.random.default_rng(6)
    prefix = tmp / "data" / "papers"
    prefix.parent.mkdir(parents=True)
    write_megatron(prefix, [rng.integers(1, 30_000, size=int(n)) for n in rng.integers(50, 900, size=400)])
    assert Path(f"{prefix}.bin").stat().st_size > 3 * 64 * 1024
    return {"name": "papers", "format": "megatron", "paths": [str(prefix)]}, Path(f"{prefix}.bin")


def _megatron_plus_seven(path: Path) -> None:
    """Tokens + 7 in the middle third of the .bin (uint16): same size, same edges."""
    data = np.fromfile(path, dtype="<u2")
    third = len(data) // 3
    data[third : 2 * third] += 7
    data.tofile(path)


def _webdataset(tmp: Path) -> tuple[dict[str, Any], Path]:
    path = tmp / "data" / "caps.tar"
    path.parent.mkdir(parents=True)
    write_webdataset_shard(path, [{"__key__": f"s{i:04d}", "txt": f"a caption number {i} " * 5} for i in range(150)])
    return {"name": "caps", "format": "webdataset", "paths": [str(path)], "text_field": "txt"}, path


def _recase(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b"a caption", b"A CAPTION"))


@pytest.mark.parametrize(
    ("make", "change"),
    [(_parquet, _parquet_plus_one), (_megatron, _megatron_plus_seven), (_webdataset, _recase)],
    ids=["parquet", "megatron", "webdataset"],
)
def test_every_format_refuses_changed_tokens(dask_client: Client, tmp_path: Path, make: Any, change: Any) -> None:
    source, path = make(tmp_path)
    spec = _spec(tmp_path, source, steps=10)
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    _keep_times(path, change)
    with pytest.raises(LoomError) as err:
        _stream_all(plan_dir, dask_client)
    assert str(path.with_suffix("")) in str(err.value) and _FIX in str(err.value), str(err.value)


def _loader(plan_dir: Path) -> SourceLoader:
    """The Source Loader of the plan's one source, in this process (what a Dask actor runs)."""
    meta = read_plan(plan_dir)
    files = IndexFiles.of(meta.spec.workdir, meta.sources[0])
    (part,) = partition_source(0, meta.sources[0], files.sample_shards().column("shard").to_numpy(), 1)
    return SourceLoader(str(plan_dir), part)


def _request(samples: list[int]) -> np.ndarray:
    req = np.zeros(len(samples), dtype=REQUEST_DTYPE)
    req["sample"] = samples
    req["length"] = 1
    return req


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_file_gone_while_serving_gets_the_serving_hint(dask_client: Client, tmp_path: Path, how: str) -> None:
    spec, path = _jsonl_case(tmp_path, "sample")
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    loader = _loader(plan_dir)  # started with the serve: the files were there
    if how == "deleted":
        path.unlink()
    else:
        os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(SourceDataError) as err:
        loader.read_now(_request([0, 499]))
    msg = str(err.value)
    assert str(path) in msg and _FIX in msg and "on_error" not in msg, msg
    # A serve started after the change refuses at once, naming the file and the fix.
    with pytest.raises(LoomError, match=r"re-run `loom index`") as refused:
        _stream_all(plan_dir, dask_client)
    assert str(path) in str(refused.value) and "on_error" not in str(refused.value)


def test_serve_refuses_a_file_set_that_moved_on(dask_client: Client, tmp_path: Path) -> None:
    """A shard the plan's globs match since planning: `loom serve` refuses before it starts a loader."""
    _jsonl(tmp_path / "data" / "a.jsonl", 100, seed=2)
    source = {"name": "books", "format": "jsonl", "paths": ["data/*.jsonl"], "text_field": "text"}
    spec = _spec(tmp_path, source)
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    _jsonl(tmp_path / "data" / "more.jsonl", 5, seed=9)
    refused = pytest.raises(LoomError, match=r"(?s)were not indexed: .*more\.jsonl.*re-run `loom index`")
    with refused, Executor(plan_dir, dask_client, constructors=1):
        pass


def _png(value: int, w: int, h: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_images_stay_in_sequence_order_with_several_loaders(dask_client: Client, tmp_path: Path) -> None:
    """Four shards served by four loaders: every batch's images follow their placeholders, and resume agrees."""
    from loomdata.testing import verify_resume
    from loomdata.testing._resume import _differs

    data = tmp_path / "data"
    data.mkdir()
    per_shard = 30
    for s in range(4):
        samples = []
        for j in range(per_shard):
            g = s * per_shard + j  # the sample id: dense in (shard, row) order
            samples.append(
                {
                    "__key__": f"k{g:04d}",
                    "txt": f"caption {g} " * (3 + g % 5),
                    "a.png": _png(g % 251, 28, 28),
                    "b.png": _png((g + 100) % 251, 42, 28),
                }
            )
        write_webdataset_shard(data / f"caps-{s}.tar", samples)
    source = {"name": "caps", "format": "webdataset", "paths": [str(data / "*.tar")], "text_field": "txt"}
    spec = _spec(tmp_path, {**source, "image_field": ["a.png", "b.png"]}, seq_len=256, steps=8)
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    meta = read_plan(plan_dir)
    patch = spec.images.patch_size
    checked = 0
    with Executor(plan_dir, dask_client, constructors=1, loaders_per_source=4):
        batches = [b for r in range(meta.dp_size) for b in StreamClient(plan_dir, r, retry_s=20)]
        for b in batches:
            pos = b.image_positions.tolist()
            assert pos == sorted(pos), (b.step, b.dp_rank, b.micro_batch, pos)
            starts = b.cu_seqlens[:-1]
            for im, p in zip(b.images, pos, strict=True):
                k = int(np.searchsorted(starts, p, side="right")) - 1  # the segment holding the image
                g = int(b.segments["sample"][k])
                first = p - int(starts[k]) + int(b.segments["offset"][k])  # its token offset inside the sample
                want = g % 251 if first == 0 else (g + 100) % 251  # a.png's 4 tokens come first, then b.png
                assert int(im[0, 0, 0]) == want and first in (0, (28 // patch) ** 2)
                checked += 1
        assert verify_resume(plan_dir, 0, client=dask_client) > 0
    assert checked > 20
    twin = next(b for b in batches if len(b.images) > 1)  # verify_resume compares the images themselves
    assert _differs(twin, dataclasses.replace(twin, images=twin.images[::-1])) == "images[0]"


def test_a_reader_that_is_not_thread_safe_never_runs_two_reads_at_once(dask_client: Client, tmp_path: Path) -> None:
    """A large read runs in the loader's thread; small reads that come meanwhile wait for it, not beside it."""
    import asyncio
    import threading
    import time

    rng = np.random.default_rng(8)
    path = tmp_path / "data" / "long.parquet"
    path.parent.mkdir(parents=True)
    docs = [rng.integers(1, 30_000, size=1000, dtype=np.int32) for _ in range(120)]
    pq.write_table(pa.table({"ids": pa.array(docs, pa.list_(pa.int32()))}), path, row_group_size=8)
    spec = _spec(tmp_path, {"name": "web", "format": "parquet", "paths": [str(path)], "tokens_field": "ids"})
    build_index(spec, dask_client)
    loader = _loader(make_plan(spec).plan_dir)
    assert not getattr(loader._reader, "thread_safe", False)
    inside = threading.Lock()
    overlaps: list[str] = []
    real_read = loader._reader.read

    def guarded(p: Path, rows: np.ndarray) -> Any:
        if not inside.acquire(blocking=False):
            overlaps.append(threading.current_thread().name)
            return real_read(p, rows)
        try:
            time.sleep(0.05)  # widen the window a concurrent read would hit
            return real_read(p, rows)
        finally:
            inside.release()

    loader._reader.read = guarded  # type: ignore[method-assign]
    big = _request(list(range(100)))
    big["length"] = 1000  # 100,000 tokens: read in the loader's thread
    small = [_request([100 + k]) for k in range(5)]  # one token each: inline reads

    async def run() -> list[Any]:
        first = asyncio.ensure_future(loader.read(big))
        await asyncio.sleep(0.01)  # the large read is inside the reader now
        return await asyncio.gather(first, *(loader.read(r) for r in small))

    out = asyncio.run(run())
    assert overlaps == []
    assert [len(o.tokens) for o in out] == [100_000, 1, 1, 1, 1, 1]
    np.testing.assert_array_equal(out[1].tokens, docs[100][:1])


def _stamp_checksum(path: Path, name: str | None) -> None:
    """Rewrite a Parquet file with its `loomdata.checksum` metadata set to `name` (None: removed), the rest kept."""
    table = pq.read_table(path)
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"loomdata.checksum"}
    if name is not None:
        meta[b"loomdata.checksum"] = name.encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


@pytest.mark.parametrize("old", ["crc32-int32le", None])
def test_an_index_of_another_checksum_definition_is_refused_then_rescanned(
    dask_client: Client, tmp_path: Path, old: str | None
) -> None:
    """An index built under an older definition (or before one was recorded): never a false "file changed"."""
    from loomdata.sources._integrity import CHECKSUM

    source, _ = _megatron(tmp_path)
    spec = _spec(tmp_path, source)
    build_index(spec, dask_client)
    files = IndexFiles.of(spec.workdir, "papers")
    parts = sorted((files.root / "_parts").glob("*.parquet"))
    assert parts and pq.read_schema(files.samples).metadata[b"loomdata.checksum"] == CHECKSUM.encode()
    plan_dir = make_plan(spec).plan_dir
    for p in [files.samples, *parts]:  # what an older loomdata left behind
        _stamp_checksum(p, old)
    with pytest.raises(LoomError) as err:
        _loader(plan_dir)
    msg = str(err.value)
    assert "re-run `loom index` and `loom plan`" in msg and CHECKSUM in msg and "changed after" not in msg, msg
    assert (old or "no recorded definition") in msg
    again = build_index(spec, dask_client).sources["papers"]  # an incremental run rescans every shard
    assert again.rescanned == len(parts)
    assert pq.read_schema(files.samples).metadata[b"loomdata.checksum"] == CHECKSUM.encode()
    assert len(_stream_all(make_plan(spec).plan_dir, dask_client)) == 6 * 2 * 2  # steps x ranks x micro-batches


@pytest.mark.parametrize(("make", "dtype"), [(_parquet, "int32"), (_megatron, "uint16"), (_webdataset, "int32")])
def test_the_index_records_the_checksum_dtype_of_its_shards(
    dask_client: Client, tmp_path: Path, make: Any, dtype: str
) -> None:
    source, _ = make(tmp_path)
    spec = _spec(tmp_path, source)
    build_index(spec, dask_client)
    meta = pq.read_schema(IndexFiles.of(spec.workdir, source["name"]).samples).metadata
    assert meta[b"loomdata.checksum_dtype"] == dtype.encode()
    IndexFiles.of(spec.workdir, source["name"]).samples.unlink()
    again = build_index(spec, dask_client).sources[source["name"]]  # rewritten from the scan cache alone
    assert again.rescanned == 0
    assert pq.read_schema(IndexFiles.of(spec.workdir, source["name"]).samples).metadata == meta
