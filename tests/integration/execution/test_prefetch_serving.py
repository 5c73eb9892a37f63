"""Plan-driven read-ahead on a real LocalCluster: the served batches are those served without it, and it reads ahead;
local files in `local_read_ahead` auto read ahead only where their reads stall, and serve the same batches."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.schemas import ExecutorMetrics, read_plan


def _serve(
    plan_dir: Path, client: Client, prefetch: int, oracle: Any, local: str = "on", seen: list[Any] | None = None
) -> tuple[list[tuple[bytes, ...]], ExecutorMetrics, int]:
    """Every batch of every rank (its arrays as bytes), the executor's metrics, the tokens the oracle checked; `seen`
    gets each live loader's read-ahead decision (`_read_ahead`) after the ranks are done."""
    out: list[tuple[bytes, ...]] = []
    checked = 0
    with Executor(plan_dir, client, loader_prefetch=prefetch, loaders_per_source=2, local_read_ahead=local) as ex:
        for r in range(2):
            with StreamClient(plan_dir, r) as stream:
                for b in stream:
                    checked += oracle.check(b)  # the manifest's tokens, read independently
                    arrays = (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.segments)
                    out.append(
                        (
                            str((b.step, b.dp_rank, b.micro_batch)).encode(),
                            *(np.ascontiguousarray(a).tobytes() for a in arrays),
                        )
                    )
        m = ex.metrics()
        if seen is not None:
            seen.extend(x for got in client.run(_read_ahead).values() for x in got)
    return out, m, checked


def _read_ahead() -> list[tuple[str, bool, int, int]]:
    """(mode, on now, turns, reads timed) of each live loader's read-ahead in this worker (`_prefetch.ReadStall`)."""
    from loomdata.execution._loader import _LIVE

    return [
        (pf.stall.mode, pf.stall.on, len(pf.stall.turns), pf.stall.timed)
        for lo in list(_LIVE)
        if lo._plan is not None and (pf := lo._plan.prefetch) is not None
    ]


@pytest.fixture(scope="module")
def long_plan(dask_client: Client, tmp_path_factory: pytest.TempPathFactory, loomtest: Any) -> Path:
    spec = loomtest.make_spec(tmp_path_factory.mktemp("prefetch"), steps=16)
    return Path(loomtest.index_and_plan(spec, dask_client))


def test_read_ahead_serves_the_same_batches_and_its_units_are_used(
    dask_client: Client, long_plan: Path, loomtest: Any
) -> None:
    oracle = loomtest.Oracle(long_plan)
    off, m_off, _ = _serve(long_plan, dask_client, 0, oracle)
    on, m_on, checked = _serve(long_plan, dask_client, 4, oracle)
    assert len(on) == len(off) > 0 and checked > 0
    assert on == off  # byte-identical batches, in the same order
    loaders_on = [lo.metrics for lo in m_on.loaders]
    assert sum(lo.prefetched for lo in loaders_on) > 0
    assert sum(lo.prefetch_hits for lo in loaders_on) > 0  # units read ahead were then served from
    assert sum(lo.prefetch_errors for lo in loaders_on) == 0
    assert sum(lo.metrics.prefetched for lo in m_off.loaders) == 0  # off means off


def _drop_page_cache(plan_dir: Path) -> int:
    """Drop the page cache's pages of the plan's data files (`POSIX_FADV_DONTNEED`: no root needed); files dropped."""
    meta = read_plan(plan_dir)
    dropped = 0
    for src in meta.spec.sources:
        for p in src.paths:
            for f in glob.glob(p):
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    dropped += 1
                finally:
                    os.close(fd)
    return dropped


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the page cache")
def test_local_files_in_auto_read_inline_and_serve_what_on_serves(
    dask_client: Client, long_plan: Path, loomtest: Any
) -> None:
    """auto (the default) over local files: the loaders read what each step needs inline, timing those reads, and
    serve byte-identical batches to `on`, from files just dropped from the page cache too (read from disk). A local
    read cannot be made slow here without a mock (this disk reads a row group in ~1 ms; no FUSE, no root): that it
    then turns on is the unit tests' (`test_read_stall.py`, on measured inputs)."""
    oracle = loomtest.Oracle(long_plan)
    on, _, _ = _serve(long_plan, dask_client, 4, oracle, "on")
    assert _drop_page_cache(long_plan) > 0
    seen: list[Any] = []
    auto, m_auto, checked = _serve(long_plan, dask_client, 4, oracle, "auto", seen)
    assert len(auto) == len(on) > 0 and checked > 0
    assert auto == on  # byte-identical batches, in the same order
    assert seen and all(mode == "auto" for mode, *_ in seen)
    assert sum(timed for *_, timed in seen) > 0  # the loaders' own reads were timed
    # whether a loader turned on depends on this disk (a fast one never stalls the steps; a network volume may):
    # consistent either way: auto starts off and each turn flips it, and nothing is read ahead unless one turned on
    for _, on_now, turns, _ in seen:
        assert on_now == (turns % 2 == 1)
    if not any(turns for _, _, turns, _ in seen):
        assert sum(lo.metrics.prefetched for lo in m_auto.loaders) == 0
