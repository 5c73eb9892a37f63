"""StreamState: the checkpoint dict is validated with messages showing both values and the fix."""

from __future__ import annotations

import pytest

from loomdata.client import STATE_VERSION, StreamState
from loomdata.schemas import ContractError


def _parse(**changes: object) -> StreamState:
    raw = {"plan_id": "abc", "dp_rank": 1, "step": 4, "micro_batch": 1, "version": STATE_VERSION, **changes}
    return StreamState.parse(raw, plan_id="abc", dp_rank=1, micro_batches=2)


def test_round_trip() -> None:
    s = _parse()
    assert s.as_dict() == {"plan_id": "abc", "dp_rank": 1, "step": 4, "micro_batch": 1, "version": STATE_VERSION}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"plan_id": "zzz"}, "plan zzz, but this client streams plan abc"),
        ({"version": 0}, "version 0 is not supported"),
        ({"dp_rank": 0}, "dp rank 0, but this client is dp rank 1"),
        ({"micro_batch": 2}, "outside 0..1"),
        ({"step": -1}, "negative"),
    ],
)
def test_mismatches_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ContractError, match=message):
        _parse(**changes)


def test_missing_keys_are_named() -> None:
    with pytest.raises(ContractError, match="lacks micro_batch"):
        StreamState.parse(
            {"plan_id": "abc", "dp_rank": 1, "step": 0, "version": 1}, plan_id="abc", dp_rank=1, micro_batches=1
        )
