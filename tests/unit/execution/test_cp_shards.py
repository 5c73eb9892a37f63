"""Context-parallel shards of packed micro-batches: each CP rank's positions, and exact reassembly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomdata import reassemble_cp
from loomdata.execution import pack_batch, shard_batch
from loomdata.execution._packing import PackRules, peer_batches
from loomdata.schemas import SEGMENT_DTYPE, Batch, CostSpec, ExecutionError, PlanParameters, cp_positions
from loomtest import plancheck

IMG = 9  # image placeholder token id


def _batch(lengths: list[int], seq_len: int, *, images: list[tuple[int, int, int]] = (), lane: int = 1) -> Batch:
    """A packed batch of documents of `lengths`; `images`: (segment, offset in it, placeholder tokens)."""
    seg = np.zeros(len(lengths), dtype=SEGMENT_DTYPE)
    seg["source"], seg["sample"], seg["length"] = 0, np.arange(len(lengths)) + 100, lengths
    tokens = np.arange(1, sum(lengths) + 1, dtype=np.int32) * 10 + 11  # never IMG, never pad
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    pos, arrays = [], []
    for k, (s, off, n) in enumerate(images):
        at = int(starts[s]) + off
        tokens[at : at + n] = IMG
        pos.append(at)
        arrays.append(np.full((2, 2, 3), k, dtype=np.uint8))
    return pack_batch(
        step=4,
        dp_rank=1,
        micro_batch=2,
        lane=lane,
        seq_len=seq_len,
        segments=seg,
        tokens=tokens,
        pad_token_id=0,
        images=arrays,
        image_positions=np.array(pos, dtype=np.int32),
        image_token_id=IMG,
    )


def _assert_same(a: Batch, b: Batch) -> None:
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "segments", "image_positions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert np.array_equal(a.segment_ids(), b.segment_ids())
    assert len(a.images) == len(b.images) and all(np.array_equal(x, y) for x, y in zip(a.images, b.images, strict=True))
    assert (a.step, a.dp_rank, a.micro_batch, a.lane, a.num_tokens) == (
        b.step,
        b.dp_rank,
        b.micro_batch,
        b.lane,
        b.num_tokens,
    )
    assert b.positions is None and b.cp_size == 1


def test_a_shard_holds_chunks_i_and_2cp_minus_1_minus_i_of_the_packed_sequence() -> None:
    whole = _batch([5, 6], 16)  # doc A [0,5), doc B [5,11), padding [11,16)
    s0, s1 = (shard_batch(whole, i, 2) for i in range(2))
    assert s0.positions is not None and s0.positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert s1.positions is not None and s1.positions.tolist() == list(range(4, 12))
    assert s0.position_ids.tolist() == [0, 1, 2, 3, 0, 0, 0, 0]  # of the whole sequence, padding 0
    assert s1.position_ids.tolist() == [4, 0, 1, 2, 3, 4, 5, 0]
    assert s1.segment_ids().tolist() == [0, 1, 1, 1, 1, 1, 1, -1]
    assert s0.labels.tolist() == whole.labels[[0, 1, 2, 3, 12, 13, 14, 15]].tolist()
    assert s0.labels[3] == whole.input_ids[4]  # a label across the chunk boundary is the next token's
    assert (s0.num_tokens, s1.num_tokens) == (4, 7) and s0.is_shard and not whole.is_shard
    assert s0.cu_seqlens is whole.cu_seqlens and s0.segments is whole.segments  # whole-sequence coordinates
    assert (s0.cp_rank, s0.cp_size, s1.cp_rank) == (0, 2, 1)
    _assert_same(whole, reassemble_cp([s1, s0]))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=0, max_size=8),
    st.integers(0, 40),
    st.sampled_from([1, 2, 3, 4]),
    st.data(),
)
def test_shards_reassemble_to_the_whole_batch_exactly(
    lengths: list[int], pad: int, cp: int, data: st.DataObject
) -> None:
    seq_len = max(sum(lengths) + pad, 2 * cp)
    images: list[tuple[int, int, int]] = []
    for s, n in enumerate(lengths):  # at most one image per document, anywhere in it (cut by chunk edges too)
        if n >= 2 and data.draw(st.booleans()):
            k = data.draw(st.integers(1, n - 1))
            off = data.draw(st.integers(0, n - k))
            images.append((s, off, k))
    whole = _batch(lengths, seq_len, images=images)
    shards = [shard_batch(whole, i, cp, image_token_id=IMG) for i in range(cp)]
    assert sum(len(s.input_ids) for s in shards) == seq_len
    _assert_same(whole, reassemble_cp(shards[::-1]))
    for s in shards:  # each shard holds exactly the images whose placeholder tokens it holds any of
        held = s.held_positions()
        for k, p in enumerate(whole.image_positions.tolist()):
            n = images[k][2]
            assert (p in s.image_positions.tolist()) == bool(np.isin(np.arange(p, p + n), held).any())
        assert (s.input_ids == whole.input_ids[held]).all()


def test_reassembly_refuses_shards_that_do_not_fit() -> None:
    whole = _batch([5, 6], 16)
    s0 = shard_batch(whole, 0, 2)
    assert reassemble_cp([whole]) is whole
    with pytest.raises(ValueError, match=r"one shard of each CP rank 0\.\.1, got ranks \[0\]"):
        reassemble_cp([s0])
    with pytest.raises(ValueError, match=r"got ranks \[0, 0\]"):
        reassemble_cp([s0, s0])
    other = shard_batch(_batch([5, 6], 16, lane=0), 1, 2)
    with pytest.raises(ValueError, match="different micro-batches"):
        reassemble_cp([s0, other])
    with pytest.raises(ValueError, match="no shards"):
        reassemble_cp([])
    with pytest.raises(ValueError, match="already a shard"):
        shard_batch(s0, 0, 2)


def test_a_cp_peer_gets_each_micro_batch_sharded_by_its_lane_cp_size() -> None:
    params = PlanParameters(
        planner_version="t", fill=0.96, step_budget_tokens=1, cost=CostSpec(), short_cp_size=1, baseline="-"
    )
    meta = plancheck.plan_meta(seq_len=16, long_seq_len=64, long_cp_size=4, parameters=params)
    rules = PackRules(pad_token_id=0, image_token_id=IMG)
    short, long = _batch([5, 6], 16, lane=0), _batch([30, 20], 64, lane=1)
    for c in range(4):
        got = peer_batches(meta, rules, [short, long], c)
        assert got[0] is short  # cp 1 on the short lane: every peer gets it whole, unchanged
        assert got[1].positions is not None and got[1].positions.tolist() == cp_positions(64, 4, c).tolist()
    with pytest.raises(ExecutionError, match=r"pass a cp rank in 0\.\.3"):
        peer_batches(meta, rules, [short], 4)
    two = plancheck.plan_meta(
        seq_len=16, long_seq_len=64, long_cp_size=4, parameters=params.model_copy(update={"short_cp_size": 2})
    )
    got = peer_batches(two, rules, [short, long], 3)
    assert (got[0].cp_rank, got[0].cp_size, got[1].cp_rank, got[1].cp_size) == (1, 2, 3, 4)
    none = plancheck.plan_meta(seq_len=16, parameters=params)
    assert peer_batches(none, rules, [short], 0)[0] is short
    with pytest.raises(ExecutionError, match="1 CP peer"):
        peer_batches(none, rules, [short], 1)
