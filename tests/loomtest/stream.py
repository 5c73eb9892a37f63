"""Test helpers for the streaming stage: a real corpus, a real index, a plan, and an independent oracle.

Imported as `from loomtest import stream` (the integration conftest's `loomtest` fixture returns it).
The oracle reads the source Parquet files with pyarrow directly, never
through loomdata's readers or loaders.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.schemas import (
    IGNORE_INDEX,
    Batch,
    IndexFiles,
    Spec,
    parse_spec,
    read_manifest,
    read_plan,
)


def write_corpus(root: Path, source: str, n_files: int, rows: int, seed: int, max_len: int = 300) -> None:
    """Pre-tokenized Parquet files `root/source/part-K.parquet` with a list<int32> `tokens` column."""
    rng = np.random.default_rng(seed)
    d = root / source
    d.mkdir(parents=True, exist_ok=True)
    for k in range(n_files):
        lens = rng.integers(3, max_len, size=rows)
        docs = [rng.integers(1, 50_000, size=int(n), dtype=np.int32) for n in lens]
        pq.write_table(
            pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), d / f"part-{k}.parquet", row_group_size=16
        )


def make_spec(
    tmp: Path,
    *,
    seq_len: int = 256,
    steps: int = 6,
    dp_size: int = 2,
    micro_batches: int = 2,
    tp_size: int = 1,
    long_context: dict[str, int] | None = None,
) -> Spec:
    """A two-source Parquet spec over a corpus written under `tmp/data`."""
    data = tmp / "data"
    write_corpus(data, "web", n_files=3, rows=40, seed=1)
    write_corpus(data, "code", n_files=2, rows=40, seed=2, max_len=700)
    raw: dict[str, Any] = {
        "name": "stream-test",
        "workdir": str(tmp / "work"),
        "seed": 7,
        "sources": [
            {"name": "web", "format": "parquet", "paths": [str(data / "web" / "*.parquet")], "tokens_field": "tokens"},
            {
                "name": "code",
                "format": "parquet",
                "paths": [str(data / "code" / "*.parquet")],
                "tokens_field": "tokens",
            },
        ],
        "mixture": {"weights": {"web": 0.6, "code": 0.4}},
        "training": {
            "seq_len": seq_len,
            "steps": steps,
            "dp_size": dp_size,
            "micro_batches": micro_batches,
            "tp_size": tp_size,
        },
    }
    if long_context is not None:
        raw["long_context"] = long_context
    return parse_spec(raw, tmp)


def index_and_plan(spec: Spec, client: Any) -> Path:
    """Index with the real `build_index` and plan with the real `make_plan`; returns the plan dir."""
    from loomdata.indexing import build_index
    from loomdata.planning import make_plan

    build_index(spec, client)
    return Path(make_plan(spec).plan_dir)


@dataclass
class Oracle:
    """Independent read of the sources: pyarrow over the files the index names, nothing of loomdata's readers."""

    plan_dir: Path

    def __post_init__(self) -> None:
        self.meta = read_plan(self.plan_dir)
        spec = Spec.model_validate(self.meta.spec)
        self._tokens: dict[int, list[np.ndarray]] = {}
        for sid, name in enumerate(self.meta.sources):
            files = IndexFiles.of(spec.workdir, name)
            idx = pq.read_table(str(files.samples), columns=["sample", "shard", "row"]).sort_by("sample")
            shards = pq.read_table(str(files.shards))
            path_of = dict(zip(shards.column("shard").to_pylist(), shards.column("path").to_pylist(), strict=True))
            cols = {
                s: pq.read_table(p, columns=["tokens"]).column("tokens").combine_chunks() for s, p in path_of.items()
            }
            field = spec.source(name).tokens_field or "tokens"
            assert field == "tokens"
            out = []
            for shard, row in zip(idx.column("shard").to_pylist(), idx.column("row").to_pylist(), strict=True):
                out.append(np.asarray(cols[shard][row].values.to_numpy(zero_copy_only=False), dtype=np.int32))
            self._tokens[sid] = out

    def segment(self, source: int, sample: int, offset: int, length: int) -> np.ndarray:
        """Tokens `offset .. offset+length` of `sample` of source id `source`."""
        doc = self._tokens[source][sample]
        assert offset + length <= len(doc), (source, sample, offset, length, len(doc))
        return doc[offset : offset + length]

    def expected_segments(self, step: int, dp_rank: int, micro_batch: int) -> np.ndarray:
        """The manifest's segments of one micro-batch, as (source, sample, offset, length) rows."""
        t = read_manifest(self.plan_dir, self.meta, step, step, dp_ranks=[dp_rank])
        mask = np.asarray(t.column("micro_batch").to_numpy() == micro_batch)
        return np.stack(
            [t.column(c).to_numpy()[mask].astype(np.int64) for c in ("source", "sample", "offset", "length")], 1
        )

    def check(self, batch: Batch) -> int:
        """Assert `batch` is exactly what the manifest and the source files say; returns its real tokens."""
        want = self.expected_segments(batch.step, batch.dp_rank, batch.micro_batch)
        got = np.stack([batch.segments[c].astype(np.int64) for c in ("source", "sample", "offset", "length")], 1)
        assert got.shape == want.shape and (got == want).all(), (
            f"segments differ at {batch.step, batch.dp_rank, batch.micro_batch}"
        )
        seq_len = self.meta.lane_seq_len(batch.lane)
        assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (seq_len,)
        pos = 0
        cu = [0]
        for src, sample, off, ln in want.tolist():
            ref = self.segment(src, sample, off, ln)
            np.testing.assert_array_equal(batch.input_ids[pos : pos + ln], ref)
            np.testing.assert_array_equal(batch.labels[pos : pos + ln - 1], ref[1:])
            assert batch.labels[pos + ln - 1] == IGNORE_INDEX
            np.testing.assert_array_equal(batch.position_ids[pos : pos + ln], np.arange(ln))
            pos += ln
            cu.append(pos)
        assert (batch.labels[pos:] == IGNORE_INDEX).all()
        np.testing.assert_array_equal(batch.cu_seqlens, np.asarray(cu, dtype=np.int32))
        return pos


SEGMENT_COLUMNS = ("source", "sample", "offset", "length")


def switching_plan(
    client: Any, tmp: Path, *, steps: int, switch: int, n_files: int, rows: int, seed: int, plan_seed: int
) -> Path:
    """A plan over two pre-tokenized sources (corpus `seed`) switching from 90% web to 90% code at `switch`."""
    data = tmp / "data"
    write_corpus(data, "web", n_files=n_files, rows=rows, seed=seed)
    write_corpus(data, "code", n_files=n_files, rows=rows, seed=seed + 1)
    raw: dict[str, Any] = {
        "name": "switching",
        "workdir": str(tmp / "work"),
        "seed": plan_seed,
        "sources": [
            {"name": s, "format": "parquet", "paths": [str(data / s / "*.parquet")], "tokens_field": "tokens"}
            for s in ("web", "code")
        ],
        "mixture": {
            "schedule": [
                {"step": 0, "weights": {"web": 0.9, "code": 0.1}},
                {"step": switch - 1, "weights": {"web": 0.9, "code": 0.1}},
                {"step": switch, "weights": {"web": 0.1, "code": 0.9}},
            ]
        },
        "training": {"seq_len": 256, "steps": steps, "dp_size": 2, "micro_batches": 2},
    }
    return index_and_plan(parse_spec(raw, tmp), client)


def kill_worker(client: Any, worker: str) -> float:
    """SIGKILL the process of Dask `worker`; returns the wall time of the kill."""
    pid = client.run(os.getpid, workers=[worker])[worker]
    os.kill(pid, signal.SIGKILL)
    return time.time()


def check_exact(plan_dir: Path, got: dict[int, list[Batch]]) -> None:
    """Every rank got its manifest in order: each (source, sample, offset, length) once, tokens exact."""
    oracle = Oracle(plan_dir)
    meta = oracle.meta
    for rank, batches in got.items():
        assert [(b.step, b.micro_batch, b.dp_rank) for b in batches] == [
            (s, m, rank) for s in range(meta.steps) for m in range(meta.micro_batches)
        ]
        man = read_manifest(plan_dir, meta, dp_ranks=[rank])
        cols = SEGMENT_COLUMNS
        want = Counter(zip(*(man.column(c).to_numpy().astype(int).tolist() for c in cols), strict=True))
        seen = Counter(
            tuple(int(x) for x in row) for b in batches for row in zip(*(b.segments[c] for c in cols), strict=True)
        )
        assert seen == want, f"rank {rank}: lost {want - seen}, duplicated {seen - want}"
        assert sum(oracle.check(b) for b in batches) == sum(n * k for (_, _, _, n), k in want.items())


def stream_with_fault(
    plan_dir: Path,
    fault: Callable[[dict[int, Any]], None],
    after: Callable[[dict[int, Any]], None] | None = None,
) -> tuple[dict[int, list[Batch]], float]:
    """Every rank streams step 0, `fault(streams)` runs, every rank streams the rest, `after(streams)` runs
    before they close: (each rank's batches, seconds the rest took). The caller checks them (`check_exact`)."""
    from loomdata.client import StreamClient

    meta = read_plan(plan_dir)
    streams = {r: StreamClient(plan_dir, r) for r in range(meta.dp_size)}
    got: dict[int, list[Batch]] = {r: [] for r in streams}
    try:
        for r, s in streams.items():  # step 0 taken: the constructors have read through their handles
            got[r] += [next(s) for _ in range(meta.micro_batches)]
        fault(streams)
        t0 = time.monotonic()
        for r, s in streams.items():
            got[r] += list(s)
        took = time.monotonic() - t0
        if after is not None:
            after(streams)
        return got, took
    finally:
        for s in streams.values():
            s.close()


def step_request(plan_dir: Path, step: int) -> np.ndarray:
    """A Source Loader's request for one step: every manifest segment of `step` (REQUEST_DTYPE rows)."""
    from loomdata.execution._loader import REQUEST_DTYPE

    t = read_manifest(plan_dir, read_plan(plan_dir), step, step)
    req = np.zeros(t.num_rows, dtype=REQUEST_DTYPE)
    for name in ("sample", "offset", "length", "step"):
        req[name] = t.column(name).to_numpy()
    return req
