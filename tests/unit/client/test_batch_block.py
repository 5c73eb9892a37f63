"""BatchBlock: several steps' batches moved as one object of a few arrays, and unpacked back unchanged."""

from __future__ import annotations

import pickle

import numpy as np

from loomdata.schemas.batch import SEGMENT_DTYPE, Batch, BatchBlock


def _batch(step: int, mb: int, n: int, segs: int, images: int = 0, cp: tuple[int, int] = (0, 1)) -> Batch:
    rng = np.random.default_rng(step * 10 + mb)
    seg = np.zeros(segs, dtype=SEGMENT_DTYPE)
    seg["sample"] = rng.integers(0, 1 << 40, segs)
    seg["length"] = 3
    return Batch(
        step=step,
        dp_rank=2,
        micro_batch=mb,
        lane=mb % 2,
        input_ids=rng.integers(0, 1000, n).astype(np.int32),
        labels=rng.integers(-100, 1000, n).astype(np.int32),
        position_ids=np.arange(n, dtype=np.int32),
        cu_seqlens=np.arange(0, 3 * segs + 1, 3, dtype=np.int32),
        segments=seg,
        images=[rng.integers(0, 255, (4, 4, 3), dtype=np.uint8) for _ in range(images)],
        image_positions=np.arange(images, dtype=np.int32),
        cp_rank=cp[0],
        cp_size=cp[1],
        sequence_len=n * cp[1] if cp[1] > 1 else 0,
    )


def _same(a: Batch, b: Batch) -> None:
    for f in ("step", "dp_rank", "micro_batch", "lane", "cp_rank", "cp_size", "sequence_len"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "segments", "image_positions"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert len(a.images) == len(b.images) and all(np.array_equal(x, y) for x, y in zip(a.images, b.images, strict=True))


def test_a_block_unpacks_to_the_same_batches_also_after_pickling() -> None:
    steps = [
        [_batch(5, 0, 16, 3), _batch(5, 1, 8, 1, images=2)],
        [_batch(6, 0, 16, 0), _batch(6, 1, 4, 2, cp=(1, 2))],
        [_batch(7, 0, 12, 4, images=1), _batch(7, 1, 16, 5)],
    ]
    block = BatchBlock.of(steps)
    for got in (block.unpack(), pickle.loads(pickle.dumps(block, protocol=5)).unpack()):
        assert [len(s) for s in got] == [2, 2, 2]
        for want_step, got_step in zip(steps, got, strict=True):
            for want, have in zip(want_step, got_step, strict=True):
                _same(want, have)
    assert len(block.arrays) == 6  # a dozen arrays in all, however many batches


def test_unpacked_arrays_are_views_into_the_block() -> None:
    block = BatchBlock.of([[_batch(0, 0, 8, 2)], [_batch(1, 0, 8, 2)]])
    second = block.unpack()[1][0]
    assert np.shares_memory(second.input_ids, block.arrays["input_ids"])
