"""The resume checker, a tool for tests, benchmarks and demos: a client restored at any position yields
the same batches as the first pass, every array of them compared (images and their positions too)."""

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

_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "segments", "image_positions")


def _differs(a: Batch, b: Batch) -> str | None:
    """The first part of a batch that differs between `a` and `b` (every array, each image), or None."""
    if (a.step, a.dp_rank, a.micro_batch, a.lane) != (b.step, b.dp_rank, b.micro_batch, b.lane):
        return "position (step, dp_rank, micro_batch, lane)"
    for f in _FIELDS:
        if not np.array_equal(getattr(a, f), getattr(b, f)):
            return f
    if len(a.images) != len(b.images):
        return f"images ({len(a.images)} vs {len(b.images)})"
    for k, (x, y) in enumerate(zip(a.images, b.images, strict=True)):
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
            return f"images[{k}]"
    return None


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
            what = _differs(batches[i], again)
            if what is not None:
                raise ExecutionError(
                    f"resume mismatch for dp rank {dp_rank} at state {states[i]}: the batch's {what} differs from "
                    "the one first streamed; the executor does not rebuild steps deterministically"
                )
            checked += 1
    return checked
