"""LoomDataset: a torch IterableDataset over a StreamClient, yielding tensors that share the NumPy memory.

It implements the torchdata Stateful protocol (`state_dict` / `load_state_dict`), so a
`StatefulDataLoader` or a training loop can checkpoint and resume the stream exactly. Batches are
built a window ahead by the executor, so use it with `num_workers=0` (in the training process):
under DataLoader workers the position would live in a worker process, and the training process's
`state_dict()` would not see it, so iteration there is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from loomdata.client._state import StreamState
from loomdata.client._stream import StreamClient
from loomdata.schemas.batch import Batch
from loomdata.schemas.errors import ExecutionError
from loomdata.schemas.header import read_plan_header

__all__ = ["LoomDataset", "batch_to_tensors"]


def _tensor(a: np.ndarray) -> torch.Tensor:
    """Share `a`'s memory (arrays arrive writable from Dask's frames, so torch does not warn)."""
    return torch.from_numpy(a)


def batch_to_tensors(batch: Batch) -> dict[str, Any]:
    """A dict of tensors sharing the batch's NumPy arrays (no copy), plus its step/rank/micro-batch."""
    out: dict[str, Any] = {
        "input_ids": _tensor(batch.input_ids),
        "labels": _tensor(batch.labels),
        "position_ids": _tensor(batch.position_ids),
        "cu_seqlens": _tensor(batch.cu_seqlens),
        "step": batch.step,
        "dp_rank": batch.dp_rank,
        "micro_batch": batch.micro_batch,
        "lane": batch.lane,
    }
    pos = batch.positions
    if pos is not None:  # a context-parallel shard: which sequence positions it holds
        out["positions"] = _tensor(pos)
        out["cp_rank"], out["cp_size"] = batch.cp_rank, batch.cp_size
    if batch.images:
        out["images"] = [_tensor(im) for im in batch.images]
        out["image_positions"] = _tensor(batch.image_positions)
    return out


class LoomDataset(IterableDataset[dict[str, Any]]):
    """The micro-batches of one dp rank as dicts of tensors; Stateful for exact resume."""

    def __init__(
        self,
        plan_dir: str | Path,
        dp_rank: int,
        scheduler: str | None = None,
        *,
        start_step: int = 0,
        **stream_options: Any,
    ) -> None:
        """`stream_options` go to the StreamClient (`security`, `insecure`, `retry_s`, `timings`...)."""
        super().__init__()
        self._options = stream_options
        self.plan_dir = Path(plan_dir)
        self.dp_rank = dp_rank
        self.scheduler = scheduler
        self._start_step = start_step
        self._pending_state: dict[str, Any] | None = None
        self._client: StreamClient | None = None

    def _stream(self) -> StreamClient:
        if self._client is None:  # created lazily, in the process that iterates
            self._client = StreamClient(
                self.plan_dir, self.dp_rank, self.scheduler, start_step=self._start_step, **self._options
            )
            if self._pending_state is not None:
                self._client.load_state_dict(self._pending_state)
                self._pending_state = None
        return self._client

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        if info is not None:
            raise ExecutionError(
                f"LoomDataset under a DataLoader with num_workers={info.num_workers}: the stream position would "
                "live in a worker process (state_dict() in the training process would not see it, and several "
                "workers would stream the same rank); use DataLoader(dataset, batch_size=None, num_workers=0): "
                "the executor already builds batches a window ahead"
            )
        stream = self._stream()
        for batch in stream:
            yield batch_to_tensors(batch)

    def record_step_time(self, step: int, seconds: float) -> None:
        """Report this rank's measured time for `step` (see StreamClient.record_step_time); no round trip."""
        self._stream().record_step_time(step, seconds)

    def state_dict(self) -> dict[str, Any]:
        """The stream position (see StreamClient.state_dict)."""
        if self._client is not None:
            return self._client.state_dict()
        if self._pending_state is not None:
            return dict(self._pending_state)
        meta = read_plan_header(self.plan_dir)  # not iterated yet: the start position, without connecting
        return StreamState(plan_id=meta.plan_id, dp_rank=self.dp_rank, step=self._start_step, micro_batch=0).as_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from a saved position (validated when the stream opens)."""
        if self._client is not None:
            self._client.load_state_dict(state_dict)
        else:
            self._pending_state = dict(state_dict)

    def close(self) -> None:
        """Close the underlying StreamClient."""
        if self._client is not None:
            self._client.close()
            self._client = None
