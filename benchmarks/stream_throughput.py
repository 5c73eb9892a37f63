"""Tokens/s delivered to 1, 2 and 4 consumer processes: loomdata's executor vs a plain torch DataLoader.

Both sides read the same pre-tokenized Parquet files (two sources, short and long documents) and
deliver packed int32 sequences of `--seq-len` tokens as torch tensors to each consumer process.

- loomdata: an embedded LocalCluster of 2 worker processes runs the Source Loaders and one Data
  Constructor for a real indexed and planned (cost-balanced) plan; each consumer is a separate process
  iterating `LoomDataset(plan_dir, rank)` over all of its rank's micro-batches. Each consumer count runs a
  whole job: a plan of that many ranks (`--dp 0`, the default since session 18), as the peer's world size is
  the consumer count. `--dp 4` serves one dp-4 plan whose first ranks consume (what earlier sessions
  measured: one consumer was rank 0 of 4, and with `block` shuffle every row group holds documents of all four
  ranks, so its loaders decoded every row group for a quarter of their documents).
- peers, each consumer a torch `DataLoader` over an IterableDataset reading its share of the row groups with
  pyarrow, for the same number of batches (no planning, no balancing), at every `--peer-workers` setting
  (default 0 and 2: the reads in the consumer itself, or in two worker processes whose tensors cross by shared
  memory); each peer is compared at its best setting (most tokens/s), every setting reported beside it:
  `concat_cut`, the fastest simple loader (per row group: shuffle documents, concatenate with Arrow,
  cut full seq_len rows, documents split at row boundaries, as Megatron's GPTDataset does), and
  `greedy`, documents packed greedily one by one in Python (what the first benchmark compared with).
  Every figure is reported against each of them, with the time to the first batch.

`--transports direct dask` measures loomdata once per rank transport (the rank gateway, the default,
and Dask actor calls, LOOM_TRANSPORT=dask), each with a fresh executor, in the same run: the first is
`loomdata`, the others `loomdata_<transport>` with their own ratios; `cpu_s_by_process` splits the
CPU seconds (ranks, each worker, `main`: the scheduler and the serving process), and `cpu_s_by_thread` each
worker's by thread (its event loop `MainThread`: constructors, gateway, Dask comms; `loom-strand` and
`loom-prefetch`: loader reads; `native`: Arrow's and other threads Python did not start).

Tokens are real (non-padding) tokens. CPU seconds are measured for every process involved (Dask
workers and scheduler for loomdata, consumers with their DataLoader workers for both), so
`tokens per CPU-second` is the per-core figure; `tokens per rank CPU-second` counts the consumer processes
alone (not their DataLoader workers, not loomdata's cluster): the CPU that runs beside a training loop. The
ratio loomdata / baseline is printed per consumer count and written to benchmarks/results/stream_throughput.json.

`--verify-repeat R` (default 3) also measures what content verification costs delivery: the same
plan served with the sources' `verify: sample` (the default: every sample's checksum and its shard
checked against the index) and with `verify: off`, R alternating runs each to the largest consumer
count, best run reported (`verify_cost` in the results: tokens/s, CPU seconds of workers and
consumers, the loaders' busy time, where the checks run, and the slowdown; goal under 5%). `--verify-repeat 0` skips it.

    .venv/bin/python benchmarks/stream_throughput.py                 # about 2-3 minutes
    .venv/bin/python benchmarks/stream_throughput.py --steps 800 --docs 40000
    LOOM_BENCH_PROFILE=/tmp/prof .venv/bin/python benchmarks/stream_throughput.py ...   # cProfile ranks + workers
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import resource
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

RESULTS = Path(__file__).resolve().parent / "results" / "stream_throughput.json"
DP = 4
CONSUMERS = (1, 2, 4)


# ---- data -----------------------------------------------------------------------------------------


def _source_names(sources: int) -> list[str]:
    """`web` and `code` for 2 sources; with more, the short documents split evenly over `web00`, `web01`, ..."""
    if sources < 2:
        raise SystemExit(f"--sources must be >= 2, got {sources}")
    return ["web", "code"] if sources == 2 else [f"web{k:02d}" for k in range(sources - 1)] + ["code"]


def _write_data(root: Path, docs: int, seed: int, sources: int = 2) -> list[Path]:
    """Pre-tokenized sources: short documents (`web`, 3/4 of `docs`, split evenly over `sources` - 1 sources) and
    long ones (`code`), 2,000 docs per file."""
    rng = np.random.default_rng(seed)
    files = []
    webs = _source_names(sources)[:-1]
    parts = [(name, docs * 3 // 4 // len(webs), 350.0) for name in webs] + [("code", docs // 4, 1400.0)]
    for name, n, mean in parts:
        (root / name).mkdir(parents=True, exist_ok=True)
        lens = np.clip(rng.lognormal(np.log(mean), 0.8, size=n), 8, 16_000).astype(np.int64)
        for k, start in enumerate(range(0, n, 2000)):
            part = lens[start : start + 2000]
            offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int32)
            values = rng.integers(1, 50_000, size=int(offsets[-1]), dtype=np.int32)
            arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            path = root / name / f"part-{k:03d}.parquet"
            pq.write_table(pa.table({"tokens": arr}), path, row_group_size=_ROW_GROUP)
            files.append(path)
    return files


_ROW_GROUP = 256  # documents per Parquet row group (`_write_data`); also the block of `--shuffle block`


def _spec(
    root: Path,
    seq_len: int,
    steps: int,
    micro_batches: int,
    verify: str = "sample",
    shuffle: str = "global",
    dp: int = DP,
    sources: int = 2,
    draw_window: int = 0,
) -> Any:
    from loomdata.schemas import parse_spec

    # `block`: documents drawn a row group at a time, shuffled within a window of 16 row groups (the peer
    # shuffles within one row group); `global`: every document anywhere, each step reading rows of many groups.
    order = {"shuffle": "block", "block_size": _ROW_GROUP, "window": 16} if shuffle == "block" else {}
    names = _source_names(sources)

    return parse_spec(
        {
            "name": "bench-stream",
            "workdir": str(root / ("work" if verify == "sample" else f"work-verify-{verify}")),
            "seed": 0,
            "sources": [
                {
                    "name": name,
                    "format": "parquet",
                    "paths": [f"{name}/*.parquet"],
                    "tokens_field": "tokens",
                    "verify": verify,
                    **order,
                }
                for name in names
            ],
            "mixture": {"weights": {n: (0.5 if n == "code" else 0.5 / (len(names) - 1)) for n in names}},
            "training": {"seq_len": seq_len, "steps": steps, "dp_size": dp, "micro_batches": micro_batches},
            **({"planning": {"draw_window": draw_window}} if draw_window else {}),  # (0: the spec as before it)
        },
        root,
    )


# ---- consumers (each a spawned process) -------------------------------------------------------------


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (DataLoader workers)."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _self_cpu_s() -> float:
    """CPU seconds of this process alone: the part of a consumer's cost that runs beside its training loop."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime


def _consume(items: Iterable[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Real tokens and batches of `items`, the seconds from `t0` to the first one, and the steady part after it."""
    tokens = batches = first_tokens = slots = 0
    first = first_cpu = 0.0
    cpu0 = _self_cpu_s()
    for item in items:
        tokens += int(item["cu_seqlens"][-1])
        slots += len(item["input_ids"])
        batches += 1
        if batches == 1:
            first = time.time() - t0
            first_cpu = _self_cpu_s() - cpu0
            first_tokens = tokens
    t1 = time.time()
    steady_s = t1 - t0 - first
    return {
        "tokens": tokens,
        "batches": batches,
        "row_tokens": slots,
        "first_s": first,
        "first_cpu_s": first_cpu,  # this process's CPU seconds to its first batch (connecting, first answer)
        "t1": t1,
        "steady_tokens_per_s": (tokens - first_tokens) / steady_s if steady_s > 0 else 0.0,
    }


def _faults() -> int:
    """Minor page faults of this process so far (each a fresh page touched: received frames land in new memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _report(rank: int, got: dict[str, Any], t0: float, cpu0: float, self0: float, faults0: int = 0) -> dict[str, Any]:
    return {
        "rank": rank,
        "t0": t0,
        "cpu_s": _cpu_s() - cpu0,
        "rank_cpu_s": _self_cpu_s() - self0,
        "rank_minor_faults": _faults() - faults0,
        **got,
    }


def _loom_consumer(plan_dir: str, rank: int, ready: Any, start: Any, out: Any) -> None:
    from loomdata.torch import LoomDataset

    torch.set_num_threads(1)
    ds = LoomDataset(plan_dir, rank)
    ds.state_dict()
    ready.put(rank)
    start.wait()
    prof_dir = os.environ.get("LOOM_BENCH_PROFILE")  # a folder: each rank writes its cProfile stats there
    prof = None
    if prof_dir:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    cpu0, self0, faults0, t0 = _cpu_s(), _self_cpu_s(), _faults(), time.time()
    got = _consume(ds, t0)
    stream = ds._client
    if stream is not None:
        got.update(calls=stream.calls, wait_s=round(stream.wait_s, 3))
    ds.close()
    if prof is not None:
        prof.disable()
        transport = os.environ.get("LOOM_TRANSPORT", "direct")
        prof.dump_stats(str(Path(prof_dir) / f"rank{rank}-{transport}-{os.getpid()}.prof"))
    out.put(_report(rank, got, t0, cpu0, self0, faults0))


class _Decoding(IterableDataset):  # type: ignore[type-arg]
    """A peer's count of what its reader decoded: row groups, their documents and tokens (per group, not per row).

    Seen by the consumer only with `num_workers=0` (with workers each holds its own copy of the dataset)."""

    def __init__(self, files: list[str], rank: int, world: int, seq_len: int) -> None:
        self.files, self.rank, self.world, self.seq_len = files, rank, world, seq_len
        self.decoded = {"units": 0, "samples": 0, "tokens": 0}

    def _decoded(self, offsets: np.ndarray) -> None:
        """A row group was decoded (its list offsets)."""
        d = self.decoded
        d["units"] += 1
        d["samples"] += len(offsets) - 1
        d["tokens"] += int(offsets[-1] - offsets[0])


class _PackedParquet(_Decoding):
    """A plain per-rank loader: read this rank's row groups with pyarrow, pack documents greedily."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        units = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).metadata.num_row_groups)]
        mine = units[self.rank :: self.world][wid::nw]
        while True:  # repeat epochs: the consumer stops after its number of batches
            buf: list[np.ndarray] = []
            lens: list[int] = []
            room = self.seq_len
            for f, g in mine:
                col = pq.ParquetFile(f).read_row_group(g, columns=["tokens"]).column(0).combine_chunks()
                offsets = col.offsets.to_numpy()
                values = col.values.to_numpy()
                self._decoded(offsets)
                for i in range(len(offsets) - 1):
                    doc = values[offsets[i] : offsets[i + 1]]
                    while len(doc):
                        take = doc[:room]
                        buf.append(take)
                        lens.append(len(take))
                        room -= len(take)
                        doc = doc[len(take) :]
                        if room == 0:
                            ids = np.concatenate(buf).astype(np.int32)
                            cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                            pos = (np.arange(len(ids)) - np.repeat(cu[:-1], lens)).astype(np.int32)
                            labels = np.empty_like(ids)
                            labels[:-1] = ids[1:]
                            labels[cu[1:] - 1] = -100
                            yield {
                                "input_ids": torch.from_numpy(ids),
                                "labels": torch.from_numpy(labels),
                                "position_ids": torch.from_numpy(pos),
                                "cu_seqlens": torch.from_numpy(cu),
                            }
                            buf, lens, room = [], [], self.seq_len


class _ConcatCut(_Decoding):
    """The fastest simple peer: per row group, shuffle its documents, concatenate them (one NumPy gather,
    no per-document Python) and cut full `seq_len` rows; the tail carries into the next group.
    Documents are cut at row boundaries (as Megatron's GPTDataset and LitData's TokensLoader do)."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        units = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).metadata.num_row_groups)]
        mine = units[self.rank :: self.world][wid::nw]
        rng = np.random.default_rng([self.rank, wid])
        files = {f: pq.ParquetFile(f, pre_buffer=False) for f in {f for f, _ in mine}}
        L = self.seq_len
        carry_ids = np.empty(0, dtype=np.int32)
        carry_len = np.empty(0, dtype=np.int64)  # document lengths inside the carried tail
        while True:
            for f, g in mine:
                col = files[f].read_row_group(g, columns=["tokens"]).column(0).combine_chunks()
                offsets, values = col.offsets.to_numpy().astype(np.int64), col.values.to_numpy()
                self._decoded(offsets)
                perm = rng.permutation(len(offsets) - 1)
                lens = (offsets[1:] - offsets[:-1])[perm]
                new_start = np.cumsum(lens) - lens  # documents in shuffled order, end to end (one gather)
                gather = np.repeat(offsets[:-1][perm] - new_start, lens) + np.arange(int(lens.sum()))
                ids = np.concatenate([carry_ids, values[gather]])
                doc_len = np.concatenate([carry_len, lens])
                rows = len(ids) // L
                if rows:
                    ends = np.cumsum(doc_len)  # document ends, cut at every row boundary too
                    cuts = np.union1d(ends[ends < rows * L], np.arange(0, rows * L + 1, L))
                    for r in range(rows):
                        a, b = np.searchsorted(cuts, [r * L, (r + 1) * L])
                        cu = (cuts[a : b + 1] - r * L).astype(np.int32)
                        row = ids[r * L : (r + 1) * L]
                        seg = np.diff(cu)
                        pos = (np.arange(L) - np.repeat(cu[:-1], seg)).astype(np.int32)
                        labels = np.empty_like(row)
                        labels[:-1] = row[1:]
                        labels[cu[1:] - 1] = -100
                        yield {
                            "input_ids": torch.from_numpy(row),
                            "labels": torch.from_numpy(labels),
                            "position_ids": torch.from_numpy(pos),
                            "cu_seqlens": torch.from_numpy(cu),
                        }
                    ends_all = np.cumsum(doc_len)
                    k = int(np.searchsorted(ends_all, rows * L, side="right"))
                    rest = doc_len[k:].copy()
                    if len(rest):
                        rest[0] = ends_all[k] - rows * L
                    carry_ids, carry_len = ids[rows * L :], rest[rest > 0]
                else:
                    carry_ids, carry_len = ids, doc_len


_PEERS = {"greedy": _PackedParquet, "concat_cut": _ConcatCut}

ROW_CONTENT = (
    "What a row (one micro-batch of seq_len) holds on each side, for the tokens/CPU-s comparison: both yield "
    "input_ids, labels (the next token; -100 on every document piece's last token and on padding), position_ids "
    "(from 0 in every piece) and cu_seqlens as torch tensors sharing NumPy memory, so a trainer with document masking "
    "needs nothing more from either. loomdata also yields step/dp_rank/micro_batch/lane and keeps documents whole "
    "(a row is padded where the next document does not fit: each side's `real_token_fraction` says how much), "
    "after planning and cost-balancing; concat_cut cuts documents at row boundaries (every row full, no padding; "
    "a cut document's second part starts again at position 0 and its first part loses the label across the cut). "
    "Tokens counted are real tokens, so per row loomdata is credited (1 - real_token_fraction) fewer tokens for the "
    "same row's work: `batches_per_cpu_s` gives the per-row figure beside tokens per CPU-second."
)


def _peer_loader(kind: str, files: list[str], rank: int, world: int, seq_len: int, workers: int) -> DataLoader:  # type: ignore[type-arg]
    """A peer's DataLoader at one `num_workers` setting, otherwise at its best: with workers, tensors cross
    processes through named shared-memory files (`file_system`: 1.5-1.8x the tokens/s of torch's default
    `file_descriptor` here) and 4 batches a worker in flight; without, the reads run in the consumer itself."""
    dataset = _PEERS[kind](files, rank, world, seq_len)
    if workers == 0:
        return DataLoader(dataset, batch_size=None, num_workers=0)
    torch.multiprocessing.set_sharing_strategy("file_system")
    return DataLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=4, multiprocessing_context="fork")


def _baseline_consumer(
    kind: str,
    files: list[str],
    rank: int,
    world: int,
    seq_len: int,
    n: int,
    workers: int,
    ready: Any,
    start: Any,
    out: Any,
) -> None:
    torch.set_num_threads(1)
    loader = _peer_loader(kind, files, rank, world, seq_len, workers)
    ready.put(rank)
    start.wait()
    cpu0, self0, faults0, t0 = _cpu_s(), _self_cpu_s(), _faults(), time.time()
    it = iter(loader)
    got = _consume(itertools.islice(it, n), t0)
    del it  # joins the DataLoader workers, so their CPU time is counted as reaped children
    dataset = loader.dataset
    if workers == 0 and isinstance(dataset, _Decoding):  # with workers, each counted in its own copy: not known here
        got["decoded"] = dict(dataset.decoded)
    out.put(_report(rank, got, t0, cpu0, self0, faults0))


def _run_consumers(target: Any, args_of: Any, n: int) -> tuple[list[dict[str, Any]], float]:
    """Start `n` consumer processes, release them together, collect their reports; returns (rows, wall s)."""
    ctx = mp.get_context("spawn")
    ready, out, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=target, args=(*args_of(r), ready, start, out)) for r in range(n)]
    for p in procs:
        p.start()
    _collect(ready, procs, len(procs))
    start.set()
    rows: list[dict[str, Any]] = _collect(out, procs, len(procs))
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a consumer failed: exit codes {[p.exitcode for p in procs]}")
    wall = max(r["t1"] for r in rows) - min(r["t0"] for r in rows)
    return rows, wall


def _collect(q: Any, procs: list[Any], n: int) -> list[Any]:
    """`n` items from `q`, failing fast when a consumer process died instead of waiting forever."""
    import queue

    got: list[Any] = []
    while len(got) < n:
        try:
            got.append(q.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a consumer process failed (exit codes {dead}); see its traceback above") from None
    return got


# ---- main -----------------------------------------------------------------------------------------


def _worker_cpu(client: Any, parts: dict[str, float] | None = None) -> float:
    """CPU seconds so far of the Dask workers and this process (it hosts the scheduler); per part into `parts`."""
    import psutil

    def cpu() -> tuple[int, float]:
        t = psutil.Process().cpu_times()
        return os.getpid(), float(t.user + t.system)

    main = os.times()  # this process hosts the scheduler
    # `--workers 0`: the worker is a thread of this process, whose CPU `main` counts already
    per = {a: v for a, (pid, v) in client.run(cpu).items() if pid != os.getpid()}
    if parts is not None:
        parts.update({f"worker{k}": v for k, v in enumerate(per[a] for a in sorted(per))}, main=main.user + main.system)
    return float(sum(per.values())) + main.user + main.system


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by name with trailing digits and dashes dropped
    (`loom-strand_0` and `loom-strand_1` are one entry; threads Python did not start are `native`: Arrow's pools,
    jemalloc's, OpenSSL's). Linux only (reads /proc/self/task); elsewhere an empty dict."""
    import threading

    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in tasks.iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(task.name), "native").rstrip("0123456789_-") or "native"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _workers_faults(client: Any) -> dict[str, int]:
    """Minor page faults so far of every Dask worker, keyed `workerK` in address order (as `_worker_cpu`'s parts)."""
    per = client.run(_faults)
    return {f"worker{k}": per[a] for k, a in enumerate(sorted(per))}


def _workers_thread_cpu(client: Any) -> dict[str, dict[str, float]]:
    """`_thread_cpu` of every Dask worker, keyed `workerK` in address order (as `_worker_cpu`'s parts)."""
    per = client.run(_thread_cpu)
    return {f"worker{k}": per[a] for k, a in enumerate(sorted(per))}


def _thread_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per worker and thread name: CPU seconds spent between `before` and `after` (entries under 5 ms left out)."""
    out: dict[str, Any] = {}
    for w, threads in after.items():
        spent = {n: round(v - before.get(w, {}).get(n, 0.0), 3) for n, v in threads.items()}
        out[w] = dict(sorted(((n, v) for n, v in spent.items() if v >= 0.005), key=lambda kv: -kv[1]))
    return out


def _side(rows: list[dict[str, Any]], wall: float, cpu: float) -> dict[str, Any]:
    """Totals over a side's consumers: tokens/s (all of them together), steady tokens/s per consumer (the mean,
    after each one's first batch), tokens and rows (batches) per CPU-second over every process, the real tokens'
    share of the rows' length, the slowest first batch."""
    tokens = sum(r["tokens"] for r in rows)
    batches = sum(r["batches"] for r in rows)
    rank_cpu = sum(r["rank_cpu_s"] for r in rows)
    return {
        "first_batch_s": round(max(r["first_s"] for r in rows), 4),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall),
        "steady_tokens_per_s_per_consumer": round(sum(r["steady_tokens_per_s"] for r in rows) / len(rows)),
        "cpu_s": round(cpu, 2),
        "tokens_per_cpu_s": round(tokens / cpu),
        "rank_cpu_s": round(rank_cpu, 3),
        "rank_cpu_to_first_batch_s": round(sum(r.get("first_cpu_s", 0.0) for r in rows), 3),  # in rank_cpu_s
        "rank_minor_faults": sum(r.get("rank_minor_faults", 0) for r in rows),  # consumer processes' page faults
        "tokens_per_rank_cpu_s": round(tokens / max(rank_cpu, 1e-6)),
        "batches": batches,
        "batches_per_cpu_s": round(batches / cpu, 1),
        "real_token_fraction": round(tokens / max(sum(r.get("row_tokens", 0) for r in rows), 1), 4),
    }


def _decode_waste(decoded: int | None, decoded_samples: int | None, served: int, cpu: float) -> dict[str, Any]:
    """A side's decode waste: tokens its reads decoded (whole row groups) against the tokens served of them, the share
    never served, and decoded tokens per CPU-second: a projection, the tokens per CPU-second were every decoded token
    served at no more CPU (an upper bound: serving them would cost packing and delivery). None where not counted."""
    out: dict[str, Any] = {"decoded_tokens": decoded, "decoded_samples": decoded_samples, "served_tokens": served}
    known = decoded is not None and decoded > 0 and cpu > 0
    # at least 0: a unit held across epochs serves documents again from one decode (served > decoded)
    out["unserved_fraction"] = round(max(1 - served / decoded, 0.0), 4) if known and decoded else None
    out["decoded_tokens_per_cpu_s"] = round(decoded / cpu) if known and decoded else None
    return out


def _known_sum(counts: list[int | None]) -> int | None:
    """The sum of counts, None where any is not known (a peer with DataLoader workers, a tree without the counters)."""
    return None if None in counts else sum(c for c in counts if c is not None)


def _peer_decoded(rows: list[dict[str, Any]], key: str) -> int | None:
    """A peer's decoded `key` summed over its consumers (None where one could not tell: DataLoader workers)."""
    return _known_sum([None if r.get("decoded") is None else r["decoded"][key] for r in rows])


def _measure(
    client: Any,
    plan_dir: Path,
    files: list[str],
    n: int,
    n_batches: int,
    seq_len: int,
    settings: dict[str, Any],
    peers: list[str],
    transports: list[str],
    peer_workers: list[int],
) -> dict[str, Any]:
    """One side-by-side row: loomdata to `n` consumers (a fresh executor per transport), then each peer at each
    DataLoader `num_workers` in `peer_workers`; the peer's own key holds its best setting (most tokens/s), which
    the ratios are taken against, and `<peer>_w<N>` each setting."""
    looms = {
        ("loomdata" if k == 0 else f"loomdata_{t}"): _loom_side(client, plan_dir, n, settings, t)
        for k, t in enumerate(transports)
    }
    sides = {}
    row: dict[str, Any] = {"consumers": n, **looms}
    for kind in peers:
        settings_of = {}
        for w in peer_workers:  # each DataLoader setting; the peer is then reported at its best one
            rows, pwall = _run_consumers(
                _baseline_consumer, lambda r, k=kind, w=w: (k, files, r, n, seq_len, n_batches, w), n
            )
            pcpu = sum(r["cpu_s"] for r in rows)
            side = _side(rows, pwall, pcpu)
            side.update(
                _decode_waste(_peer_decoded(rows, "tokens"), _peer_decoded(rows, "samples"), side["tokens"], pcpu)
            )
            settings_of[w] = {"num_workers": w, **side}
            row[f"{kind}_w{w}"] = settings_of[w]
        sides[kind] = max(settings_of.values(), key=lambda side: side["tokens_per_s"])
    for kind, side in sides.items():
        row[kind] = side
        row.update(_ratios(looms["loomdata"], side, kind))
        for name, other in looms.items():  # another transport's ratios, under its own key
            if name != "loomdata":
                other.update(_ratios(other, side, kind))
    return row


def _profile_start() -> None:
    """cProfile the worker's event-loop thread (`client.run` runs this there): constructors and the gateway."""
    import cProfile
    import sys

    sys._loom_bench_profile = cProfile.Profile()  # type: ignore[attr-defined]  # kept in the worker process
    sys._loom_bench_profile.enable()  # type: ignore[attr-defined]


def _profile_stop(prefix: str) -> None:
    import sys

    prof = sys._loom_bench_profile  # type: ignore[attr-defined]
    prof.disable()
    prof.dump_stats(f"{prefix}-{os.getpid()}.prof")


def _loom_side(client: Any, plan_dir: Path, n: int, settings: dict[str, Any], transport: str) -> dict[str, Any]:
    """loomdata to `n` consumers (fresh executor) whose ranks use `transport` (LOOM_TRANSPORT: direct or dask)."""
    from loomdata.execution import Executor

    env_before = os.environ.get("LOOM_TRANSPORT")
    os.environ["LOOM_TRANSPORT"] = transport  # the spawned consumers inherit it
    try:
        with Executor(plan_dir, client, **settings) as ex:
            before: dict[str, float] = {}
            cpu0 = _worker_cpu(client, before)
            threads0 = _workers_thread_cpu(client)
            faults0 = _workers_faults(client)
            profile = os.environ.get("LOOM_BENCH_PROFILE")
            if profile:
                client.run(_profile_start)
                import _sampler  # this process's threads: the scheduler's and the serving control loop's

                _sampler.start("main")
            loom, wall = _run_consumers(_loom_consumer, lambda r: (str(plan_dir), r), n)
            if profile:
                client.run(_profile_stop, str(Path(profile) / f"worker-{n}-{transport}"))
                report = _sampler.stop("main", top=40)
                (Path(profile) / f"main-{n}-{transport}.json").write_text(json.dumps(report, indent=1))
            after: dict[str, float] = {}
            threads = _thread_delta(threads0, _workers_thread_cpu(client))
            faults = {w: f - faults0.get(w, 0) for w, f in _workers_faults(client).items()}
            loom_cpu = _worker_cpu(client, after) - cpu0 + sum(r["cpu_s"] for r in loom)
            m = ex.metrics().to_dict()  # results are written as JSON
            window_steps = ex.window
            read_ahead = [x for got in client.run(_read_ahead_state).values() for x in got]
    finally:
        if env_before is None:
            os.environ.pop("LOOM_TRANSPORT", None)
        else:
            os.environ["LOOM_TRANSPORT"] = env_before
    loom_side = _side(loom, wall, loom_cpu)
    built = sum(c["built_steps"] + c["on_demand_steps"] for c in m["constructors"])
    loom_side.update(
        transport=transport,
        window_steps=window_steps,
        rank_wait_s=m["rank_wait_s"],
        loader_calls=m["loader_calls"],
        sources=m["sources"],
        builds=built,
        build_ms_per_build=round(1000 * sum(c["build_s"] for c in m["constructors"]) / max(built, 1), 2),
        build_phases_s=[c["build_phases_s"] for c in m["constructors"]],
        rank_calls=sum(r.get("calls", 0) for r in loom),
        rank_wait_s_at_ranks=[r.get("wait_s") for r in loom],
        cpu_s_by_process={
            "ranks": round(sum(r["cpu_s"] for r in loom), 3),
            **{k: round(after[k] - before.get(k, 0.0), 3) for k in after},  # main: scheduler + this process
        },
        # page faults of ranks and workers (~2.6 us each on this machine)
        minor_faults_by_process={"ranks": sum(r.get("rank_minor_faults", 0) for r in loom), **faults},
        cpu_s_by_thread=threads,  # each worker's CPU by thread: its event loop (MainThread), loader threads...
        read_ahead=read_ahead,  # each loader's read-ahead decision (local files: `_prefetch.ReadStall`)
    )
    srcs = m["sources"].values()  # the loaders' counts (a tree before session 30 has no decoded ones: None)
    loom_side.update(
        _decode_waste(
            _known_sum([src.get("tokens_decoded") for src in srcs]),
            _known_sum([src.get("samples_decoded") for src in srcs]),
            sum(src["tokens"] for src in srcs),
            loom_cpu,
        )
    )
    return loom_side


def _read_ahead_state() -> list[dict[str, Any]]:
    """This worker's live loaders' read-ahead: mode, on now, and each turn with its inputs (`_prefetch.ReadStall`;
    none on a tree without it)."""
    from loomdata.execution import _loader

    out = []
    for lo in list(_loader._LIVE):
        pf = lo._plan.prefetch if lo._plan is not None else None
        st = getattr(pf, "stall", None)
        if pf is not None and st is not None:
            out.append(
                {
                    "loader": pf.name,
                    "mode": st.mode,
                    "on": st.on,
                    "timed": getattr(st, "timed", None),
                    "turns": [list(t) for t in st.turns],
                }
            )
    return out


def _ratios(loom: dict[str, Any], peer: dict[str, Any], kind: str) -> dict[str, float]:
    """loomdata / peer: tokens/s, steady tokens/s per consumer, tokens and rows (batches) per CPU-second; first
    batch time."""
    return {
        f"ratio_tokens_per_s_vs_{kind}": round(loom["tokens_per_s"] / peer["tokens_per_s"], 3),
        f"ratio_steady_per_consumer_vs_{kind}": round(
            loom["steady_tokens_per_s_per_consumer"] / max(peer["steady_tokens_per_s_per_consumer"], 1), 3
        ),
        f"ratio_per_cpu_core_vs_{kind}": round(loom["tokens_per_cpu_s"] / peer["tokens_per_cpu_s"], 3),
        f"ratio_batches_per_cpu_vs_{kind}": round(loom["batches_per_cpu_s"] / max(peer["batches_per_cpu_s"], 1), 3),
        f"ratio_per_rank_cpu_vs_{kind}": round(
            loom["tokens_per_rank_cpu_s"] / max(peer["tokens_per_rank_cpu_s"], 1), 3
        ),
        f"ratio_first_batch_vs_{kind}": round(loom["first_batch_s"] / max(peer["first_batch_s"], 1e-6), 2),
        # a projection (see `_decode_waste`): the per-core ratio were every decoded token served on both sides
        f"projected_ratio_per_cpu_core_if_all_decoded_served_vs_{kind}": (
            round(loom["decoded_tokens_per_cpu_s"] / peer["decoded_tokens_per_cpu_s"], 3)
            if loom.get("decoded_tokens_per_cpu_s") and peer.get("decoded_tokens_per_cpu_s")
            else None
        ),
    }


def _loom_only(client: Any, plan_dir: Path, n: int, settings: dict[str, Any]) -> dict[str, Any]:
    """loomdata alone to `n` consumers (fresh executor): tokens/s and CPU seconds."""
    from loomdata.execution import Executor

    with Executor(plan_dir, client, **settings) as ex:
        cpu0 = _worker_cpu(client)
        loom, wall = _run_consumers(_loom_consumer, lambda r: (str(plan_dir), r), n)
        cpu = _worker_cpu(client) - cpu0 + sum(r["cpu_s"] for r in loom)
        busy = sum(src["busy_s"] for src in ex.metrics().to_dict()["sources"].values())
    side = _side(loom, wall, cpu)
    side["loader_busy_s"] = round(busy, 4)  # time inside loader reads (where verification runs)
    return side


def _verify_cost(client: Any, plans: dict[str, Path], n: int, settings: dict[str, Any], repeat: int) -> dict[str, Any]:
    """Best of `repeat` alternating runs per verify mode; the slowdown of `sample` against `off`."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in plans}
    for _ in range(repeat):
        for mode, plan_dir in plans.items():
            runs[mode].append(_loom_only(client, plan_dir, n, settings))
    best = {mode: max(rs, key=lambda r: r["tokens_per_s"]) for mode, rs in runs.items()}
    on, off = best["sample"], best["off"]
    return {
        "consumers": n,
        "repeat": repeat,
        "best": best,
        "all_tokens_per_s": {mode: [r["tokens_per_s"] for r in rs] for mode, rs in runs.items()},
        "slowdown_tokens_per_s": round(1 - on["tokens_per_s"] / off["tokens_per_s"], 4),
        "extra_cpu_per_token": round(on["cpu_s"] / on["tokens"] / (off["cpu_s"] / off["tokens"]) - 1, 4),
        "extra_loader_busy": round(
            min(r["loader_busy_s"] for r in runs["sample"]) / min(r["loader_busy_s"] for r in runs["off"]) - 1, 4
        ),
    }


def _print_row(row: dict[str, Any], label: str = "") -> None:
    """A row's sides: each loomdata transport (with its ratios against the first peer), then each peer."""
    looms = [k for k in row if k == "loomdata" or k.startswith("loomdata_")]
    peers = [k for k in _PEERS if k in row]
    settings = [k for p in peers for k in row if k.startswith(f"{p}_w")]
    for name in (*looms, *peers, *settings):
        r = row[name]
        line = (
            f"{label}{row['consumers']:>9} {name[-13:]:>13} {r['tokens_per_s']:>12,} "
            f"{r['steady_tokens_per_s_per_consumer']:>12,} {r['cpu_s']:>7.1f} {r['tokens_per_cpu_s']:>11,}"
            f" {r.get('tokens_per_rank_cpu_s', 0):>11,} {r['first_batch_s']:>8.3f}"
        )
        ratios = row if name == "loomdata" else r
        if name in looms and peers and f"ratio_tokens_per_s_vs_{peers[0]}" in ratios:
            p = peers[0]
            line += (
                f"  {ratios[f'ratio_tokens_per_s_vs_{p}']:>7.2f} {ratios[f'ratio_steady_per_consumer_vs_{p}']:>8.2f}"
                f" {ratios[f'ratio_per_cpu_core_vs_{p}']:>10.2f} {ratios[f'ratio_first_batch_vs_{p}']:>9.2f}"
                f"  vs {p}"
            )
        print(line, flush=True)
        projected = ratios.get(f"projected_ratio_per_cpu_core_if_all_decoded_served_vs_{peers[0]}") if peers else None
        print(_waste_line(r, projected if name in looms else None), flush=True)


def _waste_line(r: dict[str, Any], projected: float | None) -> str:
    """A side's decode waste under its row: decoded and served tokens, the unserved share, the projection."""
    dec = r.get("decoded_tokens")
    if not dec:
        return f"{'':>23} decoded: not counted (a tree before session 30, or DataLoader workers)"
    line = (
        f"{'':>23} decoded {dec:,} served {r['served_tokens']:,} unserved {100 * r['unserved_fraction']:.1f}%"
        f"  decoded/cpu-s {r['decoded_tokens_per_cpu_s']:,} (projection: all decoded served)"
    )
    return line + (f"  projected ratio/core {projected:.2f}" if projected is not None else "")


_HEADER = (
    f"{'consumers':>9} {'loader':>13} {'tokens/s':>12} {'steady/cons':>12} {'cpu s':>7} {'tok/cpu-s':>11} "
    f"{'tok/rank-cpu':>11} {'first s':>8}  ratio/s ratio/st ratio/core ratio/1st  (loomdata / its best setting)"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=16000, help="documents written (3/4 short web, 1/4 long code)")
    ap.add_argument(
        "--sources",
        type=int,
        default=2,
        help="sources in the mixture: web and code (2), or the short documents split over N-1 web sources and code",
    )
    ap.add_argument("--steps", type=int, default=800, help="plan steps (each rank: steps x micro-batches)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--window", type=int, default=2, help="executor window (steps built ahead per rank, at least)")
    ap.add_argument(
        "--bytes-in-flight", type=int, default=None, help="executor bytes bound per rank (default ServeConfig's)"
    )
    ap.add_argument(
        "--loader-prefetch",
        type=int,
        default=None,
        help="read units each Source Loader reads ahead at once (default ServeConfig's; 0: no read-ahead)",
    )
    ap.add_argument(
        "--local-read-ahead",
        choices=["auto", "on", "off"],
        default=None,
        help="whether loaders of local files read ahead (default ServeConfig's: auto, only once reads stall)",
    )
    ap.add_argument("--consumers", type=int, nargs="+", default=list(CONSUMERS))
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes of loomdata's embedded cluster (0: one in this process)",
    )
    ap.add_argument(
        "--shuffle",
        default="global",
        choices=["global", "block"],
        help="loomdata's document order: global (any document anywhere) or block (a row group at a time, shuffled "
        "within 16 row groups: reads mostly sequential, as the peer's)",
    )
    ap.add_argument(
        "--dp",
        type=int,
        default=0,
        help="loomdata's plan dp size; 0 (default): each consumer count's own plan of that many ranks, a whole job "
        "as the peer's (its world size is the consumer count); 4: one dp-4 plan whose first ranks consume (before "
        "session 18: one consumer was rank 0 of 4 and read every row group for a quarter of its documents)",
    )
    ap.add_argument(
        "--draw-window",
        type=int,
        default=0,
        help="planning.draw_window of loomdata's plans (the windowed draw at dp 1; 0: the default membership)",
    )
    ap.add_argument("--verify-repeat", type=int, default=3, help="runs per verify mode (sample, off); 0: skip")
    ap.add_argument("--peers", nargs="+", default=list(_PEERS), choices=list(_PEERS), help="peer loaders to run")
    ap.add_argument(
        "--peer-workers",
        type=int,
        nargs="+",
        default=[0, 2],
        help="DataLoader num_workers settings each peer runs at; its best (most tokens/s) is the one compared",
    )
    ap.add_argument(
        "--transports",
        nargs="+",
        default=["direct"],
        choices=["direct", "dask"],
        help="rank transports to measure, each with a fresh executor (LOOM_TRANSPORT); the first is `loomdata`, "
        "others `loomdata_<transport>`",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--ab",
        type=Path,
        default=None,
        metavar="BEFORE_SRC",
        help="before/after in one sitting: run this benchmark alternately with BEFORE_SRC (a `src` folder of the "
        "old code) and this checkout's src first on PYTHONPATH, --rounds times, and write both to --out",
    )
    ap.add_argument("--rounds", type=int, default=2, help="with --ab: alternating rounds (before, after) each")
    args = ap.parse_args()
    if args.dp < 0 or (args.dp and args.dp < max(args.consumers)):
        ap.error(f"--dp must be 0 (a plan per consumer count) or at least the most consumers, got {args.dp}")
    if args.ab is not None:
        _ab(args)
        return

    from loomdata.execution import open_cluster

    settings: dict[str, Any] = {"window": args.window}  # the Executor's serving settings (window, bytes bound)
    if args.bytes_in_flight is not None:
        settings["bytes_in_flight"] = args.bytes_in_flight
    if args.loader_prefetch is not None:
        settings["loader_prefetch"] = args.loader_prefetch
    if args.local_read_ahead is not None:
        settings["local_read_ahead"] = args.local_read_ahead
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan
    from loomdata.schemas import read_plan

    with tempfile.TemporaryDirectory(prefix="loom-bench-stream-") as tmp:
        root = Path(tmp)
        os.environ["TMPDIR"] = str(root)  # consumers' and torch's scratch stays here
        t = time.perf_counter()
        files = [str(p) for p in _write_data(root, args.docs, seed=0, sources=args.sources)]
        spec = _spec(root, args.seq_len, args.steps, args.micro_batches, shuffle=args.shuffle, sources=args.sources)
        rows: list[dict[str, Any]] = []
        with open_cluster(n_workers=args.workers, local_directory=root / "dask") as client:
            build_index(spec, client)
            plan_dirs = {  # a plan of `--dp` ranks, or each consumer count's own (0)
                n: make_plan(
                    _spec(
                        root,
                        args.seq_len,
                        args.steps,
                        args.micro_batches,
                        shuffle=args.shuffle,
                        dp=args.dp or n,
                        sources=args.sources,
                        draw_window=args.draw_window,
                    )
                ).plan_dir
                for n in args.consumers
            }
            plan_dir = plan_dirs[max(args.consumers)]
            meta = read_plan(plan_dir)
            dps = sorted({read_plan(d).dp_size for d in plan_dirs.values()})
            print(
                f"data, index and plan(s) in {time.perf_counter() - t:.1f}s: {len(files)} files, plan {meta.plan_id}, "
                f"{meta.steps} steps x {meta.micro_batches} micro-batches x {meta.seq_len} tokens, dp {dps}"
            )
            print(_HEADER)
            for n in args.consumers:
                n_batches = meta.steps * meta.micro_batches
                row = _measure(
                    client,
                    plan_dirs[n],
                    files,
                    n,
                    n_batches,
                    args.seq_len,
                    settings,
                    args.peers,
                    args.transports,
                    args.peer_workers,
                )
                row["plan_dp"] = read_plan(plan_dirs[n]).dp_size
                rows.append(row)
                _print_row(row)
            verify_cost = None
            if args.verify_repeat > 0:
                off = _spec(  # the same ranks as the "sample" plan it is compared with (the largest consumer count's)
                    root,
                    args.seq_len,
                    args.steps,
                    args.micro_batches,
                    verify="off",
                    shuffle=args.shuffle,
                    dp=args.dp or max(args.consumers),
                    sources=args.sources,
                    draw_window=args.draw_window,
                )
                build_index(off, client)
                plans = {"sample": Path(plan_dir), "off": Path(make_plan(off).plan_dir)}
                n = max(args.consumers)
                verify_cost = _verify_cost(client, plans, n, settings, args.verify_repeat)
                b = verify_cost["best"]
                print(
                    f"verify cost, {n} consumer(s), best of {args.verify_repeat}: sample "
                    f"{b['sample']['tokens_per_s']:,} tokens/s ({b['sample']['cpu_s']:.1f} cpu s), off "
                    f"{b['off']['tokens_per_s']:,} tokens/s ({b['off']['cpu_s']:.1f} cpu s): slowdown "
                    f"{100 * verify_cost['slowdown_tokens_per_s']:.1f}%, CPU per token "
                    f"{100 * verify_cost['extra_cpu_per_token']:+.1f}%, loader busy time "
                    f"{100 * verify_cost['extra_loader_busy']:+.1f}%"
                )
            summary = {k: v for k, v in meta.summary.items() if isinstance(v, int | float | str)}
            if "simulated_gain" in summary:  # what the loomdata side delivers on top: balanced ranks
                print(
                    f"plan balance: simulated step-time gain over the baseline packing {summary['simulated_gain']:.2f}x"
                )
    result = {
        "benchmark": "stream_throughput",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "parameters": {
            "docs": args.docs,
            "sources": args.sources,
            "steps": args.steps,
            "seq_len": args.seq_len,
            "micro_batches": args.micro_batches,
            "dp_size": args.dp or "consumers",
            "dask_workers": args.workers,
            "window": args.window,
            "shuffle": args.shuffle,
            "bytes_in_flight": args.bytes_in_flight,
            "loader_prefetch": args.loader_prefetch,
            "local_read_ahead": args.local_read_ahead or "default (ServeConfig: auto)",
            "peer_num_workers": args.peer_workers,
            "transports": args.transports,
            "peers": {k: _PEERS[k].__doc__ for k in args.peers},
            "row_content": ROW_CONTENT,
        },
        "plan_summary": summary,
        "rows": rows,
        "verify_cost": verify_cost,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


def _ab(args: argparse.Namespace) -> None:
    """Alternate rounds of the old code (`args.ab`) and this checkout, in subprocesses; after every run write all
    runs so far and the per-side best (by steady tokens/s) with its ratios against the peers, and after / before."""
    import subprocess
    import sys

    own = Path(__file__).resolve().parent.parent / "src"
    forward = [
        a
        for k, v in vars(args).items()
        if k not in ("ab", "rounds", "out") and v is not None
        for a in (f"--{k.replace('_', '-')}", *([str(x) for x in v] if isinstance(v, list) else [str(v)]))
    ]
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="loom-bench-ab-") as tmp:
        for k in range(args.rounds):
            for label, src in (("before", args.ab.resolve()), ("after", own)):
                out = Path(tmp) / f"{label}-{k}.json"
                env = {**os.environ, "PYTHONPATH": str(src)}
                print(f"---- round {k + 1}/{args.rounds}: {label} ({src})", flush=True)
                subprocess.run([sys.executable, __file__, *forward, "--out", str(out)], env=env, check=True)
                runs[label].append(json.loads(out.read_text()))
                if runs["before"] and runs["after"]:
                    write_ab(runs, args.consumers, args.rounds, args.out)


def write_ab(runs: dict[str, list[dict[str, Any]]], consumers: list[int], rounds: int, out: Path) -> None:
    """The before/after result of the runs so far (best run per side and consumer count), printed and written."""
    summary = []
    for n in consumers:
        row: dict[str, Any] = {"consumers": n}
        for label, rs in runs.items():
            mine = [next(r for r in run["rows"] if r["consumers"] == n) for run in rs]
            row[label] = max(mine, key=lambda r: r["loomdata"]["steady_tokens_per_s_per_consumer"])
        b, a = row["before"]["loomdata"], row["after"]["loomdata"]
        row["after_vs_before"] = {
            "tokens_per_s": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
            "steady_tokens_per_s_per_consumer": round(
                a["steady_tokens_per_s_per_consumer"] / b["steady_tokens_per_s_per_consumer"], 3
            ),
            "tokens_per_cpu_s": round(a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"], 3),
            "first_batch_s": round(a["first_batch_s"] / b["first_batch_s"], 3),
        }
        summary.append(row)
    print(_HEADER)
    for row in summary:
        for label in runs:
            _print_row(row[label], f"{label:>7}")
    result = {
        "benchmark": "stream_throughput",
        "mode": "ab: alternating rounds of the old code (before) and this checkout (after), one sitting",
        "rounds_planned": rounds,
        "rounds_done": {label: len(rs) for label, rs in runs.items()},
        "parameters": runs["after"][0]["parameters"],
        "plan_summary": runs["after"][0]["plan_summary"],
        "best_of_rounds": summary,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
