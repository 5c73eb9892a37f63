"""What a decoded Parquet row group keeps of Arrow's pool: the serving reader's `load_unit` (the reader's own chunk,
`_unmasked`) against pyarrow's read plus `combine_chunks` (the copy it replaced), beside each one's `nbytes` (what
the loaders' memory budget counts). pool_held: `pa.total_allocated_bytes()` gained with only the array alive.

    .venv/bin/python benchmarks/parquet_pool_held.py --out benchmarks/results/parquet_pool_s29_review29.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.schemas import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import make_reader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    spec = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["x"], tokens_field="ids")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.parquet"
        for typ in (pa.list_(pa.int32()), pa.large_list(pa.int32()), pa.list_(pa.int64())):
            data = [rng.integers(0, 50_000, int(n)).tolist() for n in rng.integers(50, 2000, 900)]
            pq.write_table(pa.table({"ids": pa.array(data, type=typ)}), path, row_group_size=450)
            reader = make_reader(spec, TokenizerSpec(), ImageSpec())
            reader.load_unit(path, 1)  # the footer read once
            for mode in ("reader", "combine_chunks"):
                gc.collect()
                base = pa.total_allocated_bytes()
                if mode == "reader":
                    got = reader.load_unit(path, 0)
                    assert got is not None
                    arr = got[0]
                    del got
                else:
                    arr = pq.ParquetFile(path).read_row_group(0).column("ids").combine_chunks()
                gc.collect()
                held = pa.total_allocated_bytes() - base
                sizes = [None if b is None else b.size for b in arr.buffers()]
                rows.append({"type": str(typ), "mode": mode, "nbytes": arr.nbytes, "pool_held": held, "buffers": sizes})
                print(rows[-1], f"held/nbytes {held / arr.nbytes:.4f}")
                del arr
    if args.out:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        cmd = f".venv/bin/python benchmarks/parquet_pool_held.py --out {args.out}"
        note = f"{args.note} {when}, load {load}; command: {cmd}"
        args.out.write_text(json.dumps({"note": note.strip(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
