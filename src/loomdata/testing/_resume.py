"""The resume checker, a tool for tests, benchmarks and demos: a client restored at any position yields
the same batches as the first pass."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loomdata.client import StreamClient
from loomdata.schemas.batch import Batch
from loomdata.schemas.errors import ExecutionError

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["verify_resume"]

_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "segments")


def _same(a: Batch, b: Batch) -> bool:
    if (a.step, a.dp_rank, a.micro_batch, a.lane) != (b.step, b.dp_rank, b.micro_batch, b.lane):
        return False
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in _FIELDS)


def verify_resume(
    plan_dir: str | Path, dp_rank: int, scheduler: str | None = None, *, every: int = 1, client: Client | None = None
) -> int:
    """Stream `dp_rank` once, then for every `every`-th position load its saved state into a new client
    and compare the next micro-batch; ExecutionError names the first position that differs.

    Returns the number of positions checked. Every resumed read is rebuilt from the plan, so this also
    proves the executor's rebuild path is deterministic.
    """
    if every < 1:
        raise ExecutionError(f"every must be >= 1, got {every}")
    with StreamClient(plan_dir, dp_rank, scheduler, client=client) as ref:
        states, batches = [], []
        while True:
            state = ref.state_dict()
            try:
                batch = next(ref)
            except StopIteration:
                break
            states.append(state)
            batches.append(batch)
        shared = ref.dask_client if client is None else client
        checked = 0
        for i in range(0, len(states), every):
            resumed = StreamClient(plan_dir, dp_rank, scheduler, client=shared)
            resumed.load_state_dict(states[i])
            again = next(resumed)
            resumed.close()
            if not _same(batches[i], again):
                raise ExecutionError(
                    f"resume mismatch for dp rank {dp_rank} at state {states[i]}: the batch differs from the "
                    "one first streamed; the executor does not rebuild steps deterministically"
                )
            checked += 1
    return checked
