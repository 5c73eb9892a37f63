"""A rank keeps a received block's steps as the block itself and builds their batches only as it reaches them."""

from __future__ import annotations

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


def _client(tmp_path: Path) -> StreamClient:
    spec, index, kw = CASES["web4k_dp1"](tmp_path)
    return StreamClient(make_plan(spec, index=index, **kw).plan_dir, 0)  # no connection before iterating


def _steps(first: int, n: int, micro_batches: int) -> list[list[Batch]]:
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
            batches.append(Batch(step, 0, mb, 0, ids, labels, pos, cu, seg))
        out.append(batches)
    return out


def _thin(steps: list[list[Batch]]) -> BatchBlock:
    """A constructor's block: `BatchBlock.of(steps)` less its derived arrays."""
    full = BatchBlock.of(steps)
    keep = {k: v for k, v in full.arrays.items() if k not in DERIVED_ARRAYS}
    bounds = {k: v for k, v in full.bounds.items() if k not in DERIVED_ARRAYS}
    return BatchBlock(full.steps, full.scalars, keep, bounds, full.images, full.image_bounds)


def test_a_block_s_steps_become_batches_a_few_at_a_time_and_equal_the_packed_ones(tmp_path: Path) -> None:
    client = _client(tmp_path)
    mb = client.meta.micro_batches
    want = _steps(3, 32, mb)
    client._accept(3, _thin(want))
    assert sorted(client._got) == list(range(3, 35))
    assert all(isinstance(v, tuple) for v in client._got.values()), "no step is made into batches on arrival"
    built_at_most = max(1, UNPACK_BYTES // (mb * SEQ * 12)) + 1
    for step in range(3, 35):
        got = client._steps(step)
        for w, g in zip(want[step - 3], got, strict=True):
            for f in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                assert np.array_equal(getattr(w, f), getattr(g, f)), (step, f)
            assert (g.step, g.micro_batch) == (w.step, w.micro_batch)
        built = sum(isinstance(v, list) for v in client._got.values())
        assert built < built_at_most, (step, built)  # the rest of the block stays as it came over the wire
    assert not client._got


def test_a_block_of_another_rank_s_steps_is_refused_on_arrival(tmp_path: Path) -> None:
    client = _client(tmp_path)
    block = _thin(_steps(5, 4, client.meta.micro_batches))
    with pytest.raises(ExecutionError, match="expected"):
        client._accept(4, block)  # its steps are 5..8, not 4..7
    assert not client._got
