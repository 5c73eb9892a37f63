"""A local-file Source Loader reads on the event loop only what waits on no other thread (real files and plan).

At start-up, 300 loaders on one worker queue their shard opens and read-aheads on the process's shared
threads; inline reads of local files planned the manifest chunk of their step on the worker's event loop, or
waited there for the read ahead of a unit they needed (py-spy: the loop in `Prefetcher.get` at 4, 12 and 25 s),
and the gateway's TLS handshakes to that worker took 60 s. Such a read now goes to the loader's thread; one
whose chunk is planned, whose shards are open and whose units are all held still runs inline.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.execution import _loader, _prefetch
from loomdata.execution._loader import SourceLoader
from loomdata.execution._loader_cache import CachePolicy
from loomdata.execution._partition import partition_source
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import IndexFiles, parse_spec, read_plan
from loomtest.stream import step_request


def _plan(tmp: Path, dask_client: Client) -> tuple[Path, list[np.ndarray]]:
    """Three local Parquet files of 96 documents (row groups of 16), one source, 40 steps; all documents in order."""
    rng = np.random.default_rng(11)
    root = tmp / "data"
    root.mkdir(parents=True)
    docs: list[np.ndarray] = []
    for k in range(3):
        part = [rng.integers(1, 5000, size=int(n), dtype=np.int32) for n in rng.integers(30, 300, size=96)]
        pq.write_table(
            pa.table({"tokens": pa.array(part, pa.list_(pa.int32()))}), root / f"p{k}.parquet", row_group_size=16
        )
        docs += part
    raw: dict[str, Any] = {
        "name": "inline",
        "workdir": str(tmp / "work"),
        "sources": [{"name": "web", "format": "parquet", "paths": [str(root / "*.parquet")], "tokens_field": "tokens"}],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 512, "steps": 40, "dp_size": 2, "micro_batches": 1},
    }
    spec = parse_spec(raw, tmp)
    build_index(spec, dask_client)
    return Path(make_plan(spec).plan_dir), docs


def _expected(req: np.ndarray, docs: list[np.ndarray]) -> np.ndarray:
    """Samples are numbered in file order here (one index over the three files, in order)."""
    return np.concatenate([docs[int(s)][int(o) : int(o) + int(n)] for s, o, n in req[["sample", "offset", "length"]]])


def test_a_read_of_an_unplanned_chunk_leaves_the_event_loop(
    dask_client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_prefetch, "FAST_STEPS_PER_S", 0.0)  # the reach is the horizon: later chunks stay unplanned
    plan_dir, docs = _plan(tmp_path, dask_client)
    meta = read_plan(plan_dir)
    files = IndexFiles.of(meta.spec.workdir, meta.sources[0])
    (part,) = partition_source(0, meta.sources[0], files.sample_shards().column("shard").to_numpy(), 1)
    policy = CachePolicy(worker_bytes=64 << 20, horizon_steps=2, chunk_steps=2, prefetch=2, start_step=0)
    loader = SourceLoader(str(plan_dir), part, policy)
    try:
        assert loader._warm is not None and loader._plan is not None
        loader._warm.result(timeout=60)
        assert loader._plan.idle(60)
        first = step_request(plan_dir, 0)
        assert loader._plan.held(first)  # planned at warm-up and read ahead
        assert not loader._plan.reading(first)  # nor being read ahead again
        assert loader._inline_ok(first)  # nothing to wait for: it may stay on the event loop
        monkeypatch.setattr(_loader, "INLINE_LOADERS", 0)
        assert not loader._inline_ok(first)  # more loaders in the process than that: every read in the strands
        monkeypatch.setattr(_loader, "INLINE_LOADERS", 16)
        far = step_request(plan_dir, meta.steps - 1)
        assert (meta.steps - 1) // 2 not in loader._plan._planned
        assert not loader._inline_ok(far)  # planning it would read the manifest and wait for opens on the loop

        threads: list[str] = []
        real = loader.read_now

        def spy(request: np.ndarray, **kw: Any) -> Any:
            threads.append(threading.current_thread().name)
            return real(request, **kw)

        loader.read_now = spy  # type: ignore[method-assign]

        async def run() -> list[Any]:
            return [await loader.read(first), await loader.read(far)]

        got = asyncio.run(run())
        assert threads[0] == threading.current_thread().name  # inline: on the loop's thread
        assert threads[1].startswith("loom-strand")  # the loader's strand
        np.testing.assert_array_equal(got[0].tokens, _expected(first, docs))
        np.testing.assert_array_equal(got[1].tokens, _expected(far, docs))
    finally:
        loader._pool.submit(loader._reader.close).result()
        loader._plan.close() if loader._plan is not None else None
