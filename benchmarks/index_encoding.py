"""An index table's Parquet encoding: what `write_table` writes for TableKind.INDEX against dictionaries on every
column (what it wrote before session 27), on the same synthetic table, side by side in one run.

The table has the shape `loom index` writes: `sample` 0..n-1, `shard` in runs, `row` counting up within each shard,
lognormal `num_tokens`, zero `num_image_tokens` and random `checksum`. Reported per encoding: CPU seconds to write,
the file's size, and CPU seconds to read the four columns the planner reads (`planning._plan._read_source`, in its
batches), each the median of `--rounds` alternating rounds, with the ratios.

    .venv/bin/python benchmarks/index_encoding.py --rows 10000000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_PLANNER_COLUMNS = ["sample", "shard", "num_tokens", "num_image_tokens"]


def _table(rows: int, shards: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    per = -(-rows // shards)
    shard = np.repeat(np.arange(shards, dtype=np.uint32), per)[:rows]
    return pa.table(
        {
            "sample": np.arange(rows, dtype=np.uint64),
            "shard": shard,
            "row": (np.arange(rows, dtype=np.uint64) - shard.astype(np.uint64) * np.uint64(per)),
            "num_tokens": np.clip(rng.lognormal(np.log(900), 1.0, rows), 16, 100_000).astype(np.uint32),
            "num_image_tokens": np.zeros(rows, dtype=np.uint32),
            "checksum": rng.integers(0, 1 << 32, rows, dtype=np.uint32),
        }
    )


def _measure(table: pa.Table, path: Path, write: Any) -> dict[str, float]:
    c = time.process_time()
    write(table, path)
    wrote = time.process_time() - c
    c = time.process_time()
    pf = pq.ParquetFile(path)
    for batch in pf.iter_batches(batch_size=1 << 16, columns=_PLANNER_COLUMNS, use_threads=False):
        for col in batch.columns:
            col.to_numpy()
    read = time.process_time() - c
    return {"write_cpu_s": wrote, "read_cpu_s": read, "bytes": path.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--shards", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "index_encoding.json")
    args = ap.parse_args(argv)
    from loomdata.schemas.tables import TableKind, write_table

    table = _table(args.rows, args.shards, seed=0)

    def loom(t: pa.Table, p: Path) -> None:
        write_table(t, p, TableKind.INDEX)

    def dictionaries(t: pa.Table, p: Path) -> None:  # write_table's INDEX options before session 27, stamp aside
        pq.write_table(t, str(p), compression="zstd", use_dictionary=True, write_statistics=True, store_schema=True)

    runs: dict[str, list[dict[str, float]]] = {"loomdata": [], "dictionaries": []}
    with tempfile.TemporaryDirectory(prefix="loom-index-encoding-") as tmp:
        for r in range(args.rounds):
            order = [("loomdata", loom), ("dictionaries", dictionaries)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                runs[name].append(_measure(table, Path(tmp) / f"{name}.parquet", fn))
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    print(f"{'encoding':<14}{'write CPU s':>12}{'MB':>8}{'read CPU s':>12}   ({args.rows:,} rows, medians)")
    for name, m in med.items():
        print(f"{name:<14}{m['write_cpu_s']:>12.3f}{m['bytes'] / 1e6:>8.1f}{m['read_cpu_s']:>12.3f}")
    ratios = {m: med["dictionaries"][m] / med["loomdata"][m] for m in ("write_cpu_s", "bytes", "read_cpu_s")}
    print("dictionaries / loomdata: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "index_encoding",
                "parameters": vars(args) | {"out": str(args.out)},
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "pyarrow": pa.__version__},
                "load": os.getloadavg(),
                "medians": med,
                "ratios_dictionaries_over_loomdata": ratios,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
