"""Kept units as uint16 (`parquet._narrowed`) against int32, in one process: the decode-and-keep cost, the cache's
bytes, and the loader's read path (`_read` with `verify: sample`) over units held in the cache.

Both variants run in the same process, alternating (`--rounds`): "wide" switches narrowing off (`_narrowed` the
identity, main's behaviour); "narrow" is this checkout. Data: `--files` Parquet files of `--docs` documents of
lognormal length (mean ~200 tokens, as memory.py) with ids below 50,000 in row groups of 128, list<int32>.

    .venv/bin/python benchmarks/narrow_units.py --out benchmarks/results/narrow_units_s19.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.execution._loader import REQUEST_DTYPE, _read
from loomdata.execution._partition import LoaderPartition
from loomdata.execution._sample_index import SampleIndex
from loomdata.execution._verify import ShardCheck, Verifier
from loomdata.schemas import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.schemas.spec import VerifyMode
from loomdata.sources import LruUnitCache, make_reader, parquet
from loomdata.sources._integrity import checksums, stat_shard
from loomdata.sources.parquet import ParquetReader

RG = 128


def _write(root: Path, files: int, docs: int, seed: int) -> tuple[dict[int, Path], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    paths, all_docs = {}, []
    for s in range(files):
        lens = np.maximum(1, rng.lognormal(np.log(200) - 0.18, 0.6, size=docs).astype(np.int64))
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        values = rng.integers(1, 50_000, size=int(offsets[-1]), dtype=np.int32)
        col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        p = root / f"part-{s}.parquet"
        pq.write_table(pa.table({"ids": col}), p, row_group_size=RG)
        paths[s] = p
        all_docs += np.split(values, offsets[1:-1])
    return paths, all_docs


def _reader() -> ParquetReader:
    spec = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["x"], tokens_field="ids")
    r = make_reader(spec, TokenizerSpec(), ImageSpec())
    assert isinstance(r, ParquetReader)
    r.use_unit_cache(LruUnitCache(max_bytes=1 << 34))
    return r


def _one(narrow: bool, paths: dict[int, Path], index: SampleIndex, reqs: list[np.ndarray], n: int) -> dict[str, Any]:
    """Decode and keep every row group (load_unit and put, as a read ahead), then serve `reqs` from the cache."""
    saved = parquet._narrowed
    if not narrow:
        parquet._narrowed = lambda arr: arr  # type: ignore[assignment]
    try:
        reader = _reader()
        cache = reader.unit_cache
        assert isinstance(cache, LruUnitCache)
        t0 = time.process_time()
        for p in paths.values():
            info = reader._open(p)
            for g in range(len(info.rg_bytes)):
                got = reader.load_unit(p, g)
                assert got is not None
                cache.put((str(p), g), got[0], got[1])
        t1 = time.process_time()
        stats = {s: stat_shard(p, SourceFormat.PARQUET) for s, p in paths.items()}
        shards = {s: ShardCheck(st.size_bytes, st.mtime_ns, st.fingerprint) for s, st in stats.items()}
        verifier = Verifier("s", VerifyMode.SAMPLE, SourceFormat.PARQUET, shards)
        part = LoaderPartition(
            source_id=0, source="s", part=0, first_shard=0, stop_shard=len(paths), first_sample=0, stop_sample=n
        )
        crc, tokens = 0, 0
        t2 = time.process_time()
        for req in reqs:
            out, keys, _ = _read(reader, req, index, paths, 14, part, verifier)
            assert keys is not None
            crc = zlib.crc32(out.tokens.tobytes(), crc)
            tokens += len(out.tokens)
        t3 = time.process_time()
        return {
            "keep_cpu_s": round(t1 - t0, 4),
            "read_cpu_s": round(t3 - t2, 4),
            "cache_mib": round(cache.nbytes / 2**20, 2),
            "tokens": tokens,
            "crc": crc,
        }
    finally:
        parquet._narrowed = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--docs", type=int, default=20_000, help="documents per file")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--per-request", type=int, default=64, help="segments per request (random samples, whole)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "narrow_units.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="loom-narrow-") as tmp:
        paths, docs = _write(Path(tmp), args.files, args.docs, seed=0)
        n = len(docs)
        shard = np.repeat(np.arange(args.files), args.docs)
        row = np.tile(np.arange(args.docs), args.files)
        index = SampleIndex.of(np.arange(n, dtype=np.uint64), shard, row, checksums(docs))
        rng = np.random.default_rng(1)
        reqs = []
        for _ in range(args.requests):
            req = np.zeros(args.per_request, dtype=REQUEST_DTYPE)
            req["sample"] = rng.integers(0, n, size=args.per_request)
            req["length"] = [len(docs[i]) for i in req["sample"].tolist()]
            reqs.append(req)
        runs: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for narrow in (False, True) if r % 2 == 0 else (True, False):
                got = _one(narrow, paths, index, reqs, n)
                runs.append({"round": r, "variant": "narrow" if narrow else "wide", **got})
                print(json.dumps(runs[-1]), flush=True)
    summary: dict[str, Any] = {}
    for v in ("wide", "narrow"):
        mine = [x for x in runs if x["variant"] == v]
        summary[v] = {k: statistics.median(x[k] for x in mine) for k in ("keep_cpu_s", "read_cpu_s", "cache_mib")} | {
            "crc": sorted({x["crc"] for x in mine}),
            "tokens": mine[0]["tokens"],
        }
    summary["narrow_over_wide"] = {
        k: round(summary["narrow"][k] / summary["wide"][k], 3) for k in ("keep_cpu_s", "read_cpu_s", "cache_mib")
    }
    summary["same_tokens"] = summary["narrow"]["crc"] == summary["wide"]["crc"]
    print(json.dumps(summary), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "narrow_units",
                "parameters": {k: str(v) for k, v in vars(args).items()},
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
