"""The executor serves every source format of the demo corpus: text, long documents, Megatron, images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import IGNORE_INDEX, IndexFiles, parse_spec, read_manifest, read_plan
from loomdata.testing import generate_corpus

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"


def test_demo_corpus_all_formats(dask_client: Client, tmp_path: Path) -> None:
    generate_corpus(tmp_path / "data", "tiny", seed=0)
    raw = yaml.safe_load(CONFIG.read_text().replace("../demo-work/data", str(tmp_path / "data")))
    raw["workdir"] = str(tmp_path / "work")
    raw["training"]["steps"] = 12
    spec = parse_spec(raw, tmp_path)
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    meta = read_plan(plan_dir)
    manifest = read_manifest(plan_dir, meta)
    web = meta.sources.index("web")
    captions = meta.sources.index("captions")
    # Independent read of the pre-tokenized Parquet source (pyarrow only).
    files = IndexFiles.of(spec.workdir, "web")
    idx = pq.read_table(str(files.samples), columns=["sample", "shard", "row"]).sort_by("sample")
    shards = pq.read_table(str(files.shards))
    path_of = dict(zip(shards.column("shard").to_pylist(), shards.column("path").to_pylist(), strict=True))
    cols = {s: pq.read_table(p, columns=["input_ids"]).column(0).combine_chunks() for s, p in path_of.items()}
    loc = list(zip(idx.column("shard").to_pylist(), idx.column("row").to_pylist(), strict=True))
    patch = spec.images.patch_size
    placeholder = spec.images.placeholder_token_id

    seen = {m: 0 for m in meta.sources}
    images = web_checked = 0
    with Executor(plan_dir, dask_client, constructors=2):
        for r in range(meta.dp_size):
            with StreamClient(plan_dir, r) as stream:
                for b in stream:
                    seg = b.segments
                    mask = (
                        (manifest.column("step").to_numpy() == b.step)
                        & (manifest.column("dp_rank").to_numpy() == r)
                        & (manifest.column("micro_batch").to_numpy() == b.micro_batch)
                    )
                    assert seg["sample"].tolist() == manifest.column("sample").to_numpy()[mask].tolist()
                    assert b.num_tokens == int(seg["length"].sum())
                    assert b.input_ids.flags.writeable and b.labels.flags.writeable  # torch wraps them as is
                    assert (b.labels[b.num_tokens :] == IGNORE_INDEX).all()
                    starts = b.cu_seqlens[:-1]
                    for k, (src, sample, off, ln) in enumerate(seg.tolist()):
                        seen[meta.sources[src]] += 1
                        if src == web:
                            shard, row = loc[sample]
                            doc = cols[shard][row].values.to_numpy(zero_copy_only=False)
                            np.testing.assert_array_equal(b.input_ids[starts[k] : starts[k] + ln], doc[off : off + ln])
                            web_checked += 1
                        if src == captions and off == 0:
                            assert any(starts[k] <= p < starts[k] + ln for p in b.image_positions)
                    for im, pos in zip(b.images, b.image_positions.tolist(), strict=True):
                        n = (im.shape[0] // patch) * (im.shape[1] // patch)
                        assert im.dtype == np.uint8 and im.ndim == 3 and im.flags.writeable
                        assert (b.input_ids[pos : pos + n] == placeholder).all()
                        images += 1
    assert all(v > 0 for v in seen.values()), seen
    assert images > 0 and web_checked > 0
