"""The sink's manifest writing, two trees side by side: 39 synthetic blocks shaped like a 10M-sample, 300-source,
dp-4 plan's (4,276 steps and ~264K placed pieces a block, partitions of 2^18 drawn segments) fed to each tree's
`ManifestWriter` as its `StepSink.add_block` feeds it (a tree whose `add_block` takes `take=` gets the gathered
columns that way, else the columns built as main 1e0c1e4 builds them), rounds alternating, CPU seconds of the
feeding and flushing; the files of both trees must be byte-identical (exit 1 otherwise).

    .venv/bin/python benchmarks/manifest_write_ab.py --before /tmp/base29/src --after src --rounds 6
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np


def _manifest_module(src: str) -> ModuleType:
    for name in [k for k in sys.modules if k.startswith("loomdata")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(src).resolve()))
    try:
        import loomdata.planning._manifest as man
    finally:
        sys.path.pop(0)
    return man


def _blocks(n_blocks: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_blocks):
        steps, segs = 4276, 262_000
        per = rng.integers(52, 72, steps)
        rows = int(per.sum())
        out.append(
            {
                "nb": steps,
                "rs": np.repeat(np.arange(steps), per).astype(np.int64),
                "item": rng.integers(0, segs, rows),
                "delta": np.where(rng.random(rows) < 0.01, rng.integers(0, 4096, rows), 0),
                "length": rng.integers(1, 4096, rows),
                "rank": np.sort(rng.integers(0, 4, rows)),
                "mb": rng.integers(0, 4, rows),
                "lane": np.zeros(rows, dtype=np.uint8),
                "source": rng.integers(0, 300, segs).astype(np.uint16),
                "sample": rng.integers(0, 2**33, segs).astype(np.uint64),
                "offset": rng.integers(0, 2**20, segs).astype(np.uint32),
            }
        )
    return out


def _feed(man: ModuleType, blocks: list[dict[str, Any]], out: Path) -> list[Any]:
    takes = "take" in inspect.signature(man.ManifestWriter.add_block).parameters
    drawn = np.concatenate([np.bincount(b["rs"], minlength=b["nb"]) for b in blocks])
    w = man.ManifestWriter(out, "p", man.file_bounds(drawn))
    t0 = 0
    for b in blocks:
        steps, item = range(t0, t0 + b["nb"]), b["item"]
        src = b["source"][item]
        cols = {"dp_rank": b["rank"], "micro_batch": b["mb"], "source": src, "length": b["length"], "lane": b["lane"]}
        if takes:
            w.add_block(
                steps,
                b["rs"],
                cols,
                take=(item, {"sample": b["sample"], "offset": b["offset"]}),
                offset_delta=b["delta"],
            )
        else:
            cols["sample"] = b["sample"][item]
            cols["offset"] = b["offset"][item].astype(np.int64) + b["delta"]
            w.add_block(steps, (b["rs"] + t0).astype(np.uint32), cols)
        t0 += b["nb"]
    files: list[Any] = w.close(t0 - 1)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=39)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    trees = {"before": _manifest_module(args.before), "after": _manifest_module(args.after)}
    blocks = _blocks(args.blocks, seed=0)
    cpu: dict[str, list[float]] = {"before": [], "after": []}
    digest: dict[str, str] = {}
    tmp = Path(tempfile.mkdtemp(prefix="manifest_ab_"))
    try:
        for r in range(args.rounds):
            for name in ["before", "after"] if r % 2 == 0 else ["after", "before"]:
                out = tmp / name
                shutil.rmtree(out, ignore_errors=True)
                c = time.process_time()
                files = _feed(trees[name], blocks, out)
                cpu[name].append(time.process_time() - c)
                digest[name] = hashlib.sha256(b"".join((out / f.path).read_bytes() for f in files)).hexdigest()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = digest["before"] == digest["after"]
    result = {
        "benchmark": "manifest_write_ab",
        "note": args.note,
        "rows": int(sum(len(b["rs"]) for b in blocks)),
        "files_identical": same,
        "cpu_s": cpu,
        "median_cpu_s": {k: float(np.median(v)) for k, v in cpu.items()},
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
