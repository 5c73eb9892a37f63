"""Image placeholder tokens are never prediction targets; text after an image is."""

from __future__ import annotations

import numpy as np

from loomdata.execution import pack_batch
from loomdata.schemas import IGNORE_INDEX, SEGMENT_DTYPE

PH = 32000


def _segments(lengths: list[int]) -> np.ndarray:
    seg = np.zeros(len(lengths), dtype=SEGMENT_DTYPE)
    seg["length"] = lengths
    return seg


def test_labels_never_target_image_placeholders() -> None:
    # doc 0: 3 text tokens; doc 1: 4 placeholders then 3 text tokens
    tokens = np.array([5, 6, 7, PH, PH, PH, PH, 8, 9, 10], dtype=np.int32)
    img = np.zeros((28, 28, 3), dtype=np.uint8)
    b = pack_batch(
        step=0,
        dp_rank=0,
        micro_batch=0,
        lane=0,
        seq_len=12,
        segments=_segments([3, 7]),
        tokens=tokens,
        pad_token_id=0,
        images=[img],
        image_positions=np.array([3]),
        image_token_id=PH,
    )
    expected = [6, 7, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 8, 9, 10, IGNORE_INDEX]
    assert b.labels[:10].tolist() == expected
    assert (b.labels[10:] == IGNORE_INDEX).all()
    assert b.position_ids[:10].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]


def test_text_only_batches_keep_every_label() -> None:
    tokens = np.array([1, PH, 3], dtype=np.int32)  # a text token that happens to share the id is not masked
    b = pack_batch(
        step=0,
        dp_rank=0,
        micro_batch=0,
        lane=0,
        seq_len=3,
        segments=_segments([3]),
        tokens=tokens,
        pad_token_id=0,
        image_token_id=PH,
    )
    assert b.labels.tolist() == [PH, 3, IGNORE_INDEX]
