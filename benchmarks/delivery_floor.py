"""The CPU floor of delivering Parquet tokens to another process, next to the concat-and-cut peer, in one run.

Issue 8 asks loomdata to deliver, per consumer, 5x the tokens/s of a plain `DataLoader` that concatenates
shuffled documents and cuts rows (`stream_throughput.py`'s `concat_cut`), and more tokens per CPU-second than
it. This script measures what any loader of those files must spend per token at the least, on the same data
as `stream_throughput.py` (its `_write_data`), single-threaded, in this process and one child:

- `decode`: read and decode every row group's token column once (`pyarrow`, `pre_buffer=False`, one thread)
  and view its values as NumPy: what every Parquet loader pays, each token once.
- `transfer`: send rows of `seq_len` int32 tokens from one process to another over a Unix socket pair
  (1 MiB `sendall`, `recv_into` a preallocated buffer; the CPU of both sides): what a loader that runs apart
  from the training rank pays at the least, each token once (loomdata's same-host gateway is such a socket).
- `concat_cut`: the peer over all files in this process, as `stream_throughput.py` runs it at its best setting
  (`DataLoader(num_workers=0, batch_size=None)`: no transfer at all); `concat_cut_bare` the same iterator without
  the DataLoader (shown, not used in the bounds).

A loader that reads in other processes pays at least `decode` + `transfer` per token, so its tokens per
CPU-second are at most `floor = 1 / (1/decode + 1/transfer)`. On `--cores` busy cores, its tokens/s per
consumer over the peer's are at most `(1/concat_cut + 1/transfer) / (1/decode + 1/transfer)` when the peer
has every core too (DataLoader workers, whose move to the consumer is taken to cost one `transfer`), and
`cores * floor / (N * concat_cut * min(1, cores / N))` when each of N consumers runs the peer in itself
(`num_workers=0`, one core each). The table prints both next to the issue's 5x. Nothing here is
loomdata's code: it is the floor under any design.

    .venv/bin/python benchmarks/delivery_floor.py                       # about a minute
    .venv/bin/python benchmarks/delivery_floor.py --docs 100000 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_throughput import _ConcatCut, _write_data  # same data, same peer

RESULTS = Path(__file__).resolve().parent / "results" / "delivery_floor.json"
CHUNK = 1 << 20  # bytes per send


def _cpu() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime


def _decode(files: list[Path]) -> tuple[int, float]:
    """Every row group's token column once: (tokens, CPU seconds)."""
    tokens, c0 = 0, _cpu()
    for f in files:
        pf = pq.ParquetFile(f, pre_buffer=False)
        for g in range(pf.metadata.num_row_groups):
            col = pf.read_row_group(g, columns=["tokens"], use_threads=False).column(0).combine_chunks()
            values = col.values.to_numpy()
            tokens += len(values)
    return tokens, _cpu() - c0


def _concat_cut(files: list[Path], seq_len: int, tokens: int, bare: bool = False) -> tuple[int, float]:
    """The peer over every file in this process (rank 0 of 1), as many full rows as the files hold: through
    `DataLoader(num_workers=0)` as the benchmark's consumers run it, or the bare iterator."""
    from torch.utils.data import DataLoader

    rows = tokens // seq_len
    c0 = _cpu()
    dataset = _ConcatCut([str(f) for f in files], 0, 1, seq_len)
    items = iter(dataset) if bare else iter(DataLoader(dataset, batch_size=None, num_workers=0))
    got = 0
    for item in itertools.islice(items, rows):
        got += int(item["cu_seqlens"][-1])
    return got, _cpu() - c0


def _receiver(sock: socket.socket, nbytes: int, out: Any) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    c0, left = _cpu(), nbytes
    while left:
        n = sock.recv_into(view[: min(CHUNK, left)])
        if n == 0:
            break
        left -= n
    out.put(_cpu() - c0)


def _transfer(tokens: int) -> tuple[int, float]:
    """Send `tokens` int32 tokens to a child process over a Unix socket pair: (tokens, CPU of both sides)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    nbytes = tokens * 4
    child = ctx.Process(target=_receiver, args=(b, nbytes, out))
    child.start()
    data = np.random.default_rng(0).integers(1, 50_000, size=CHUNK // 4, dtype=np.int32).tobytes()
    c0, left = _cpu(), nbytes
    while left:
        n = min(CHUNK, left)
        a.sendall(data[:n] if n < CHUNK else data)
        left -= n
    send_cpu = _cpu() - c0
    recv_cpu = out.get(timeout=120)
    child.join(timeout=30)
    a.close()
    b.close()
    return tokens, send_cpu + recv_cpu


def _bound(floor: float, peer: float, cores: int, consumers: int) -> float:
    """loomdata per consumer over the peer per consumer, at best, with `consumers` ranks on `cores` cores."""
    return cores * floor / (consumers * peer * min(1.0, cores / consumers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3, help="each arm this many times, best kept")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--data", type=Path, default=None, help="folder for the data (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as the benchmark's consumers
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or Path(tmp)
        files = sorted(root.glob("*/*.parquet")) or _write_data(root, args.docs, seed=0)
        arms = ("decode", "transfer", "concat_cut", "concat_cut_bare")
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
        total = 0
        for _ in range(args.rounds):  # alternating arms, so load swings hit each alike
            total, cpu = _decode(files)
            runs["decode"].append({"tokens": total, "cpu_s": cpu})
            tok, cpu = _concat_cut(files, args.seq_len, total)
            runs["concat_cut"].append({"tokens": tok, "cpu_s": cpu})
            tok, cpu = _concat_cut(files, args.seq_len, total, bare=True)
            runs["concat_cut_bare"].append({"tokens": tok, "cpu_s": cpu})
            tok, cpu = _transfer(total)
            runs["transfer"].append({"tokens": tok, "cpu_s": cpu})
    best = {k: max(r["tokens"] / r["cpu_s"] for r in v) for k, v in runs.items()}
    floor = 1.0 / (1.0 / best["decode"] + 1.0 / best["transfer"])
    bounds = {n: _bound(floor, best["concat_cut"], args.cores, n) for n in (1, 2, 4)}
    print(f"{'arm':<12}{f'tokens per CPU-s (best of {args.rounds})':>32}")
    for k, v in best.items():
        print(f"{k:<12}{v / 1e6:>30.1f}M")
    print(f"{'floor':<12}{floor / 1e6:>30.1f}M   (decode + transfer: {floor / best['concat_cut']:.2f}x concat_cut)")
    every_core = (1.0 / best["concat_cut"] + 1.0 / best["transfer"]) * floor
    print(f"peer with every core (DataLoader workers): loomdata per consumer at most {every_core:.2f}x (goal 5x)")
    for n, b in bounds.items():
        print(f"{n} consumer(s), peer in the consumer, {args.cores} cores: at most {b:.2f}x concat_cut's (goal 5x)")
    result = {
        "benchmark": "delivery_floor",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "parameters": {"docs": args.docs, "seq_len": args.seq_len, "rounds": args.rounds, "cores": args.cores},
        "runs": runs,
        "tokens_per_cpu_s": {k: round(v) for k, v in best.items()},
        "floor_tokens_per_cpu_s": round(floor),
        "floor_over_concat_cut": round(floor / best["concat_cut"], 3),
        "bound_per_consumer_peer_every_core": round(every_core, 3),
        "bound_per_consumer_peer_in_consumer": {str(n): round(b, 3) for n, b in bounds.items()},
        "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
