"""How fast is `loom index` next to the practical floor: a single-process pyarrow read of the same lengths?

For each source of a generated corpus (or a given one) this runs `build_index` on a LocalCluster of 1
and then 2 worker processes (threads_per_worker=1), each on a fresh index (no cache), interleaved
with a single process that reads the same length information directly: pre-tokenized Parquet: the
list column and `list_value_length`; raw-text Parquet: the text column and the byte tokenizer's
count; JSONL: decompress, Arrow's JSON reader, the byte count; Megatron: the .idx lengths;
WebDataset: `tarfile` plus Pillow's header parse of each image. It prints samples/s, MB/s (source
bytes on disk) and the ratio to the floor per worker (`index rate / workers / floor rate`; goal
>= 0.8). The floor is timed twice: with pyarrow's CPU pool capped at one thread, as in a Dask
worker (the nanny sets OMP_NUM_THREADS=1, and threads_per_worker=1), which is the per-worker
figure, and with pyarrow's default pool (all cores), reported beside it. Writes
benchmarks/results/index_scan.json. `noop s` is a re-run with nothing changed (zero tasks): the
job's fixed cost.

The index also checksums every sample's token stream (sources/_integrity: XXH3-64 of the ids in the
shard's stored dtype, the raw UTF-8 bytes for byte-tokenized text), which reads a Megatron .bin.
`cksum s` is the hash alone (int32 streams), one thread, over the source's own lengths (`cksum %`: its
share of the index's worker time); the whole cost, extra reads included, is the difference of two runs of
this script, one with PYTHONPATH at a loomdata without checksums.

`--checksum-cost` measures the checksums' share of the scan in one process instead (no Dask, so the
figures do not drown in a shared machine's noise): every shard of a source scanned by its reader on one
thread, CPU time best of `--repeat`, with the real checksums and with the hash calls replaced by zeros
(alternating), next to the hash alone over the source's own token streams in its checksum dtype, and for
Megatron the time to read the .bin bytes alone (what the scan reads only for the checksums). Writes
benchmarks/results/index_scan_checksum.json (with the definition's name, `checksum`).

    .venv/bin/python benchmarks/index_scan.py                    # small corpus, about 2 minutes
    .venv/bin/python benchmarks/index_scan.py --checksum-cost    # in-process checksum cost, about 1 minute
    .venv/bin/python benchmarks/index_scan.py --size large --data /big/disk/corpus
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq
import zstandard
from PIL import Image

from loomdata.indexing import build_index
from loomdata.schemas import ImageSpec, Spec, parse_spec
from loomdata.sources.images import image_tokens_array
from loomdata.testing import generate_corpus

RESULTS = Path(__file__).resolve().parent / "results" / "index_scan.json"
CHECKSUM_RESULTS = RESULTS.with_name("index_scan_checksum.json")
GOAL = 0.8

SOURCES: dict[str, dict[str, Any]] = {
    "web": {"format": "parquet", "paths": ["web/*.parquet"], "tokens_field": "input_ids"},
    "code": {"format": "parquet", "paths": ["code/*.parquet"], "text_field": "text"},
    "books": {
        "format": "jsonl",
        "paths": ["books/*.jsonl", "books/*.jsonl.gz", "books/*.jsonl.zst"],
        "text_field": "text",
    },
    "papers": {"format": "megatron", "paths": ["papers/*.idx"]},
    "captions": {
        "format": "webdataset",
        "paths": ["captions/*.tar"],
        "text_field": "txt",
        "image_field": ["jpg", "png"],
    },
}
IMAGES = ImageSpec()


# ---- the floor: one process, pyarrow/numpy only ---------------------------------------------------


def _floor_tokens_parquet(path: Path) -> np.ndarray:
    col = pq.read_table(path, columns=["input_ids"]).column(0)
    return pc.list_value_length(col).to_numpy(zero_copy_only=False)


def _floor_text_parquet(path: Path) -> np.ndarray:
    col = pq.read_table(path, columns=["text"]).column(0)
    return pc.binary_length(col).to_numpy(zero_copy_only=False)  # the byte tokenizer's count


def _floor_jsonl(path: Path) -> np.ndarray:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    elif path.suffix == ".zst":
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    schema = pa.schema([pa.field("text", pa.large_string())])
    table = pajson.read_json(
        io.BytesIO(data),
        parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
    )
    return pc.binary_length(table.column("text")).to_numpy(zero_copy_only=False)


def _floor_megatron(prefix: Path) -> np.ndarray:
    raw = Path(f"{prefix}.idx").read_bytes()
    count = int(np.frombuffer(raw, dtype=np.uint64, count=1, offset=18)[0])
    return np.frombuffer(raw, dtype=np.int32, count=count, offset=34)


def _floor_webdataset(path: Path) -> np.ndarray:
    """Walk the tar with `tarfile`: text bytes, and image sizes from Pillow's header parse (no decode)."""
    keys: dict[str, int] = {}
    text_len: list[int] = []
    sizes: list[tuple[int, int, int]] = []  # (sample, width, height)
    with tarfile.open(path) as tf:
        for ti in tf:
            if not ti.isfile():
                continue
            folder, _, base = ti.name.rpartition("/")
            stem, _, ext = base.partition(".")
            sample = keys.setdefault(f"{folder}/{stem}", len(keys))
            if sample == len(text_len):
                text_len.append(0)
            f = tf.extractfile(ti)
            if f is None:
                continue
            if ext == "txt":
                text_len[sample] = len(f.read())
            elif ext in ("jpg", "png"):
                with Image.open(f) as im:
                    sizes.append((sample, *im.size))
    tokens = np.array(text_len, dtype=np.int64)
    if sizes:
        s = np.array(sizes, dtype=np.int64)
        np.add.at(tokens, s[:, 0], image_tokens_array(s[:, 1], s[:, 2], IMAGES))
    return tokens


FLOORS: dict[str, Callable[[Path], np.ndarray]] = {
    "web": _floor_tokens_parquet,
    "code": _floor_text_parquet,
    "books": _floor_jsonl,
    "papers": _floor_megatron,
    "captions": _floor_webdataset,
}


def _spec(root: Path, workdir: Path, names: list[str]) -> Spec:
    data = {
        "name": "bench",
        "workdir": str(workdir),
        "sources": [{"name": n, **SOURCES[n]} for n in names],
        "mixture": {"weights": dict.fromkeys(names, 1.0)},
        "training": {"seq_len": 4096, "steps": 1, "dp_size": 1},
    }
    return parse_spec(data, root)


def _source_bytes(spec: Spec, name: str) -> int:
    total = 0
    for p in spec.resolve_paths(spec.source(name)):
        files = [Path(f"{p}.idx"), Path(f"{p}.bin")] if name == "papers" else [p]
        total += sum(f.stat().st_size for f in files)
    return total


def _floor(spec: Spec, names: list[str], threads: int | None = None) -> tuple[float, int, int]:
    """One single-process read of the sources' lengths: (seconds, samples, tokens).

    `threads` caps pyarrow's CPU pool for the read: 1 matches a Dask worker, whose nanny sets
    OMP_NUM_THREADS=1 (so pyarrow decodes on one thread there); None keeps pyarrow's default.
    """
    before = pa.cpu_count()
    if threads is not None:
        pa.set_cpu_count(threads)
    try:
        t0 = time.perf_counter()
        lengths = [FLOORS[n](p) for n in names for p in spec.resolve_paths(spec.source(n))]
        took = time.perf_counter() - t0
    finally:
        pa.set_cpu_count(before)
    return took, sum(len(x) for x in lengths), int(sum(int(x.sum()) for x in lengths))


def _index(spec: Spec, client: Any, names: list[str], fresh: bool = True) -> tuple[float, int, int]:
    """One `build_index` of the sources, on a fresh index unless `fresh` is False: (seconds, samples, tokens)."""
    if fresh:
        for n in names:
            shutil.rmtree(spec.index_dir / n, ignore_errors=True)
    t0 = time.perf_counter()
    summary = build_index(spec, client, sources=names)
    took = time.perf_counter() - t0
    return took, sum(s.samples for s in summary.sources.values()), sum(s.tokens for s in summary.sources.values())


def _checksum_s(
    spec: Spec, names: list[str], repeat: int = 3, lengths: np.ndarray | None = None, dtype: str = "<i4"
) -> float:
    """CPU seconds (best of `repeat`, one thread) to checksum `dtype` streams of the indexed lengths (or of
    `lengths`): the hash alone."""
    try:
        from loomdata.sources._integrity import checksums_flat
    except ImportError:  # a loomdata without checksums (the baseline of an A/B run)
        return 0.0
    if lengths is None:
        tables = [pq.read_table(spec.index_dir / n / "samples.parquet", columns=["num_tokens"]) for n in names]
        lengths = np.concatenate([t.column(0).to_numpy() for t in tables]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    high = min(50_000, int(np.iinfo(np.dtype(dtype)).max))
    tokens = np.random.default_rng(0).integers(0, high, size=int(offsets[-1])).astype(dtype)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        checksums_flat(tokens, offsets)
        best = min(best, time.process_time() - t0)
    return best


def _compare(spec: Spec, client: Any, label: str, names: list[str], n_workers: int, repeat: int) -> dict[str, Any]:
    """Index and floor runs interleaved (so load from other processes hits both alike); best of each."""
    cold = _index(spec, client, names)[0]  # pays worker imports and reader set-up
    index_runs, floor_runs, floor1_runs = [], [], []
    for _ in range(repeat):
        floor_runs.append(_floor(spec, names))
        floor1_runs.append(_floor(spec, names, threads=1))
        index_runs.append(_index(spec, client, names))
    noop = _index(spec, client, names, fresh=False)[0]  # nothing changed: the job's fixed cost
    (_, samples, tokens), (_, f_samples, f_tokens) = index_runs[0], floor_runs[0]
    if (samples, tokens) != (f_samples, f_tokens):
        raise SystemExit(f"{label}: index and floor disagree: {samples}/{tokens} vs {f_samples}/{f_tokens}")
    best = min(r[0] for r in index_runs)
    floor_s, floor1_s = min(r[0] for r in floor_runs), min(r[0] for r in floor1_runs)
    nbytes = sum(_source_bytes(spec, n) for n in names)
    rate = samples / best
    cksum = _checksum_s(spec, names)
    print(
        f"  {label:8s} workers={n_workers}: {best:.3f}s (floor {floor1_s:.3f}s 1 thread, {floor_s:.3f}s)",
        file=sys.stderr,
    )
    return {
        "source": label,
        "workers": n_workers,
        "samples": samples,
        "tokens": tokens,
        "bytes": nbytes,
        "index_cold_s": round(cold, 4),
        "index_noop_s": round(noop, 4),
        "index_s": round(best, 4),
        "index_runs_s": [round(r[0], 4) for r in index_runs],
        "floor_1thread_s": round(floor1_s, 4),
        "floor_1thread_runs_s": [round(r[0], 4) for r in floor1_runs],
        "floor_s": round(floor_s, 4),
        "floor_runs_s": [round(r[0], 4) for r in floor_runs],
        "index_samples_per_s": round(rate, 1),
        "index_mb_per_s": round(nbytes / best / 1e6, 2),
        "floor_1thread_samples_per_s": round(samples / floor1_s, 1),
        "floor_1thread_mb_per_s": round(nbytes / floor1_s / 1e6, 2),
        "floor_samples_per_s": round(samples / floor_s, 1),
        "floor_mb_per_s": round(nbytes / floor_s / 1e6, 2),
        "ratio_per_worker": round(floor1_s / best / n_workers, 3),
        "ratio_per_worker_vs_threaded_floor": round(floor_s / best / n_workers, 3),
        "checksum_s": round(cksum, 4),
        "checksum_share": round(cksum / (best * n_workers), 4),
    }


# ---- --checksum-cost: the checksums' share of one process's scan ---------------------------------


def _no_checksums() -> contextlib.ExitStack:
    """Replace every hash call of the scan by zeros (the counting, reading and tokenising stay)."""
    from loomdata.sources import megatron, parquet, tokenizer, webdataset

    def zeros_flat(flat: np.ndarray, offsets: np.ndarray, *_: Any) -> np.ndarray:
        return np.zeros(len(offsets) - 1, dtype=np.uint32)

    def zeros_prefixed(token: int, prefix: np.ndarray, arrays: list[np.ndarray]) -> np.ndarray:
        return np.zeros(len(arrays), dtype=np.uint32)

    def count_only(self: tokenizer.Tokenizer, texts: tokenizer.Texts) -> tuple[np.ndarray, np.ndarray]:
        counts = self.count_batch(texts)
        return counts, np.zeros(len(counts), dtype=np.uint32)

    stack = contextlib.ExitStack()
    for obj, name, stub in [
        (parquet, "checksums_flat", zeros_flat),
        (megatron, "checksums_flat", zeros_flat),
        (webdataset, "prefixed_checksums", zeros_prefixed),
        (tokenizer.Tokenizer, "count_and_check", count_only),
        (tokenizer.ByteTokenizer, "count_and_check", count_only),
    ]:
        stack.enter_context(_patched(obj, name, stub))
    return stack


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Any:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _scan_source(spec: Spec, name: str) -> tuple[float, np.ndarray, str]:
    """CPU seconds to scan every shard of `name` with a fresh reader (parts as the index job cuts them), the
    samples' token counts, and the checksum dtype of its first shard."""
    from loomdata.indexing._job import DEFAULT_PART_BYTES
    from loomdata.sources import make_reader

    source = spec.source(name)
    reader = make_reader(source, spec.tokenizer, spec.images)
    t0, counts = time.process_time(), []
    for path in spec.resolve_paths(source):
        parts = reader.num_parts(path, DEFAULT_PART_BYTES)
        counts += [reader.scan(path, p, parts).rows.column("num_tokens").to_numpy() for p in range(parts)]
    took = time.process_time() - t0
    paths = spec.resolve_paths(source)
    checksum_dtype = getattr(reader, "checksum_dtype", None)  # absent in a loomdata of the int32 definition
    dtype = np.dtype(checksum_dtype(paths[0])).str if checksum_dtype is not None and paths else "<i4"
    reader.close()
    return took, np.concatenate(counts).astype(np.int64), dtype


def _read_bin_s(spec: Spec, name: str, chunk: int = 1 << 22) -> float:
    """CPU seconds to read a Megatron source's .bin files through one reused buffer (the bytes alone)."""
    buf = bytearray(chunk)
    t0 = time.process_time()
    for p in spec.resolve_paths(spec.source(name)):
        with open(f"{p}.bin", "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.process_time() - t0


def _checksum_name() -> str:
    """The checksum definition of the loomdata on the path (its `CHECKSUM`)."""
    from loomdata.sources import _integrity

    return str(getattr(_integrity, "CHECKSUM", "?"))


def _checksum_cost(spec: Spec, names: list[str], repeat: int) -> list[dict[str, Any]]:
    """Per source: scan CPU time with and without the hash calls (alternating, best of `repeat`), the hash alone."""
    pa.set_cpu_count(1)  # as in a Dask worker (OMP_NUM_THREADS=1, one thread)
    rows = []
    for name in names:
        _scan_source(spec, name)  # warm: imports, page cache
        with_runs, without_runs = [], []
        for _ in range(repeat):
            with_runs.append(_scan_source(spec, name)[0])
            with _no_checksums():
                without_runs.append(_scan_source(spec, name)[0])
        _, lengths, dtype = _scan_source(spec, name)
        w, wo = min(with_runs), min(without_runs)
        row = {
            "source": name,
            "format": SOURCES[name]["format"],
            "samples": len(lengths),
            "tokens": int(lengths.sum()),
            "scan_cpu_s": round(w, 4),
            "scan_cpu_no_checksum_s": round(wo, 4),
            "scan_runs_s": [round(x, 4) for x in with_runs],
            "scan_no_checksum_runs_s": [round(x, 4) for x in without_runs],
            "checksum_cost": round(w / wo - 1, 4) if wo > 0 else None,
            "checksum_dtype": dtype,
            "hash_alone_s": round(_checksum_s(spec, [name], repeat, lengths, dtype), 4),
        }
        if SOURCES[name]["format"] == "megatron":
            row["read_bin_s"] = round(min(_read_bin_s(spec, name) for _ in range(repeat)), 4)
        print(
            f"  {name:8s} scan {w:.3f}s cpu, without hashing {wo:.3f}s "
            f"(+{100 * (w / wo - 1) if wo else float('nan'):.1f}%), hash alone {row['hash_alone_s']:.3f}s"
            + (f", .bin read alone {row['read_bin_s']:.3f}s" if "read_bin_s" in row else ""),
            file=sys.stderr,
        )
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small", "large"], help="corpus size to generate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=None, help="corpus dir (generated there if absent; kept)")
    ap.add_argument("--sources", default=",".join(SOURCES), help="comma-separated: " + ",".join(SOURCES))
    ap.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (the best is reported)")
    ap.add_argument("--out", type=Path, default=None, help=f"results file (default {RESULTS.name})")
    ap.add_argument(
        "--checksum-cost",
        action="store_true",
        help=f"in-process scan with and without the hash calls instead (default out {CHECKSUM_RESULTS.name})",
    )
    args = ap.parse_args()

    from distributed import Client, LocalCluster

    names = [n for n in args.sources.split(",") if n]
    workers = [int(w) for w in args.workers.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="loom-bench-index-"))
    try:
        root = args.data or scratch / "corpus"
        t0 = time.perf_counter()
        corpus = generate_corpus(root, args.size, args.seed)
        print(f"corpus {args.size} at {root} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        spec = _spec(root, scratch / "work", names)
        if args.checksum_cost:
            _write(
                args.out or CHECKSUM_RESULTS,
                {
                    "benchmark": "index_scan_checksum",
                    "corpus": corpus.to_dict() | {"root": str(root)},
                    "cpus": os.cpu_count(),
                    "repeat": args.repeat,
                    "checksum": _checksum_name(),
                    "results": _checksum_cost(spec, names, args.repeat),
                },
            )
            return
        rows: list[dict[str, Any]] = []
        for n_workers in workers:
            with (
                LocalCluster(
                    n_workers=n_workers,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=None,
                    local_directory=str(scratch / "dask"),
                ) as cluster,
                Client(cluster) as client,
            ):
                for name in names:
                    rows.append(
                        _compare(spec, client, name, [name], n_workers, args.repeat)
                        | {"format": SOURCES[name]["format"]}
                    )
                rows.append(_compare(spec, client, "all", names, n_workers, args.repeat) | {"format": "mixed"})
        _report(rows)
        out = {
            "benchmark": "index_scan",
            "corpus": corpus.to_dict() | {"root": str(root)},
            "cpus": os.cpu_count(),
            "repeat": args.repeat,
            "goal_ratio_per_worker": GOAL,
            "results": rows,
            "ratio_per_worker_all_sources": {
                str(r["workers"]): r["ratio_per_worker"] for r in rows if r["source"] == "all"
            },
        }
        _write(args.out or RESULTS, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write(path: Path, out: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _report(rows: list[dict[str, Any]]) -> None:
    head = f"{'source':8s} {'wk':>2s} {'samples':>8s} {'MB':>6s} {'index s':>8s} {'floor1 s':>8s} {'floor s':>8s} "
    head += f"{'noop s':>6s} {'idx smp/s':>10s} {'fl1 smp/s':>10s} {'idx MB/s':>8s} {'fl1 MB/s':>8s} "
    head += f"{'ratio/wk':>8s} {'vs thr.':>7s} {'cksum s':>7s} {'cksum %':>7s}"
    print(head)
    for r in rows:
        print(
            f"{r['source']:8s} {r['workers']:>2d} {r['samples']:>8d} {r['bytes'] / 1e6:>6.1f} {r['index_s']:>8.3f} "
            f"{r['floor_1thread_s']:>8.3f} {r['floor_s']:>8.3f} {r['index_noop_s']:>6.3f} "
            f"{r['index_samples_per_s']:>10.0f} {r['floor_1thread_samples_per_s']:>10.0f} {r['index_mb_per_s']:>8.1f} "
            f"{r['floor_1thread_mb_per_s']:>8.1f} {r['ratio_per_worker']:>8.2f} "
            f"{r['ratio_per_worker_vs_threaded_floor']:>7.2f} {r['checksum_s']:>7.3f} {100 * r['checksum_share']:>7.1f}"
        )
    print(
        "ratio/wk = floor time on one thread / index time / workers (a worker runs one thread); "
        "vs thr. = the same against pyarrow's default thread pool (all cores)"
    )


if __name__ == "__main__":
    main()
