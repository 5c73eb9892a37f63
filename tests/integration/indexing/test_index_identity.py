"""Identity from content: the same corpus indexed in two folders, copied with new file times, is one index."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from distributed import Client

from loomdata.indexing import build_index
from loomdata.schemas import IndexFiles, load_spec

_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _generate(root: Path) -> None:
    (root / "configs").mkdir(parents=True)
    shutil.copy(_CONFIGS / "demo.yaml", root / "configs" / "demo.yaml")
    cmd = [sys.executable, "-c", "from loomdata.cli import main; main()", "generate", str(root / "demo-work" / "data")]
    subprocess.run([*cmd, "--size", "tiny"], check=True, capture_output=True)


def _copy_with_new_times(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, copy_function=shutil.copy)  # shutil.copy: bytes and mode, not mtimes


def test_same_bytes_in_another_folder_give_the_same_index_fingerprints(tmp_path: Path, dask_client: Client) -> None:
    a, b = tmp_path / "a", tmp_path / "elsewhere" / "b"
    _generate(a)
    b.parent.mkdir()
    _copy_with_new_times(a / "demo-work" / "data", b / "demo-work" / "data")
    (b / "configs").mkdir(parents=True)
    shutil.copy(a / "configs" / "demo.yaml", b / "configs" / "demo.yaml")
    spec_a, spec_b = load_spec(a / "configs" / "demo.yaml"), load_spec(b / "configs" / "demo.yaml")
    assert spec_a.workdir != spec_b.workdir
    sum_a, sum_b = build_index(spec_a, dask_client), build_index(spec_b, dask_client)
    for name in spec_a.source_names:
        fa, fb = IndexFiles.of(spec_a.workdir, name), IndexFiles.of(spec_b.workdir, name)
        assert fa.fingerprint() == fb.fingerprint() == sum_a.sources[name].fingerprint
        assert sum_b.sources[name].fingerprint == sum_a.sources[name].fingerprint
        # the shards tables still say where each copy is and when it was written
        pa_, pb_ = pq.read_table(fa.shards), pq.read_table(fb.shards)
        assert pa_.column("fingerprint").equals(pb_.column("fingerprint"))
        assert pa_.column("path").to_pylist() != pb_.column("path").to_pylist()


def test_a_rewrite_that_changes_lengths_changes_the_fingerprint(tmp_path: Path, dask_client: Client) -> None:
    """Edges and size kept, middle rewritten with other document lengths: rescanned, new fingerprint."""
    root = tmp_path / "r"
    (root / "data").mkdir(parents=True)
    doc = tmp_path / "r" / "data" / "x.jsonl"
    pad = "p" * 70_000  # first and last 64 KiB of the file stay the same
    lines_a = ['{"text": "' + pad + '"}', '{"text": "ab"}', '{"text": "cdef"}', '{"text": "' + pad + '"}']
    lines_b = ['{"text": "' + pad + '"}', '{"text": "abcd"}', '{"text": "ef"}', '{"text": "' + pad + '"}']
    doc.write_text("\n".join(lines_a) + "\n")
    spec_path = root / "spec.yaml"
    spec_path.write_text(
        "name: t\nworkdir: work\nsources:\n  - {name: books, format: jsonl, paths: [data/*.jsonl], text_field: text}\n"
        "mixture: {weights: {books: 1}}\ntraining: {seq_len: 128, steps: 1, dp_size: 1}\n"
    )
    spec = load_spec(spec_path)
    first = build_index(spec, dask_client).sources["books"]
    doc.write_text("\n".join(lines_b) + "\n")
    second = build_index(spec, dask_client).sources["books"]
    assert second.rescanned == 1
    assert second.fingerprint != first.fingerprint


def test_same_data_and_spec_elsewhere_give_the_same_plan(tmp_path: Path, dask_client: Client) -> None:
    """Index and plan one corpus in two folders: the same plan id and the same manifest rows."""
    from loomdata.planning import make_plan
    from loomdata.schemas import read_manifest

    a, b = tmp_path / "a", tmp_path / "moved" / "b"
    _generate(a)
    b.parent.mkdir()
    _copy_with_new_times(a, b)
    plans = []
    for root in (a, b):
        spec = load_spec(root / "configs" / "demo.yaml")
        build_index(spec, dask_client)
        plans.append(make_plan(spec))
    pa_, pb_ = plans
    assert pa_.plan_dir != pb_.plan_dir
    assert pa_.meta.plan_id == pb_.meta.plan_id
    assert read_manifest(pa_.plan_dir, pa_.meta).equals(read_manifest(pb_.plan_dir, pb_.meta))
    assert pa_.meta.index_fingerprints == pb_.meta.index_fingerprints
