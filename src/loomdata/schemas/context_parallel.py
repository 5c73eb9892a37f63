"""The context-parallel (CP) layout of a packed sequence, and what each CP rank's shard costs.

Layout (Megatron's load-balanced causal layout): a sequence of `seq_len` positions is cut into
`2 * cp` chunks, chunk k = [k * seq_len // (2cp), (k + 1) * seq_len // (2cp)); CP rank i holds chunk i
then chunk 2cp-1-i. Under causal attention the early chunks are cheap and the late ones dear, so
pairing them evens the ranks' work. With cp 1 the one rank holds the whole sequence. The sharding
(execution) and the cost (planning, the report) read the layout from here, so they cannot disagree.

Cost of a shard: a query at position p of its document attends to p + 1 keys; `cp_rank_costs`
prices it attention * (2p + 1) + linear, so the ranks' costs of a sequence sum exactly to
`CostSpec.of` over its segments (sum over p < L of (2p + 1) = L^2). For one document filling the
sequence, the pairs (i, 2cp-1-i) cost exactly the same; packed documents that cross chunk
boundaries make the ranks differ, which `cp_rank_costs` measures without a loop over tokens.

Addressing: a dp rank of a plan has `cp_group_size` CP peers, cp rank 0..G-1 (G = the larger of the
lanes' cp sizes); a micro-batch of a lane of cp size k is cut k ways and peer c holds shard c % k
(a lane of cp 1 is whole on every peer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from loomdata.schemas.errors import ExecutionError
from loomdata.schemas.header import PlanHeader

if TYPE_CHECKING:  # a rank imports this module: no pydantic spec or pyarrow at run time
    from loomdata.schemas.plan import PlanMeta
    from loomdata.schemas.plan_view import PlanView
    from loomdata.schemas.spec import CostSpec

__all__ = [
    "cp_chunk_bounds",
    "cp_group_check",
    "cp_group_size",
    "cp_imbalance",
    "cp_positions",
    "cp_rank_costs",
    "lane_cp_sizes",
]


def _check(seq_len: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if seq_len < 2 * cp_size and cp_size > 1:
        raise ValueError(f"seq_len {seq_len} is too short for {2 * cp_size} context-parallel chunks (cp {cp_size})")


def cp_chunk_bounds(seq_len: int, cp_size: int) -> np.ndarray:
    """The 2cp + 1 chunk boundaries (int64) of a sequence of `seq_len` positions (equal chunks when they divide)."""
    _check(seq_len, cp_size)
    n = 2 * cp_size
    return np.arange(n + 1, dtype=np.int64) * seq_len // n


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Positions (int64, ascending) of the sequence that CP rank `cp_rank` holds: chunk i, then chunk 2cp-1-i."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in 0..{cp_size - 1}, got {cp_rank}")
    if cp_size == 1:
        _check(seq_len, cp_size)
        return np.arange(seq_len, dtype=np.int64)
    b = cp_chunk_bounds(seq_len, cp_size)
    j = 2 * cp_size - 1 - cp_rank
    return np.concatenate([np.arange(b[cp_rank], b[cp_rank + 1]), np.arange(b[j], b[j + 1])]).astype(np.int64)


def cp_rank_costs(
    lengths: Any, sequence: Any, seq_len: int, cp_size: int, cost: CostSpec, *, num_sequences: int | None = None
) -> np.ndarray:
    """Cost (float64, [sequences, cp_size]) of each CP rank's shard of packed sequences.

    `lengths[k]` is segment k's length and `sequence[k]` the sequence it is packed into (0-based);
    segments of one sequence are given in their packing order (its first one starts at position 0).
    Text terms only (attention and linear); row sums equal `CostSpec.of` of the sequence's segments.
    """
    n = np.asarray(lengths, dtype=np.int64)
    seq = np.asarray(sequence, dtype=np.int64)
    if n.shape != seq.shape or n.ndim != 1:
        raise ValueError(f"lengths and sequence must be 1-d of one length, got shapes {n.shape} and {seq.shape}")
    if len(seq) and (np.diff(seq) < 0).any():
        raise ValueError("segments must be grouped by sequence in ascending order (packing order within one)")
    rows = int(num_sequences if num_sequences is not None else (seq.max() + 1 if len(seq) else 0))
    bounds = cp_chunk_bounds(seq_len, cp_size)
    out = np.zeros((rows, cp_size), dtype=np.float64)
    if not len(n):
        return out
    end = np.cumsum(n)
    first = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])  # each sequence's first segment
    base = np.repeat(end[first] - n[first], np.diff(np.r_[first, len(n)]))
    end -= base
    start = end - n
    if int(end.max()) > seq_len:
        raise ValueError(f"a sequence's segments total {int(end.max())} tokens, more than seq_len {seq_len}")
    lo = np.maximum(start[:, None], bounds[None, :-1])  # [segments, 2cp]: overlap with each chunk
    hi = np.minimum(end[:, None], bounds[None, 1:])
    hi = np.maximum(hi, lo)
    a, b = (lo - start[:, None]).astype(np.float64), (hi - start[:, None]).astype(np.float64)
    chunk = cost.attention * (b * b - a * a) + cost.linear * (b - a)
    per_rank = chunk[:, :cp_size] + chunk[:, ::-1][:, :cp_size]  # rank i: chunk i + chunk 2cp-1-i
    np.add.at(out, seq, per_rank)
    return out


def cp_imbalance(rank_costs: np.ndarray) -> np.ndarray:
    """Per sequence, max CP rank cost / mean CP rank cost (1.0 balanced; 1.0 for an empty sequence)."""
    c = np.asarray(rank_costs, dtype=np.float64)
    mean = c.mean(axis=1) if c.size else np.zeros(len(c))
    out = np.ones(len(c), dtype=np.float64)
    ok = mean > 0
    out[ok] = c[ok].max(axis=1) / mean[ok]
    return out


def lane_cp_sizes(meta: PlanMeta | PlanView | PlanHeader) -> tuple[int, int]:
    """Context-parallel size of the plan's short lane (0) and long lane (1; 1 without a long lane)."""
    if isinstance(meta, PlanHeader):
        return meta.lane_cp
    return meta.parameters.short_cp_size, (meta.long_cp_size if meta.long_seq_len is not None else 1)


def cp_group_size(meta: PlanMeta | PlanView | PlanHeader) -> int:
    """How many CP peers each dp rank of the plan has: the larger of its lanes' cp sizes."""
    return max(lane_cp_sizes(meta))


def cp_group_check(meta: PlanMeta | PlanView | PlanHeader, cp_rank: object) -> None:
    """Raise ExecutionError unless `cp_rank` is a CP peer of the plan's dp ranks (0..cp_group_size-1)."""
    group = cp_group_size(meta)
    ok = isinstance(cp_rank, (int, np.integer)) and not isinstance(cp_rank, bool) and 0 <= int(cp_rank) < group
    if not ok:
        raise ExecutionError(
            f"cp rank {cp_rank!r} is outside plan {meta.plan_id} (its dp ranks have {group} CP peer(s)); "
            f"pass a cp rank in 0..{group - 1}"
        )
