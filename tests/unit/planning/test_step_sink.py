"""The sink's block path (planning._step, _step_kernel, _manifest): its compiled and searched figures against the
NumPy they replaced, and the manifest writer's block path against its step-by-step path, byte for byte."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from loomdata.planning._manifest import ManifestWriter, file_bounds
from loomdata.planning._step import own_offsets
from loomdata.planning._step_kernel import rank_max_item


def _rank_max_reference(
    rs: np.ndarray, rank: np.ndarray, item: np.ndarray, cost: np.ndarray, n: int, dp: int
) -> np.ndarray:
    """The NumPy the kernel replaced: key, change mask, reduceat of the gathered costs."""
    out = np.zeros(n * dp)
    if len(item):
        key = rs * dp + rank
        change = np.empty(len(key), dtype=bool)
        change[0] = True
        np.not_equal(key[1:], key[:-1], out=change[1:])
        starts = change.nonzero()[0]
        out[key[starts]] = np.maximum.reduceat(cost[item], starts)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_rank_max_item_is_reduceats_bits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, dp = int(rng.integers(1, 40)), int(rng.integers(1, 9))
    rows = int(rng.integers(0, 400))
    rs = np.sort(rng.integers(0, n, rows))
    rank = rng.integers(0, dp, rows)
    order = np.lexsort((rank, rs))
    rs, rank = rs[order], rank[order]
    cost = rng.integers(0, 6, 200).astype(np.float64)  # ties; never -0.0 (a sum of non-negative terms)
    if seed % 2:
        cost[rng.integers(0, 200, 4)] = np.nan  # a NaN propagates, as np.maximum does
    item = rng.integers(0, 200, rows)
    got = rank_max_item(rs, rank, item, cost, n, dp)
    want = _rank_max_reference(rs, rank, item, cost, n, dp)
    assert got.tobytes() == want.tobytes()


def test_rank_max_item_leaves_ranks_without_rows_at_zero() -> None:
    rs = np.array([0, 0, 2], dtype=np.int64)
    rank = np.array([1, 1, 0], dtype=np.int64)
    item = np.array([0, 1, 2], dtype=np.int64)
    got = rank_max_item(rs, rank, item, np.array([3.0, 5.0, 2.0]), 3, 2)
    assert got.tolist() == [0.0, 5.0, 0.0, 0.0, 2.0, 0.0]


@pytest.mark.parametrize("seed", range(5))
def test_own_offsets_are_the_counts_of_in_step_segments(seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 9, int(rng.integers(1, 30)))
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    in_step = rng.random(int(off[-1])) > 0.3
    n = len(counts)
    want = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(np.repeat(np.arange(n), np.diff(off))[in_step], minlength=n), out=want[1:])
    assert own_offsets(off, in_step).tolist() == want.tolist()


def _block_rows(rng: np.random.Generator, steps: int) -> dict[str, np.ndarray]:
    per = rng.integers(0, 7, steps)
    rows = int(per.sum())
    seg_n = 50
    return {
        "row_step": np.repeat(np.arange(steps), per).astype(np.int64),
        "rank": rng.integers(0, 4, rows),
        "micro_batch": rng.integers(0, 2, rows),
        "length": rng.integers(1, 5000, rows),
        "lane": rng.integers(0, 2, rows).astype(np.uint8),
        "item": rng.integers(0, seg_n, rows),
        "delta": rng.integers(0, 100, rows),
        "seg_source": rng.integers(0, 300, seg_n).astype(np.uint16),
        "seg_sample": rng.integers(0, 2**40, seg_n).astype(np.uint64),
        "seg_offset": rng.integers(0, 2**31, seg_n).astype(np.uint32),
    }


def test_block_path_writes_the_step_by_step_bytes(tmp_path: Path) -> None:
    """Blocks crossing partition bounds, with gathered columns and offsets moved by the pieces' deltas, give the
    files add writes step by step (each column cast as astype casts), the buffers grown and reused."""
    rng = np.random.default_rng(7)
    steps = 60
    d = _block_rows(rng, steps)
    drawn = np.bincount(d["row_step"], minlength=steps)
    bounds = file_bounds(drawn, rows_per_file=25)
    assert len(bounds) > 4  # several partitions, blocks cross their bounds
    by_block = ManifestWriter(tmp_path / "block", "p", bounds)
    cuts = [0, 7, 8, 31, 45, steps]
    for a, b in itertools.pairwise(cuts):
        lo, hi = np.searchsorted(d["row_step"], [a, b])
        sl = slice(int(lo), int(hi))
        src = d["seg_source"][d["item"][sl]]
        by_block.add_block(
            range(a, b),
            d["row_step"][sl] - a,
            {
                "dp_rank": d["rank"][sl],
                "micro_batch": d["micro_batch"][sl],
                "source": src,
                "length": d["length"][sl],
                "lane": d["lane"][sl],
            },
            take=(d["item"][sl], {"sample": d["seg_sample"], "offset": d["seg_offset"]}),
            offset_delta=d["delta"][sl],
        )
    files_block = by_block.close(steps - 1)
    by_step = ManifestWriter(tmp_path / "step", "p", bounds)
    for t in range(steps):
        lo, hi = np.searchsorted(d["row_step"], [t, t + 1])
        sl = slice(int(lo), int(hi))
        it = d["item"][sl]
        by_step.add(
            t,
            {
                "dp_rank": d["rank"][sl],
                "micro_batch": d["micro_batch"][sl],
                "source": d["seg_source"][it],
                "sample": d["seg_sample"][it],
                "offset": d["seg_offset"][it].astype(np.int64) + d["delta"][sl],
                "length": d["length"][sl],
                "lane": d["lane"][sl],
            },
        )
    files_step = by_step.close(steps - 1)
    assert [f.path for f in files_block] == [f.path for f in files_step]
    assert [f.rows for f in files_block] == [f.rows for f in files_step]
    assert sum(f.rows for f in files_block) == len(d["row_step"])
    for f in files_block:
        assert (tmp_path / "block" / f.path).read_bytes() == (tmp_path / "step" / f.path).read_bytes(), f.path
