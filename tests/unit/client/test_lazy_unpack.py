"""A rank keeps a received block's steps as the block itself and builds their batches only as it reaches them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from loomdata.client import StreamClient
from loomdata.client._stream import UNPACK_BYTES
from loomdata.execution._packing import pack_arrays
from loomdata.planning import make_plan
from loomdata.schemas import ExecutionError
from loomdata.schemas.batch import DERIVED_ARRAYS, SEGMENT_DTYPE, Batch, BatchBlock
from loomtest.golden_plans import CASES

SEQ = 4096


def _client(tmp_path: Path, micro_batches: int | None = None) -> StreamClient:
    """A client of a real plan (no connection before iterating), its micro-batches a step set to `micro_batches`."""
    spec, index, kw = CASES["web4k_dp1"](tmp_path)
    client = StreamClient(make_plan(spec, index=index, **kw).plan_dir, 0)
    if micro_batches is not None:
        client.meta = dataclasses.replace(client.meta, micro_batches=micro_batches)
    return client


def _steps(first: int, n: int, micro_batches: int, cp: tuple[int, int] = (0, 1)) -> list[list[Batch]]:
    rng = np.random.default_rng(first)
    out = []
    for step in range(first, first + n):
        batches = []
        for mb in range(micro_batches):
            lengths = rng.integers(1, 900, 6)
            lengths = lengths[np.cumsum(lengths) <= SEQ]
            tokens = rng.integers(0, 50_000, int(lengths.sum())).astype(np.int32)
            ids, labels, pos, cu = pack_arrays(tokens, lengths, SEQ, pad_token_id=0)
            seg = np.zeros(len(lengths), dtype=SEGMENT_DTYPE)
            seg["length"] = lengths
            seg["sample"] = rng.integers(0, 1 << 30, len(lengths))
            batch = Batch(step, 0, mb, 0, ids, labels, pos, cu, seg)
            batches.append(dataclasses.replace(batch, cp_rank=cp[0], cp_size=cp[1]) if cp != (0, 1) else batch)
        out.append(batches)
    return out


def _thin(steps: list[list[Batch]]) -> BatchBlock:
    """A constructor's block: `BatchBlock.of(steps)` less its derived arrays."""
    full = BatchBlock.of(steps)
    keep = {k: v for k, v in full.arrays.items() if k not in DERIVED_ARRAYS}
    bounds = {k: v for k, v in full.bounds.items() if k not in DERIVED_ARRAYS}
    return BatchBlock(full.steps, full.scalars, keep, bounds, full.images, full.image_bounds)


def _same(want: Batch, got: Batch) -> None:
    """Every field of `got` equals `want`'s (arrays by value and dtype)."""
    for f in dataclasses.fields(Batch):
        w, g = getattr(want, f.name), getattr(got, f.name)
        if isinstance(w, np.ndarray):
            assert w.dtype == g.dtype and np.array_equal(w, g), f.name
        elif isinstance(w, list):
            assert len(w) == len(g) and all(np.array_equal(a, b) for a, b in zip(w, g, strict=True)), f.name
        else:
            assert w == g, f.name


@pytest.mark.parametrize("micro_batches", [None, 1])  # the plan's (one step a time), 1 (several steps a time)
def test_a_block_s_steps_become_batches_a_few_at_a_time_and_equal_the_packed_ones(
    tmp_path: Path, micro_batches: int | None
) -> None:
    client = _client(tmp_path, micro_batches)
    mb = client.meta.micro_batches
    per_chunk = max(1, -(-UNPACK_BYTES // (mb * SEQ * 12)))  # steps built at once (the last of a block: fewer)
    # two adjacent blocks (the second's length not a multiple of a chunk): a chunk never crosses into the next block
    want = _steps(3, 32, mb) + _steps(35, 7, mb)
    client._accept(3, _thin(want[:32]))
    client._accept(35, _thin(want[32:]))
    assert sorted(client._got) == list(range(3, 42))
    assert all(isinstance(v, tuple) for v in client._got.values()), "no step is made into batches on arrival"
    chunks = []
    for step in range(3, 42):
        fresh = not isinstance(client._got[step], list)
        got = client._steps(step)
        for w, g in zip(want[step - 3], got, strict=True):
            _same(w, g)
        built = sum(isinstance(v, list) for v in client._got.values())
        if fresh:
            chunks.append(built + 1)
        assert built < per_chunk, (step, built)  # the rest of the blocks stay as they came over the wire
    assert not client._got
    if micro_batches == 1:  # 3 steps at a time, the last chunk of each block what is left of it
        assert per_chunk == 3 and chunks == [3] * 10 + [2] + [3, 3, 1], chunks
    else:
        assert chunks == [1] * 39


def test_a_block_of_the_wrong_steps_is_refused_on_arrival(tmp_path: Path) -> None:
    client = _client(tmp_path)
    block = _thin(_steps(5, 4, client.meta.micro_batches))
    with pytest.raises(ExecutionError, match="expected"):
        client._accept(4, block)  # its steps are 5..8, not 4..7
    assert not client._got


def test_a_block_of_other_cp_ranks_or_malformed_is_refused_on_arrival(tmp_path: Path) -> None:
    client = _client(tmp_path, 1)
    full = BatchBlock.of(_steps(4, 2, 1, cp=(1, 2)))  # CP shards (whole arrays: labels sent, not derived)
    with pytest.raises(ExecutionError, match="other CP ranks"):
        client._accept(4, full)  # a rank without a CP rank is answered with shards
    client.cp_rank = 0
    with pytest.raises(ExecutionError, match="other CP ranks"):
        client._accept(4, full)  # shards of CP rank 1 for CP rank 0
    good = _thin(_steps(4, 2, 1))
    bad = dataclasses.replace(good, scalars=good.scalars[:1])
    with pytest.raises(ExecutionError, match="malformed"):
        client._accept(4, bad)
    client.cp_rank = 1
    thin_shards = dataclasses.replace(_thin(_steps(4, 2, 1)), scalars=full.scalars)
    with pytest.raises(ExecutionError, match="without labels"):
        client._accept(4, thin_shards)
    assert not client._got


def test_a_thin_step_is_counted_at_the_bytes_it_is_held_and_moved_at() -> None:
    """A client's own `bytes_in_flight` divides by a step's held bytes: a thin block's input ids and cu_seqlens
    (labels and position ids are made a few steps at a time, not held ahead), all arrays otherwise."""
    from loomdata.client._stream import _nbytes
    from loomdata.schemas.batch import SEGMENT_DTYPE, Batch

    ids = np.arange(4096, dtype=np.int32)
    cu = np.array([0, 4096], dtype=np.int32)
    b = Batch(0, 0, 0, 0, ids, ids.copy(), ids.copy(), cu, np.zeros(1, dtype=SEGMENT_DTYPE))
    assert _nbytes(b, thin=True) == 4 * 4096 + cu.nbytes
    assert _nbytes(b) == 3 * 4 * 4096 + cu.nbytes
