"""LoomDataset in-process: tensors share the batch memory, and the Stateful protocol resumes exactly."""

from __future__ import annotations

from pathlib import Path

import torch
from distributed import Client

from loomdata.execution import Executor
from loomdata.torch import LoomDataset


def test_state_dict_resume_and_zero_copy(dask_client: Client, stream_plan: Path) -> None:
    with Executor(stream_plan, dask_client):
        ds = LoomDataset(stream_plan, 1)
        assert ds.state_dict()["step"] == 0  # before iterating: no connection needed
        it = iter(ds)
        head = [next(it) for _ in range(3)]
        state = ds.state_dict()
        rest = list(it)
        ds.close()
        ds2 = LoomDataset(stream_plan, 1)
        ds2.load_state_dict(state)
        again = list(ds2)
        ds2.close()
    x = head[0]
    assert x["input_ids"].dtype == torch.int32 and x["labels"].shape == x["input_ids"].shape
    arr = x["input_ids"].numpy()
    arr[0] += 1  # the tensor and the array are one buffer
    assert int(x["input_ids"][0]) == int(arr[0])
    assert (state["step"], state["micro_batch"]) == (1, 1)
    assert len(again) == len(rest) > 0
    for a, b in zip(rest, again, strict=True):
        assert (a["step"], a["micro_batch"]) == (b["step"], b["micro_batch"])
        for k in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(a[k], b[k])


def test_dataloader_workers_are_refused_with_the_way_to_use_it(stream_plan: Path) -> None:
    """Under DataLoader workers the position would live in a worker: refused, saying num_workers=0."""
    import pytest

    from loomdata.schemas import ExecutionError

    loader = torch.utils.data.DataLoader(LoomDataset(stream_plan, 0), batch_size=None, num_workers=1)
    with pytest.raises(ExecutionError, match="num_workers=0"):
        next(iter(loader))
