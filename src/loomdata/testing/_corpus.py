"""A seeded multi-source corpus, a tool for tests, benchmarks and demos (`loom generate`).

Layout under `out_dir` (every file a pure function of `(size, seed)`, byte-identical across runs):

- `web/part-*.parquet`: pre-tokenized `input_ids: list<int32>` (Zipf-distributed ids below 32000,
  log-normal lengths, median about 500 tokens, tail capped at 16384), metadata `quality: float32`,
  `lang: string`.
- `code/part-*.parquet`: raw `text` of code-like files (Python-ish functions and classes).
- `books/part-*.jsonl`, `.jsonl.gz`, `.jsonl.zst`: long documents (`id`, `title`, `text`) of 8K to
  200K bytes (byte tokenizer: tokens), log-uniform; `tiny` keeps them to 8K-40K.
- `papers/papers_text_document.{bin,idx}`: a Megatron indexed dataset (uint16 tokens).
- `captions/part-*.tar`: WebDataset image-caption pairs (`jpg` or `png`, `txt`), real images of
  varied sizes drawn with Pillow.

Text comes from a Zipf-weighted vocabulary of made-up words, cut from one seeded pool (no per-word
Python loops). A file whose new content equals the one on disk is left untouched (same mtime), so
re-generating an existing corpus does not invalidate an index built on it.
"""

from __future__ import annotations

import enum
import filecmp
import functools
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from loomdata.testing._writers import write_megatron, write_webdataset_shard

__all__ = ["CorpusSize", "CorpusSummary", "SourceSummary", "generate_corpus"]

_VOCAB = 32000  # pre-tokenized ids stay below the default image placeholder id (32000)
_LANGS = np.array(["en", "de", "fr", "es", "zh"])
_LANG_P = np.array([0.6, 0.12, 0.1, 0.1, 0.08])
_CHUNK = 1 << 22  # token ids drawn per numpy call
_PAPERS_BATCH = 4096  # Megatron documents generated at once


class CorpusSize(str, enum.Enum):
    """How big a corpus to write: `tiny` (a few MB), `small` (~200 MB), `large` (several GB)."""

    TINY = "tiny"
    SMALL = "small"
    LARGE = "large"


@dataclass(frozen=True, slots=True)
class _Plan:
    """File and sample counts per source for one size."""

    web_files: int
    web_docs: int  # per file
    web_row_group: int
    code_files: int
    code_docs: int
    books_files: int  # per compression kind (plain, gz, zst)
    books_docs: int  # per file
    book_bytes: tuple[int, int]
    papers_docs: int
    caption_shards: int
    captions: int  # per shard
    image_side: tuple[int, int]


_PLANS = {
    CorpusSize.TINY: _Plan(4, 250, 64, 2, 300, 1, 5, (8_000, 40_000), 400, 2, 80, (32, 320)),
    CorpusSize.SMALL: _Plan(8, 5_000, 1024, 4, 5_000, 2, 60, (8_000, 200_000), 20_000, 8, 500, (48, 640)),
    CorpusSize.LARGE: _Plan(32, 40_000, 2048, 16, 20_000, 4, 100, (8_000, 200_000), 200_000, 32, 1000, (48, 800)),
}


@dataclass(frozen=True, slots=True)
class SourceSummary:
    """What one source of the corpus holds."""

    files: int
    samples: int
    bytes: int


@dataclass(frozen=True, slots=True)
class CorpusSummary:
    """What `generate_corpus` wrote, per source."""

    root: Path
    size: CorpusSize
    seed: int
    sources: dict[str, SourceSummary] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (for `loom generate --json`)."""
        return {
            "root": str(self.root),
            "size": self.size.value,
            "seed": self.seed,
            "total_bytes": sum(s.bytes for s in self.sources.values()),
            "sources": {
                name: {"files": s.files, "samples": s.samples, "bytes": s.bytes} for name, s in self.sources.items()
            },
        }


# ---- building blocks ------------------------------------------------------------------------------


def _rng(seed: int, *key: int) -> np.random.Generator:
    """An independent generator per (seed, source, file): files do not depend on each other."""
    return np.random.default_rng([seed, *key])


def _commit(tmp: Path, final: Path) -> None:
    """Move `tmp` to `final`, unless `final` already has the same bytes (then keep it, mtime and all)."""
    if final.exists() and final.stat().st_size == tmp.stat().st_size and filecmp.cmp(tmp, final, shallow=False):
        tmp.unlink()
    else:
        os.replace(tmp, final)


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    _commit(tmp, path)


def _prune(folder: Path, pattern: str, written: list[Path]) -> None:
    """Remove files of an earlier generation (e.g. another size) that this run did not write."""
    keep = set(written)
    for p in folder.glob(pattern):
        if p not in keep:
            p.unlink()


def _vocabulary(seed: int, n: int = 4000) -> np.ndarray:
    """Made-up words of 1-11 letters, with a few accented ones (multi-byte UTF-8)."""
    rng = _rng(seed, 99)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    p = 1.0 / np.arange(1, 27) ** 0.9
    lens = np.clip(rng.geometric(0.22, size=n), 1, 11)
    chars = rng.choice(letters, size=int(lens.sum()), p=p / p.sum())
    words = np.array(["".join(w) for w in np.split(chars, np.cumsum(lens)[:-1])], dtype=object)
    accented = rng.random(n) < 0.03
    words[accented] = [w + "é" for w in words[accented]]
    order = np.argsort([len(w) for w in words], kind="stable")  # frequent words are short ones
    return words[order]


def _pool(seed: int, vocab: np.ndarray, n_words: int) -> str:
    """A long prose-like text: Zipf-weighted words, sentences, paragraphs."""
    rng = _rng(seed, 98)
    ranks = np.minimum(rng.zipf(1.15, size=n_words), len(vocab)) - 1
    words = vocab[ranks].astype(object)
    ends = rng.random(n_words) < 0.07
    words[ends] = [w + "." for w in words[ends]]
    paras = rng.random(n_words) < 0.006
    words[paras] = [w + ".\n\n" for w in words[paras]]
    return " ".join(words.tolist())


def _cut(rng: np.random.Generator, pool: str, lengths: np.ndarray) -> list[str]:
    """Texts of the given lengths (characters) cut from random places of the pool."""
    out = []
    starts = rng.integers(0, max(len(pool) - int(lengths.max(initial=0)), 1), size=len(lengths))
    for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        text = pool[s : s + n]
        while len(text) < n:  # only for lengths beyond the pool size
            text += " " + pool[: n - len(text) - 1]
        out.append(text.strip() or "empty")
    return out


def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, size=n)), lo, hi).astype(np.int64)


@functools.lru_cache(maxsize=1)
def _zipf_table(bits: int = 20) -> np.ndarray:
    """Inverse CDF of a Zipf(1.1) law over the vocabulary, tabulated on 2**bits quantiles."""
    p = 1.0 / np.arange(1, _VOCAB + 1) ** 1.1
    cdf = np.cumsum(p) / p.sum()
    return np.minimum(np.searchsorted(cdf, (np.arange(1 << bits) + 0.5) / (1 << bits)), _VOCAB - 1).astype(np.int32)


def _zipf_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` Zipf-distributed token ids below the vocabulary size (table lookup, bounded chunks)."""
    table = _zipf_table()
    out = np.empty(n, dtype=np.int32)
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        out[lo:hi] = table[rng.integers(0, len(table), size=hi - lo)]
    return out


# ---- sources --------------------------------------------------------------------------------------


def _web(out: Path, plan: _Plan, seed: int) -> SourceSummary:
    folder = out / "web"
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    samples = nbytes = 0
    for f in range(plan.web_files):
        rng = _rng(seed, 1, f)
        lengths = _lognormal_lengths(rng, plan.web_docs, 500, 1.0, 8, 16384)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(_zipf_tokens(rng, int(offsets[-1]))))
        table = pa.table(
            {
                "input_ids": ids,
                "quality": pa.array(rng.beta(2.0, 3.0, size=plan.web_docs).astype(np.float32)),
                "lang": pa.array(rng.choice(_LANGS, size=plan.web_docs, p=_LANG_P)),
            }
        )
        path = folder / f"part-{f:05d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp, row_group_size=plan.web_row_group, compression="zstd")
        _commit(tmp, path)
        written.append(path)
        samples += plan.web_docs
        nbytes += path.stat().st_size
    _prune(folder, "part-*.parquet", written)
    return SourceSummary(plan.web_files, samples, nbytes)


_CODE_TEMPLATES = (
    'def {a}_{b}({c}, {d}=None):\n    """{doc}"""\n    if {d} is None:\n        {d} = {n}\n'
    "    return {c} * {d} + {m}\n",
    'class {A}{B}:\n    """{doc}"""\n\n    def __init__(self, {c}):\n        self.{c} = {c}\n'
    "        self.{d} = [{n}, {m}]\n\n    def {a}(self):\n        return sum(self.{d}) - self.{c}\n",
    "for {c} in range({n}):\n    if {c} % {m} == 0:\n        {d}.append({a}_{b}({c}))\n",
    '# {doc}\n{a}_{b} = {{"{c}": {n}, "{d}": [{m}, {n}]}}\n',
    "async def {a}({c}):\n    try:\n        return await {b}.{d}({c}, timeout={n})\n"
    '    except {A}Error as exc:\n        raise RuntimeError("{doc}") from exc\n',
)


def _code_snippets(seed: int, vocab: np.ndarray, n: int) -> list[str]:
    """A pool of code-like snippets (functions, classes, loops) with made-up identifiers."""
    rng = _rng(seed, 97)
    names = vocab[: min(len(vocab), 800)]
    pick = rng.integers(0, len(names), size=(n, 4))
    nums = rng.integers(0, 1000, size=(n, 2))
    kinds = rng.integers(0, len(_CODE_TEMPLATES), size=n)
    docs = _cut(rng, _pool(seed, vocab, 20_000).replace("\n", " "), rng.integers(10, 60, size=n))
    out = []
    for i in range(n):
        a, b, c, d = (str(names[j]).replace("é", "e") for j in pick[i])
        out.append(
            _CODE_TEMPLATES[kinds[i]].format(
                a=a, b=b, c=c, d=d, A=a.capitalize(), B=b.capitalize(), n=nums[i, 0], m=nums[i, 1], doc=docs[i]
            )
        )
    return out


def _code(out: Path, plan: _Plan, seed: int, vocab: np.ndarray) -> SourceSummary:
    folder = out / "code"
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    snippets = np.array(_code_snippets(seed, vocab, 2000), dtype=object)
    samples = nbytes = 0
    for f in range(plan.code_files):
        rng = _rng(seed, 2, f)
        counts = np.clip(rng.geometric(0.12, size=plan.code_docs), 1, 120)
        chosen = snippets[rng.integers(0, len(snippets), size=int(counts.sum()))]
        files = np.split(chosen, np.cumsum(counts)[:-1])
        texts = ["import os\nimport sys\n\n\n" + "\n\n".join(part.tolist()) for part in files]
        path = folder / f"part-{f:05d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        table = pa.table({"text": pa.array(texts, pa.string()), "repo": pa.array([f"repo-{f}"] * len(texts))})
        pq.write_table(table, tmp, row_group_size=512, compression="zstd")
        _commit(tmp, path)
        written.append(path)
        samples += len(texts)
        nbytes += path.stat().st_size
    _prune(folder, "part-*.parquet", written)
    return SourceSummary(plan.code_files, samples, nbytes)


def _books(out: Path, plan: _Plan, seed: int, vocab: np.ndarray) -> SourceSummary:
    folder = out / "books"
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    lo, hi = plan.book_bytes
    pool = _pool(seed, vocab, max(hi // 3, 200_000))
    kinds: list[tuple[str, Callable[[bytes], bytes]]] = [
        ("jsonl", lambda b: b),
        ("jsonl.gz", lambda b: gzip.compress(b, compresslevel=6, mtime=0)),
        ("jsonl.zst", lambda b: zstandard.ZstdCompressor(level=3).compress(b)),
    ]
    samples = nbytes = files = 0
    for f in range(plan.books_files * len(kinds)):
        suffix, compress = kinds[f % len(kinds)]
        rng = _rng(seed, 3, f)
        lengths = np.exp(rng.uniform(np.log(lo), np.log(hi), size=plan.books_docs)).astype(np.int64)
        texts = _cut(rng, pool, lengths)
        lines = [
            json.dumps({"id": f"book-{f}-{i}", "title": t[:40].split("\n")[0], "text": t}, ensure_ascii=i % 2 == 0)
            for i, t in enumerate(texts)
        ]
        path = folder / f"part-{f:05d}.{suffix}"
        _write_bytes(path, compress(("\n".join(lines) + "\n").encode()))
        written.append(path)
        samples += len(texts)
        nbytes += path.stat().st_size
        files += 1
    _prune(folder, "part-*.jsonl*", written)
    return SourceSummary(files, samples, nbytes)


def _papers(out: Path, plan: _Plan, seed: int) -> SourceSummary:
    folder = out / "papers"
    folder.mkdir(parents=True, exist_ok=True)
    rng = _rng(seed, 4)
    lengths = _lognormal_lengths(rng, plan.papers_docs, 1500, 0.8, 32, 16384)

    def docs() -> Iterator[np.ndarray]:
        for lo in range(0, len(lengths), _PAPERS_BATCH):
            part = lengths[lo : lo + _PAPERS_BATCH]
            flat = _zipf_tokens(rng, int(part.sum())).astype(np.uint16)
            yield from np.split(flat, np.cumsum(part)[:-1])

    final = folder / "papers_text_document"
    tmp = folder / "papers_text_document.tmp"
    write_megatron(tmp, docs(), np.uint16)
    nbytes = 0
    for ext in (".bin", ".idx"):
        _commit(Path(f"{tmp}{ext}"), Path(f"{final}{ext}"))
        nbytes += Path(f"{final}{ext}").stat().st_size
    return SourceSummary(1, plan.papers_docs, nbytes)


def _image(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """An RGB picture: a colour gradient, a few rectangles and a little noise."""
    c0, c1 = rng.integers(0, 256, size=(2, 3)).astype(np.float32)
    x = np.linspace(0, 0.6, w, dtype=np.float32)
    y = np.linspace(0, 0.4, h, dtype=np.float32)
    t = (y[:, None] + x[None, :])[..., None]
    img = c0 * (1 - t) + c1 * t
    for _ in range(int(rng.integers(1, 5))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        img[y0 : y0 + int(rng.integers(4, max(h // 2, 5))), x0 : x0 + int(rng.integers(4, max(w // 2, 5)))] = (
            rng.integers(0, 256, size=3)
        )
    img += rng.integers(-10, 11, size=img.shape, dtype=np.int8)  # a little sensor-like noise
    return np.clip(img, 0, 255).astype(np.uint8)


def _captions(out: Path, plan: _Plan, seed: int, vocab: np.ndarray) -> SourceSummary:
    from PIL import Image

    folder = out / "captions"
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    pool = _pool(seed, vocab, 50_000).replace("\n", " ")
    samples = nbytes = 0
    lo, hi = plan.image_side
    for f in range(plan.caption_shards):
        rng = _rng(seed, 5, f)
        caps = _cut(rng, pool, rng.integers(20, 300, size=plan.captions))
        sides = np.exp(rng.uniform(np.log(lo), np.log(hi), size=(plan.captions, 2))).astype(np.int64)
        records: list[dict[str, bytes | str]] = []
        for i in range(plan.captions):
            w, h = int(sides[i, 0]), int(sides[i, 1])
            buf = io.BytesIO()
            ext = "png" if i % 5 == 4 else "jpg"
            Image.fromarray(_image(rng, w, h)).save(buf, format="PNG" if ext == "png" else "JPEG", quality=85)
            records.append({"__key__": f"{f:05d}-{i:06d}", ext: buf.getvalue(), "txt": caps[i]})
        path = folder / f"part-{f:05d}.tar"
        tmp = path.with_name(path.name + ".tmp")
        write_webdataset_shard(tmp, records)
        _commit(tmp, path)
        written.append(path)
        samples += plan.captions
        nbytes += path.stat().st_size
    _prune(folder, "part-*.tar", written)
    return SourceSummary(plan.caption_shards, samples, nbytes)


def generate_corpus(out_dir: Path, size: CorpusSize | str = CorpusSize.TINY, seed: int = 0) -> CorpusSummary:
    """Write the seeded corpus of `size` under `out_dir` (see the module docstring for the layout)."""
    size = CorpusSize(size)
    plan = _PLANS[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _vocabulary(seed)
    sources = {
        "web": _web(out, plan, seed),
        "code": _code(out, plan, seed, vocab),
        "books": _books(out, plan, seed, vocab),
        "papers": _papers(out, plan, seed),
        "captions": _captions(out, plan, seed, vocab),
    }
    return CorpusSummary(root=out, size=size, seed=seed, sources=sources)
