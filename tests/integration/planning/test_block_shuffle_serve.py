"""`shuffle: block` end to end on real files: index, plan, serve; every served token checked against pyarrow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.indexing import build_index
from loomdata.planning import make_plan, plan_report
from loomdata.schemas import IndexFiles, parse_spec, read_manifest, read_plan
from loomdata.testing import generate_corpus
from loomtest import plancheck

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"


def test_block_shuffle_plans_and_serves_every_token(dask_client: Client, tmp_path: Path) -> None:
    generate_corpus(tmp_path / "data", "tiny", seed=0)
    raw = yaml.safe_load(CONFIG.read_text().replace("../demo-work/data", str(tmp_path / "data")))
    raw["workdir"] = str(tmp_path / "work")
    raw["sources"] = [s for s in raw["sources"] if s["name"] in ("web", "code")]
    raw["sources"][0].update({"shuffle": "block", "block_size": 16, "window": 4})
    raw["mixture"] = {"weights": {"web": 0.8, "code": 0.2}}
    raw["training"].update({"steps": 50, "seq_len": 2048, "dp_size": 4, "micro_batches": 4})
    spec = parse_spec(raw, tmp_path)
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    meta = read_plan(plan_dir)
    manifest = read_manifest(plan_dir, meta)
    web = meta.sources.index("web")

    # the web rows of the index, and an independent read of its files (pyarrow only)
    files = IndexFiles.of(spec.workdir, "web")
    idx = pq.read_table(str(files.samples), columns=["sample", "shard", "row", "num_tokens"]).sort_by("sample")
    shards = pq.read_table(str(files.shards))
    path_of = dict(zip(shards.column("shard").to_pylist(), shards.column("path").to_pylist(), strict=True))
    cols = {s: pq.read_table(p, columns=["input_ids"]).column(0).combine_chunks() for s, p in path_of.items()}
    shard = idx.column("shard").to_numpy().astype(np.int64)
    row = idx.column("row").to_numpy().astype(np.int64)
    ntok = idx.column("num_tokens").to_numpy().astype(np.int64)
    assert len(path_of) > 1 and len(ntok) > 200

    # the plan: web documents in the order of the block shuffle, every token once per epoch
    src = manifest.column("source").to_numpy()
    sample = manifest.column("sample").to_numpy().astype(np.int64)
    sel = src == web
    assert int(manifest.column("length").to_numpy()[sel].sum()) > 1.5 * ntok.sum()  # more than one epoch
    lengths = {
        n: pq.read_table(str(IndexFiles.of(spec.workdir, n).samples), columns=["sample", "num_tokens"])
        .sort_by("sample")
        .column("num_tokens")
        .to_numpy()
        .astype(np.int64)
        for n in meta.sources
    }
    deferred = pq.read_table(plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy() > 0
    plancheck.check_coverage(meta, manifest, lengths, {n: np.zeros_like(v) for n, v in lengths.items()}, deferred)
    report = plan_report(plan_dir)
    fig = report["shuffle"]["web"]
    assert fig["mode"] == "block" and (fig["block_size"], fig["window"]) == (16, 4)
    assert fig["read_amplification"] < 1.2 and fig["fetches_per_segment"] < 1.2 / 16
    assert report["shuffle"]["code"]["mode"] == "global"

    # serve it: every web segment's tokens equal the file's, and every planned segment comes exactly once
    served: list[tuple[int, int, int, int]] = []
    checked = 0
    with Executor(plan_dir, dask_client, constructors=2):
        for r in range(meta.dp_size):
            with StreamClient(plan_dir, r) as stream:
                for b in stream:
                    starts = b.cu_seqlens[:-1]
                    for k, (s, smp, off, ln) in enumerate(b.segments.tolist()):
                        served.append((int(s), int(smp), int(off), int(ln)))
                        if s == web:
                            doc = cols[int(shard[smp])][int(row[smp])].values.to_numpy(zero_copy_only=False)
                            np.testing.assert_array_equal(b.input_ids[starts[k] : starts[k] + ln], doc[off : off + ln])
                            checked += 1
    planned = sorted(
        zip(
            src.tolist(),
            sample.tolist(),
            manifest.column("offset").to_numpy().tolist(),
            manifest.column("length").to_numpy().tolist(),
            strict=True,
        )
    )
    assert sorted(served) == planned
    assert checked == int(sel.sum()) > 200
