"""The seeded corpus: deterministic bytes, the promised layout and distributions, a valid demo spec."""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import zstandard
from PIL import Image

from loomdata.schemas.spec import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec, load_spec
from loomdata.sources import make_reader
from loomdata.testing import CorpusSize, generate_corpus

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "data"
    generate_corpus(out, "tiny", seed=0)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_bytes(tiny: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    summary = generate_corpus(again, CorpusSize.TINY, seed=0)
    a, b = _files(tiny), _files(again)
    assert sorted(a) == sorted(b)
    assert len(a) >= 4 + 2 + 3 + 2 + 2
    for name in a:
        assert a[name] == b[name], name
    other = _files(generate_corpus(tmp_path / "other", "tiny", seed=1).root)
    assert other["web/part-00000.parquet"] != a["web/part-00000.parquet"]
    assert other["books/part-00000.jsonl"] != a["books/part-00000.jsonl"]
    assert summary.to_dict()["total_bytes"] == sum(len(v) for v in b.values())


def test_regenerating_leaves_identical_files_untouched(tmp_path: Path) -> None:
    out = tmp_path / "data"
    generate_corpus(out, "tiny", seed=3)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    generate_corpus(out, "tiny", seed=3)
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert not list(out.rglob("*.tmp*"))


def test_summary_matches_the_files(tiny: Path) -> None:
    summary = generate_corpus(tiny, "tiny", seed=0).to_dict()  # unchanged files, same summary
    src = summary["sources"]
    assert set(src) == {"web", "code", "books", "papers", "captions"}
    web = [pq.read_metadata(p).num_rows for p in sorted((tiny / "web").glob("*.parquet"))]
    assert src["web"] == {
        "files": len(web),
        "samples": sum(web),
        "bytes": sum(p.stat().st_size for p in (tiny / "web").glob("*.parquet")),
    }
    code = sum(pq.read_metadata(p).num_rows for p in (tiny / "code").glob("*.parquet"))
    assert src["code"]["samples"] == code
    assert src["books"]["files"] == 3
    tars = sorted((tiny / "captions").glob("*.tar"))
    assert src["captions"]["files"] == len(tars)
    txt = 0
    for t in tars:
        with tarfile.open(t) as tf:
            txt += sum(1 for m in tf.getmembers() if m.name.endswith(".txt"))
    assert src["captions"]["samples"] == txt
    assert 1_000_000 < summary["total_bytes"] < 15_000_000  # "a few MB"


def test_web_lengths_lognormal_median_near_500(tiny: Path) -> None:
    table = pq.read_table(tiny / "web")
    ids_type = table.schema.field("input_ids").type
    assert pa.types.is_list(ids_type) and ids_type.value_type == pa.int32()
    assert table.schema.field("quality").type == pa.float32()
    lengths = pc.list_value_length(table["input_ids"]).to_numpy()
    assert 420 <= np.median(lengths) <= 580
    assert lengths.max() <= 16384
    assert np.percentile(lengths, 99) > 3 * np.median(lengths)  # a long tail
    ids = pc.list_flatten(table["input_ids"])
    assert pc.min(ids).as_py() >= 0 and pc.max(ids).as_py() < 32000
    q = table["quality"].to_numpy()
    assert q.min() >= 0 and q.max() <= 1
    assert set(table["lang"].to_pylist()) <= {"en", "de", "fr", "es", "zh"}
    assert pq.ParquetFile(tiny / "web" / "part-00000.parquet").num_row_groups > 1


def test_books_long_documents_in_every_compression(tiny: Path) -> None:
    files = sorted((tiny / "books").iterdir())
    assert [p.name for p in files] == ["part-00000.jsonl", "part-00001.jsonl.gz", "part-00002.jsonl.zst"]
    lengths = []
    for p in files:
        raw = p.read_bytes()
        if p.suffix == ".gz":
            raw = gzip.decompress(raw)
        elif p.suffix == ".zst":
            raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
        lengths += [len(json.loads(line)["text"].encode()) for line in raw.splitlines()]
    assert len(lengths) >= 10
    assert min(lengths) >= 7_900 and max(lengths) <= 41_000


def test_readers_count_what_independent_counts_say(tiny: Path) -> None:
    """The Parquet and JSONL readers on the corpus agree with pyarrow / json counts."""
    tok = TokenizerSpec()
    web = make_reader(
        SourceSpec(name="web", format=SourceFormat.PARQUET, paths=["x"], tokens_field="input_ids"), tok, ImageSpec()
    )
    p = tiny / "web" / "part-00001.parquet"
    n = web.num_parts(p, 64 * 1024)
    got = np.concatenate([web.scan(p, i, n).rows["num_tokens"].to_numpy() for i in range(n)])
    want = pc.list_value_length(pq.read_table(p)["input_ids"]).to_numpy()
    np.testing.assert_array_equal(got, want)
    code = make_reader(
        SourceSpec(name="code", format=SourceFormat.PARQUET, paths=["x"], text_field="text"), tok, ImageSpec()
    )
    p = tiny / "code" / "part-00000.parquet"
    texts = pq.read_table(p)["text"].to_pylist()
    assert code.scan(p, 0, 1).rows["num_tokens"].to_pylist() == [len(t.encode()) for t in texts]
    assert "def " in "".join(texts) or "class " in "".join(texts)
    books = make_reader(
        SourceSpec(name="b", format=SourceFormat.JSONL, paths=["x"], text_field="text"), tok, ImageSpec()
    )
    p = tiny / "books" / "part-00002.jsonl.zst"
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(p.read_bytes())).read()
    want_books = [len(json.loads(line)["text"].encode()) for line in raw.splitlines()]
    assert books.scan(p, 0, 1).rows["num_tokens"].to_pylist() == want_books


def test_captions_are_real_images_of_varied_sizes(tiny: Path) -> None:
    sizes = set()
    kinds = set()
    with tarfile.open(sorted((tiny / "captions").glob("*.tar"))[0]) as tf:
        for m in tf.getmembers():
            ext = m.name.rsplit(".", 1)[-1]
            data = tf.extractfile(m).read()  # type: ignore[union-attr]
            if ext in ("jpg", "png"):
                with Image.open(io.BytesIO(data)) as im:
                    im.load()
                    sizes.add(im.size)
                    kinds.add(im.format)
            else:
                assert ext == "txt" and len(data.decode()) > 5
    assert len(sizes) > 20
    assert kinds == {"JPEG", "PNG"}
    widths = [w for w, _ in sizes]
    assert min(widths) < 80 and max(widths) > 200


def test_demo_spec_validates_on_the_generated_corpus(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / "configs" / "demo.yaml", tmp_path / "configs" / "demo.yaml")
    generate_corpus(tmp_path / "demo-work" / "data", "tiny")
    spec = load_spec(tmp_path / "configs" / "demo.yaml")
    assert spec.source_names == ["web", "code", "books", "papers", "captions"]
    assert spec.training.seq_len == 2048 and spec.training.steps == 20 and spec.training.dp_size == 4
    assert spec.workdir.resolve() == (tmp_path / "demo-work" / "work").resolve()
    counts = {s.name: len(spec.resolve_paths(s)) for s in spec.sources}
    assert counts == {"web": 4, "code": 2, "books": 3, "papers": 1, "captions": 2}


def test_files_of_an_earlier_generation_are_pruned(tmp_path: Path) -> None:
    out = tmp_path / "data"
    generate_corpus(out, "tiny")
    stale = out / "web" / "part-00099.parquet"
    shutil.copy(out / "web" / "part-00000.parquet", stale)
    (out / "web" / "notes.txt").write_text("not ours")
    generate_corpus(out, "tiny")
    assert not stale.exists()
    assert (out / "web" / "notes.txt").exists()
