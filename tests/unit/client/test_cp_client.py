"""A CP peer's client: its cp rank is checked against the plan before any connection; tensors of a shard."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loomdata.client import StreamClient
from loomdata.execution import pack_batch, shard_batch
from loomdata.planning import make_plan
from loomdata.schemas import SEGMENT_DTYPE, ExecutionError, cp_group_size
from loomtest.golden_plans import CASES


def test_cp_rank_must_be_a_peer_of_the_plan(tmp_path: Path) -> None:
    spec, index, kw = CASES["long_lane_cp4"](tmp_path)
    res = make_plan(spec, index=index, **kw)
    assert cp_group_size(res.meta) == 4
    ok = StreamClient(res.plan_dir, 0, cp_rank=3)  # no connection is made before iterating
    assert ok.cp_rank == 3 and StreamClient(res.plan_dir, 0).cp_rank is None
    for bad in (4, -1, True, "1"):
        with pytest.raises(ExecutionError, match=r"pass a cp rank in 0\.\.3"):
            StreamClient(res.plan_dir, 0, cp_rank=bad)  # type: ignore[arg-type]


def test_a_shard_becomes_tensors_with_its_positions() -> None:
    torch_adapter = pytest.importorskip("loomdata.client._torch")
    seg = np.zeros(1, dtype=SEGMENT_DTYPE)
    seg["length"] = 10
    whole = pack_batch(
        step=0,
        dp_rank=0,
        micro_batch=0,
        lane=1,
        seq_len=16,
        segments=seg,
        tokens=np.arange(10, dtype=np.int32),
        pad_token_id=0,
    )
    t = torch_adapter.batch_to_tensors(shard_batch(whole, 1, 2))
    assert t["positions"].tolist() == list(range(4, 12)) and (t["cp_rank"], t["cp_size"]) == (1, 2)
    assert t["input_ids"].tolist() == [4, 5, 6, 7, 8, 9, 0, 0]
    assert "positions" not in torch_adapter.batch_to_tensors(whole)
