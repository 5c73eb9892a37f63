"""BatchBlock: several steps' batches moved as one object of a few arrays, and unpacked back unchanged."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from loomdata.execution._packing import pack_arrays
from loomdata.schemas.batch import DERIVED_ARRAYS, SEGMENT_DTYPE, Batch, BatchBlock


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


def _thin_of(batches: list[Batch]) -> BatchBlock:
    """`BatchBlock.of(batches)` less its derived arrays: what a constructor's group block is."""
    full = BatchBlock.of([batches])
    keep = {k: v for k, v in full.arrays.items() if k not in DERIVED_ARRAYS}
    bounds = {k: v for k, v in full.bounds.items() if k not in DERIVED_ARRAYS}
    return BatchBlock(full.steps, full.scalars, keep, bounds, full.images, full.image_bounds)


@pytest.mark.parametrize("seed", range(40))
def test_a_thin_block_derives_the_labels_and_positions_packing_writes(seed: int) -> None:
    """Labels and position ids rebuilt on the rank equal the rule's, written out segment by segment (`_by_segment`),
    for any segments: empty ones, a batch without segments (cu_seqlens [0] or empty), an empty batch, a full batch
    (no padding), lanes of different lengths;
    after pickling, for any range of batches."""
    rng = np.random.default_rng(seed)
    batches = []
    for mb in range(int(rng.integers(1, 7))):
        seq = int(rng.choice([0, 1, 8, 64, 100]))
        kind = rng.integers(0, 5)
        if kind in (0, 4):
            lengths = np.zeros(0, dtype=np.int64)  # no segments: all padding
        elif kind == 1:  # full: no padding
            cuts = np.sort(rng.integers(0, seq + 1, int(rng.integers(0, 5))))
            lengths = np.diff(np.concatenate([[0], cuts, [seq]]))
        else:
            lengths = rng.integers(0, max(2, seq // 3), int(rng.integers(1, 6)))
            lengths = lengths[np.cumsum(lengths) <= seq]
        tokens = rng.integers(0, 50_000, int(lengths.sum())).astype(np.int32)
        ids, cu = np.full(seq, 3, dtype=np.int32), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        if kind == 4:
            cu = cu[:0]  # no cu_seqlens entry at all: all padding (the packer writes [0], a block may not)
        ids[: len(tokens)] = tokens
        labels, pos = _by_segment(ids, lengths)
        seg = np.zeros(len(lengths), dtype=SEGMENT_DTYPE)
        seg["length"] = lengths
        batches.append(Batch(0, 1, mb, mb % 2, ids, labels, pos, cu, seg))
    thin = _thin_of(batches)
    assert thin.thin and not BatchBlock.of([batches]).thin
    for block in (thin, pickle.loads(pickle.dumps(thin, protocol=5))):
        for want, got in zip(batches, block.unpack()[0], strict=True):
            _same(want, got)
        lo = int(rng.integers(0, len(batches)))
        hi = int(rng.integers(lo, len(batches) + 1))
        for want, got in zip(batches[lo:hi], block.batches(lo, hi), strict=True):
            _same(want, got)


def _by_segment(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The packing rule, one segment at a time: the next token inside a segment, -100 at its last token and on
    padding; positions 0.. in each segment, 0 on padding."""
    labels = np.full(len(ids), -100, dtype=np.int32)
    pos = np.zeros(len(ids), dtype=np.int32)
    at = 0
    for n in lengths.tolist():
        if n > 1:
            labels[at : at + n - 1] = ids[at + 1 : at + n]
        pos[at : at + n] = np.arange(n)
        at += n
    return labels, pos


def test_a_thin_block_moves_a_third_of_the_token_bytes() -> None:
    ids, labels, pos, cu = pack_arrays(np.arange(4000, dtype=np.int32), np.array([1000, 3000]), 4096, pad_token_id=0)
    seg = np.zeros(2, dtype=SEGMENT_DTYPE)
    batches = [Batch(s, 0, 0, 0, ids, labels, pos, cu, seg) for s in range(8)]

    def wire_bytes(block: BatchBlock) -> int:
        buffers: list[pickle.PickleBuffer] = []
        body = pickle.dumps(block, protocol=5, buffer_callback=buffers.append)
        return len(body) + sum(b.raw().nbytes for b in buffers)

    full, thin = wire_bytes(BatchBlock.of([batches])), wire_bytes(_thin_of(batches))
    assert full > 3 * 8 * 4096 * 4 > thin > 8 * 4096 * 4


def test_a_thin_block_refuses_a_cp_shard() -> None:
    batch = _batch(0, 0, 8, 2, cp=(1, 2))
    with pytest.raises(ValueError, match="CP shard"):
        _thin_of([batch]).unpack()


def test_batch_fields_keep_the_order_thin_batches_pass_them_in() -> None:
    """BatchBlock's thin batches build Batch positionally (per batch, the cheaper call): a reordered field (labels and
    position_ids are both int32 arrays of one length) would swap values silently, so the order is pinned here."""
    from dataclasses import fields

    from loomdata.schemas.batch import Batch

    assert tuple(f.name for f in fields(Batch))[:14] == (
        "step",
        "dp_rank",
        "micro_batch",
        "lane",
        "input_ids",
        "labels",
        "position_ids",
        "cu_seqlens",
        "segments",
        "images",
        "image_positions",
        "cp_rank",
        "cp_size",
        "sequence_len",
    )
