"""The pure batch builder: segments and tokens -> input_ids, labels, position_ids, cu_seqlens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomdata.execution import pack_arrays, pack_batch
from loomdata.schemas import IGNORE_INDEX, SEGMENT_DTYPE, ExecutionError


def test_two_documents_and_padding() -> None:
    tokens = np.array([10, 11, 12, 20, 21], dtype=np.int32)
    ids, labels, pos, cu = pack_arrays(tokens, np.array([3, 2]), seq_len=8, pad_token_id=0)
    assert ids.tolist() == [10, 11, 12, 20, 21, 0, 0, 0]
    assert labels.tolist() == [11, 12, -100, 21, -100, -100, -100, -100]
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert cu.tolist() == [0, 3, 5]
    assert {a.dtype for a in (ids, labels, pos, cu)} == {np.dtype(np.int32)}


def test_full_sequence_and_single_token_documents() -> None:
    _ids, labels, pos, cu = pack_arrays(
        np.array([1, 2, 3, 4], dtype=np.int32), np.array([1, 1, 2]), seq_len=4, pad_token_id=0
    )
    assert labels.tolist() == [-100, -100, 4, -100]
    assert pos.tolist() == [0, 0, 0, 1]
    assert cu.tolist() == [0, 1, 2, 4]


def test_empty_micro_batch_is_all_padding() -> None:
    ids, labels, _pos, cu = pack_arrays(
        np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), seq_len=3, pad_token_id=0
    )
    assert ids.tolist() == [0, 0, 0] and (labels == IGNORE_INDEX).all() and cu.tolist() == [0]


def test_overfull_or_inconsistent_input_is_refused() -> None:
    with pytest.raises(ExecutionError, match="more than the sequence length 4"):
        pack_arrays(np.arange(5, dtype=np.int32), np.array([5]), seq_len=4, pad_token_id=0)
    with pytest.raises(ExecutionError, match="3 tokens given for segments totalling 4"):
        pack_arrays(np.arange(3, dtype=np.int32), np.array([4]), seq_len=8, pad_token_id=0)


def test_pack_batch_carries_provenance_and_counts_tokens() -> None:
    seg = np.zeros(2, dtype=SEGMENT_DTYPE)
    seg["source"], seg["sample"], seg["offset"], seg["length"] = [0, 1], [5, 9], [0, 7], [2, 3]
    b = pack_batch(
        step=3,
        dp_rank=1,
        micro_batch=0,
        lane=0,
        seq_len=6,
        segments=seg,
        tokens=np.arange(5, dtype=np.int32),
        pad_token_id=0,
    )
    assert (b.step, b.dp_rank, b.micro_batch, b.num_tokens) == (3, 1, 0, 5)
    assert b.segments is seg and b.images == [] and len(b.image_positions) == 0
    with pytest.raises(ExecutionError, match="SEGMENT_DTYPE"):
        pack_batch(
            step=0,
            dp_rank=0,
            micro_batch=0,
            lane=0,
            seq_len=6,
            segments=np.zeros(1),
            tokens=np.zeros(0),
            pad_token_id=0,
        )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=12), st.integers(0, 30))
def test_properties_hold_for_any_segments(lengths: list[int], pad: int) -> None:
    seq_len = sum(lengths) + pad
    if seq_len == 0:
        return
    tokens = np.arange(1, sum(lengths) + 1, dtype=np.int32)  # distinct, non-zero
    ids, labels, pos, cu = pack_arrays(tokens, np.array(lengths, dtype=np.int64), seq_len, pad_token_id=0)
    n = sum(lengths)
    assert cu[-1] == n and len(cu) == len(lengths) + 1
    assert (ids[:n] == tokens).all() and (ids[n:] == 0).all()
    starts = cu[:-1]
    assert (pos[starts] == 0).all()  # positions restart per document
    inside = np.ones(n, dtype=bool)
    inside[cu[1:] - 1] = False  # last token of each document has no target
    idx = np.flatnonzero(inside)
    assert (labels[idx] == ids[idx + 1]).all()  # next-token targets inside a document
    assert (pos[idx + 1] == pos[idx] + 1).all()
    assert (labels[:n][~inside] == IGNORE_INDEX).all() and (labels[n:] == IGNORE_INDEX).all()


def test_padding_uses_the_spec_pad_token_and_its_labels_stay_ignored() -> None:
    from loomdata.execution._packing import PackRules
    from loomdata.schemas import Spec

    ids, labels, pos, _cu = pack_arrays(np.array([10, 11], dtype=np.int32), np.array([2]), seq_len=5, pad_token_id=7)
    assert ids.tolist() == [10, 11, 7, 7, 7] and labels.tolist() == [11, -100, -100, -100, -100]
    assert pos.tolist() == [0, 1, 0, 0, 0]
    base = {
        "name": "t",
        "workdir": "/tmp/w",
        "sources": [{"name": "a", "format": "jsonl", "paths": ["a.jsonl"], "text_field": "text"}],
        "mixture": {"weights": {"a": 1.0}},
        "training": {"seq_len": 8, "steps": 1, "dp_size": 1, "micro_batches": 1},
    }
    assert PackRules.of(Spec.model_validate(base)) == PackRules(pad_token_id=0, image_token_id=32000)
    custom = dict(base, tokenizer={"pad_token_id": 3}, images={"placeholder_token_id": 9})
    assert PackRules.of(Spec.model_validate(custom)) == PackRules(pad_token_id=3, image_token_id=9)
