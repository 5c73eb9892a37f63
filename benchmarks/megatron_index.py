"""loomdata's planner next to Megatron-LM's index building, on the same index: time, CPU and peak memory.

What a Megatron user runs before training instead of `loom plan`: `BlendedMegatronDatasetBuilder(GPTDataset,
...).build()` over one `.bin/.idx` dataset per source, which builds each source's document index (all epochs
shuffled), its sample index (megatron-core's C++ `build_sample_idx`: where each `seq_len`-token row starts) and
its shuffle index, then the blend's dataset index (C++ `build_blending_indices`: which source each row comes
from, in proportion to the weights), and caches them all as `.npy` files. It packs by concatenating and cutting
(no balancing: every rank's attention cost is left to chance), so it is the floor a planner that balances is
measured against, not a peer doing the same work.

Both run in their own subprocess (so `ru_maxrss` is that run's peak) on the same synthetic index
(`plan_scale.py`'s: log-normal lengths, 80% web / 20% code, 1 or many sources, weights in proportion to
tokens) and the same number of `seq_len` rows (loomdata's steps x dp x micro-batches; Megatron 1% fewer, so that
its blend's 0.5% surplus does not start a second epoch of every source). The `.idx` files are
written by megatron-core's own `IndexedDatasetBuilder` from the index's token counts; the `.bin` files are
sparse (index building reads only the `.idx`). Megatron's build is timed from the builder's call to its
return (reading the `.idx` files, building and caching every index); loomdata's as `plan_scale.py` times it
(`make_plan`: index tables read, membership, balancing, manifest and report written). Reported per indexed
document: documents per second and per CPU-second, peak RSS above each process's post-import baseline.

    .venv/bin/python benchmarks/megatron_index.py --sizes 1e6 1e7 --sources 1 300 --dps 4 1024

Writes benchmarks/results/megatron_index.json (or --out). megatron-core is a test dependency of loomdata
(`.[test]`); its C++ helpers ship compiled in its wheel (a source build needs a C++ compiler).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

import plan_scale

RESULTS = Path(__file__).resolve().parent / "results" / "megatron_index.json"
MEGATRON_ROWS = 0.99
"""Megatron is asked for this share of loomdata's rows: its blend asks each source for 0.5% more than its weight's
share (`mid_level_dataset_surplus`), which for one epoch of every source would build a second epoch of each (twice
its work); 1% fewer rows keeps it to one epoch, its best case."""


def _import_megatron() -> Any:
    """megatron.core.datasets, its warnings about absent Transformer Engine / Apex silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.datasets.blended_megatron_dataset_builder as builder
        import megatron.core.datasets.gpt_dataset as gpt
        import megatron.core.datasets.indexed_dataset as indexed
    return builder, gpt, indexed


def child_files(workdir: Path) -> dict[str, Any]:
    """Write one Megatron dataset a source (`.idx` by megatron-core's builder, a sparse `.bin`) from the index."""
    import torch

    from loomdata.schemas.layout import read_index

    _, _, indexed = _import_megatron()
    info = json.loads((workdir / "index-info.json").read_text())
    root = workdir / "megatron"
    root.mkdir(exist_ok=True)
    prefixes = []
    for k, name in enumerate(info["weights"]):
        lengths = read_index(workdir, name, columns=["num_tokens"])[0]["num_tokens"].to_numpy().astype(np.int32)
        prefix = str(root / f"s{k:03d}")
        build = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        build.add_document(torch.empty(0, dtype=torch.int32), lengths.tolist())
        build.finalize(prefix + ".idx")
        with open(prefix + ".bin", "r+b") as f:  # sparse: the tokens' bytes, never written nor read
            f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
        prefixes.append(prefix)
    return {"prefixes": prefixes, "weights": list(info["weights"].values())}


class _Tokenizer:
    """What a GPTDatasetConfig reads of a tokenizer (its vocabulary size; index building never tokenizes)."""

    vocab_size = 50_257
    eod = 50_256
    pad = 50_255
    unique_identifiers: ClassVar[dict[str, str]] = {"class": "benchmark"}  # part of the indices' cache key


def child_megatron(workdir: Path, rows: int) -> dict[str, Any]:
    """Build Megatron's blended GPT indices for `rows` rows of seq_len tokens over the workdir's datasets."""
    builder, gpt, _ = _import_megatron()
    files = json.loads((workdir / "megatron" / "files.json").read_text())
    cache = tempfile.mkdtemp(prefix="megatron-cache-", dir=workdir)
    blend = (files["prefixes"], files["weights"]) if len(files["prefixes"]) > 1 else (files["prefixes"], None)
    config = gpt.GPTDatasetConfig(
        random_seed=1234,
        sequence_length=plan_scale.SEQ_LEN,
        blend=blend,
        split="100,0,0",
        path_to_cache=cache,
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
    )
    import torch.distributed as dist

    # Megatron builds the blend on rank 0 of an initialised process group, as in training: a group of one
    rendezvous = Path(tempfile.mkdtemp(prefix="megatron-pg-", dir=workdir)) / "pg"  # fresh: a crashed run's is left
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    base = plan_scale._rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    datasets = builder.BlendedMegatronDatasetBuilder(gpt.GPTDataset, [rows, 0, 0], lambda: True, config).build()
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    train = datasets[0]
    dist.destroy_process_group()
    parts = getattr(train, "datasets", [train])  # a BlendedDataset's GPTDatasets, or the one GPTDataset
    documents = sum(len(d.dataset.sequence_lengths) for d in parts)
    cached = sum(p.stat().st_size for p in Path(cache).rglob("*.npy"))
    return {
        "seconds": secs,
        "cpu_seconds": cpu,
        "rows": len(train),
        "rss_base_mb": base,
        "rss_peak_mb": plan_scale._rss_mb(),
        "cache_bytes": cached,
        "epochs": sum(len(d.document_index) for d in parts) / documents,  # documents indexed / documents
    }


def _call(*args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True, env=env)
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return r


def measure(samples: int, n_sources: int, dps: list[int], workdir: Path) -> list[dict[str, Any]]:
    """Write the index and the Megatron datasets once, then plan and build at each dp; a row per dp."""
    plan_scale._call(
        "--child", "index", "--samples", str(samples), "--n-sources", str(n_sources), "--workdir", str(workdir)
    )
    files = _call("--child", "files", "--workdir", str(workdir))
    (workdir / "megatron" / "files.json").write_text(json.dumps(files))
    out = []
    for dp in dps:
        loom = plan_scale.run("loom", samples, n_sources, dp, workdir)
        rows = loom["steps"] * dp * plan_scale.MICRO_BATCHES
        meg = _call("--child", "megatron", "--workdir", str(workdir), "--rows", str(int(rows * MEGATRON_ROWS)))
        for r in (loom, meg):
            r["docs_per_s"] = samples / r["seconds"]
            r["bytes_per_doc"] = (r["rss_peak_mb"] - r["rss_base_mb"]) * 2**20 / samples
        loom["cpu_seconds"] = loom["plan_cpu_seconds"]
        loom["docs_per_cpu_s"] = samples / loom["cpu_seconds"]
        meg["docs_per_cpu_s"] = samples / meg["cpu_seconds"]
        out.append(
            {
                "samples": samples,
                "sources": n_sources,
                "dp": dp,
                "rows": rows,
                "loomdata": loom,
                "megatron": meg,
                "cpu_ratio": loom["cpu_seconds"] / meg["cpu_seconds"],
                "memory_ratio": loom["bytes_per_doc"] / max(meg["bytes_per_doc"], 1e-9),
            }
        )
        print(_row(out[-1]), flush=True)
    return out


HEAD = (
    f"{'docs':>12}{'src':>5}{'dp':>6}{'rows':>11}  {'loom s':>7}{'CPU s':>7}{'B/doc':>7}  {'megatron s':>10}"
    f"{'CPU s':>7}{'B/doc':>7}  {'CPU ratio':>9}{'mem ratio':>10}  loom imbalance (concat-and-chunk)"
)


def _row(r: dict[str, Any]) -> str:
    lo, me = r["loomdata"], r["megatron"]
    return (
        f"{r['samples']:>12,}{r['sources']:>5}{r['dp']:>6}{r['rows']:>11,}"
        f"  {lo['seconds']:>7.1f}{lo['cpu_seconds']:>7.1f}{lo['bytes_per_doc']:>7.1f}"
        f"  {me['seconds']:>10.1f}{me['cpu_seconds']:>7.1f}{me['bytes_per_doc']:>7.1f}"
        f"  {r['cpu_ratio']:>8.2f}x{r['memory_ratio']:>9.2f}x  {lo['imbalance_mean']:.4f}"
        f" ({lo['baseline_imbalance_mean']:.4f}); Megatron {me['epochs']:.2f} epochs"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6], help="indexed documents")
    ap.add_argument("--sources", nargs="+", type=int, default=[1, 300])
    ap.add_argument("--dps", nargs="+", type=int, default=[4, 1024])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", choices=["files", "megatron"], help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "files":
        print(json.dumps(child_files(args.workdir)))
        return 0
    if args.child == "megatron":
        print(json.dumps(child_megatron(args.workdir, args.rows)))
        return 0
    print(HEAD, flush=True)
    runs: list[dict[str, Any]] = []
    for n in [int(s) for s in args.sizes]:
        for n_src in args.sources:
            with tempfile.TemporaryDirectory(prefix="loom-megatron-") as d:
                runs += measure(n, n_src, args.dps, Path(d))
    out = {"load_average": os.getloadavg(), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
