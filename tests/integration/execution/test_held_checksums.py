"""A planned Source Loader holds the checksums of the samples its plan reads from the floor to the spans planned.

Real Parquet files, index, plan and loader (in this process, as a Dask actor runs it), with manifest spans of one
2-step chunk, so the cache's reach (6 steps) spans several of them. Going forward no read reads checksums again;
a rank restarted from an earlier step reads them again and is still checked; an index rebuilt under the loader is
refused at such a read (never compared against); a failed read of them while planning leaves planning going and
the read reports the error; any other failure on a planning thread is counted and logged, and its steps are planned
when asked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

from loomdata.execution import _plan_ahead
from loomdata.execution._loader import SourceLoader
from loomdata.execution._loader_cache import CachePolicy
from loomdata.execution._partition import partition_source
from loomdata.execution._sample_index import HeldChecksums
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import IndexFiles, SourceDataError, Spec, parse_spec, read_plan
from loomdata.schemas.errors import StaleIndexError
from loomtest.stream import step_request

HORIZON = 6
CHUNK = 2


def _write(root: Path, tokens_seed: int) -> list[np.ndarray]:
    """Three uncompressed, plain-encoded Parquet files of 300 documents (row groups of 16): every document. The
    documents' lengths are always the same (so is the files' layout); their tokens come from `tokens_seed`."""
    lengths, rng = np.random.default_rng(11), np.random.default_rng(tokens_seed)
    docs: list[np.ndarray] = []
    for k in range(3):
        part = [rng.integers(1, 1 << 30, size=int(n), dtype=np.int32) for n in lengths.integers(30, 300, size=300)]
        table = pa.table({"tokens": pa.array(part, pa.list_(pa.int32()))})
        pq.write_table(table, root / f"p{k}.parquet", row_group_size=16, compression="none", use_dictionary=False)
        docs += part
    return docs


def _spec(tmp: Path) -> tuple[Spec, list[np.ndarray]]:
    root = tmp / "data"
    root.mkdir(parents=True, exist_ok=True)
    docs = _write(root, 11)
    raw: dict[str, Any] = {
        "name": "held",
        "workdir": str(tmp / "work"),
        "sources": [{"name": "web", "format": "parquet", "paths": [str(root / "*.parquet")], "tokens_field": "tokens"}],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 512, "steps": 60, "dp_size": 2, "micro_batches": 1},
    }
    return parse_spec(raw, tmp), docs


@pytest.fixture
def served(
    dask_client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Spec, Path, SourceLoader, list[np.ndarray]]]:
    """A planned loader (verify: sample, the default) of a one-source plan whose spans are one chunk each."""
    spec, docs = _spec(tmp_path)
    build_index(spec, dask_client)
    plan_dir = Path(make_plan(spec).plan_dir)
    monkeypatch.setattr(_plan_ahead, "_SPAN_ROWS", 1)  # a span: one chunk (at dp 256 x 2, 32 steps are one)
    meta = read_plan(plan_dir)
    files = IndexFiles.of(meta.spec.workdir, meta.sources[0])
    (part,) = partition_source(0, meta.sources[0], files.sample_shards().column("shard").to_numpy(), 1)
    policy = CachePolicy(worker_bytes=64 << 20, horizon_steps=HORIZON, chunk_steps=CHUNK, lag_hold_s=0.0)
    loader = SourceLoader(str(plan_dir), part, policy)
    assert loader._warm is not None and loader._plan is not None
    loader._warm.result(timeout=60)
    assert loader._plan._span_chunks == 1 and loader._plan.cache.plan_reach >= 3 * CHUNK
    try:
        yield spec, plan_dir, loader, docs
    finally:
        loader._pool.submit(loader._reader.close).result()
        loader._plan.close()


def _sums(loader: SourceLoader) -> HeldChecksums:
    sums = loader._index.checksums
    assert isinstance(sums, HeldChecksums)
    return sums


def _expected(req: np.ndarray, docs: list[np.ndarray]) -> np.ndarray:
    """Samples are numbered in file order here (one index over the three files, in order)."""
    return np.concatenate([docs[int(s)][int(o) : int(o) + int(n)] for s, o, n in req[["sample", "offset", "length"]]])


def _run(loader: SourceLoader, plan_dir: Path, docs: list[np.ndarray], steps: range) -> list[int]:
    """Serve `steps` in turn (each step's reads as its ranks ask them), checking the data; the checksums held after
    each."""
    held = []
    for step in steps:
        req = step_request(plan_dir, step)
        np.testing.assert_array_equal(loader.read_now(req).tokens, _expected(req, docs))
        held.append(_sums(loader).held)
    return held


def test_going_forward_no_read_reads_checksums_again(
    served: tuple[Spec, Path, SourceLoader, list[np.ndarray]],
) -> None:
    _, plan_dir, loader, docs = served
    sums = _sums(loader)
    meta = read_plan(plan_dir)
    assert sums.held < len(sums) // 3  # from warm-up on: those read at start gave the first span's and went
    held = _run(loader, plan_dir, docs, range(meta.steps))
    assert sums.rereads == 0  # every read's checksums were held: from the floor to the spans planned
    assert 0 < sums.loads < meta.steps // CHUNK  # one read of samples.parquet a span planned (the first: at start)
    assert max(held[HORIZON + CHUNK :]) < len(sums) // 3  # never every one, once the floor is past the start
    assert loader._counters.plan_errors == 0
    assert sums.nbytes < 4 * len(sums)  # 900 samples: 3,600 bytes held every one
    stats = loader._checksum_counts()
    assert stats == {"checksums_held": sums.held, "checksum_loads": sums.loads, "checksum_rereads": 0}


def test_a_rank_restarted_from_an_earlier_step_is_still_checked(
    served: tuple[Spec, Path, SourceLoader, list[np.ndarray]],
) -> None:
    _, plan_dir, loader, docs = served
    sums = _sums(loader)
    _run(loader, plan_dir, docs, range(30))
    early = step_request(plan_dir, 1)
    assert not sums.covers(loader._index.locate(early["sample"])[0])  # behind the floor: not held
    _run(loader, plan_dir, docs, range(1, 3))  # read again from samples.parquet: the same, verified data
    assert sums.rereads == 1
    # A same-size edit of one of its documents (mtime put back) after the shard was checked: the checksum read
    # again catches it, as a held one would.
    sample = int(early["sample"][0])
    path = Path(str(loader._paths[int(loader._index.shard_at(loader._index.locate(early["sample"][:1])[0])[0])]))
    data = path.read_bytes()
    at = data.find(docs[sample].tobytes())
    assert at > 0 and data.count(docs[sample].tobytes()) == 1
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write((docs[sample][:1] + 1).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    _run(loader, plan_dir, docs, range(30, 40))  # the floor moves on: every checksum dropped again
    assert sums.held < len(sums)
    with pytest.raises(SourceDataError, match="checksum") as err:
        loader.read_now(early)
    assert str(path) in str(err.value) and f"sample {sample}" in str(err.value)
    assert sums.rereads == 2


def _rebuild(spec: Spec, client: Client) -> list[np.ndarray]:
    """Rewrite every data file in place with other tokens (same lengths and layout: the loader's open files read
    them) and index them again: a new index. Returns the new documents."""
    docs = _write(Path(spec.workdir).parent / "data", 12)
    build_index(spec, client)
    return docs


def test_an_index_rebuilt_under_the_loader_is_refused_never_compared_against(
    served: tuple[Spec, Path, SourceLoader, list[np.ndarray]], dask_client: Client
) -> None:
    spec, plan_dir, loader, docs = served
    _run(loader, plan_dir, docs, range(30))
    files = IndexFiles.of(spec.workdir, "web")
    before = files.fingerprint()
    new = _rebuild(spec, dask_client)
    assert files.fingerprint() != before
    # Step 1's samples are behind the floor: their checksums are read again, from the index there now. Its
    # data is the new files' and its checksums the new index's: they agree, so only the index's identity can
    # refuse to serve them (data the plan never named: its segments were cut from the old documents).
    early = step_request(plan_dir, 1)
    assert not np.array_equal(_expected(early, new), _expected(early, docs))
    with pytest.raises(StaleIndexError) as err:
        loader.read_now(early)
    msg = str(err.value)
    assert "'web'" in msg and str(files.samples) in msg and "index changed since `loom serve` started" in msg, msg
    assert "restart `loom serve`" in msg and before in msg, msg
    assert _sums(loader).rereads == 0  # no value of the other index was taken


def test_a_failed_read_of_checksums_while_planning_leaves_planning_going(
    served: tuple[Spec, Path, SourceLoader, list[np.ndarray]], dask_client: Client
) -> None:
    spec, plan_dir, loader, docs = served
    plan = loader._plan
    assert plan is not None
    _run(loader, plan_dir, docs, range(10))
    assert plan.idle(60)
    errors = loader._counters.plan_errors
    _rebuild(spec, dask_client)
    far = 40  # its span, and those of the reach past it, are not read yet
    assert far // CHUNK not in plan._planned
    with pytest.raises(StaleIndexError, match="index changed since `loom serve` started"):
        loader.read_now(step_request(plan_dir, far))  # the read reports the error itself
    assert far // CHUNK in plan._planned  # planned (its units), though its checksums could not be held
    assert plan.idle(60)
    reach = range(far // CHUNK, (far + plan.cache.plan_reach) // CHUNK + 1)
    assert all(c in plan._planned for c in reach)  # the background planning past it went on too
    assert loader._counters.plan_errors >= errors + len(reach)  # each span's failed read counted


def test_a_failure_planning_ahead_is_counted_logged_and_its_steps_planned_when_asked(
    served: tuple[Spec, Path, SourceLoader, list[np.ndarray]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A planning thread's failure (the cache refusing a chunk, as it refuses a planned read's row past 2**32, which
    no test file can hold) is not lost with its thread's future: counted, logged naming the source, and the chunk
    it left is planned when its steps are asked (every step served right)."""
    _, plan_dir, loader, docs = served
    plan = loader._plan
    assert plan is not None
    real = plan.cache.plan
    failed: list[int] = []

    def refused_on_a_planning_thread(keys: np.ndarray, step: np.ndarray, rows: np.ndarray) -> None:
        if threading.current_thread().name.startswith("loom-plan-ahead") and not failed:
            failed.append(int(step.min()))
            raise ValueError("a planned read's row is past 2**32")
        real(keys, step, rows)

    monkeypatch.setattr(plan.cache, "plan", refused_on_a_planning_thread)
    errors = loader._counters.plan_errors
    with caplog.at_level(logging.WARNING, logger="loomdata.execution._plan_ahead"):
        _run(loader, plan_dir, docs, range(1))
        assert plan.idle(60)
        assert failed and failed[0] < 30  # a chunk planned ahead (on a planning thread) was refused
        assert failed[0] // CHUNK not in plan._planned
        _run(loader, plan_dir, docs, range(1, 32))  # checks every step's tokens
    assert plan.idle(60)
    assert failed[0] // CHUNK in plan._planned  # planned when asked
    assert loader._counters.plan_errors == errors + 1
    assert asyncio.run(loader.metrics()).to_dict()["plan_errors"] == errors + 1  # what `loom serve` reports
    assert "planning steps ahead for source 0" in caplog.text and "ValueError: a planned read's row" in caplog.text
