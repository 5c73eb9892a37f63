"""The cost model: simulated compute of one document segment, the quantity the balancer equalizes.

cost(segment) = attention * L^2 + linear * L + encoder * image_tokens^2, divided by the context-parallel
size of the lane the segment is planned into (a lane's sequence is split evenly over its cp ranks, so
one dp rank's timeline carries 1/cp of it). Padding costs nothing: packed sequences are run unpadded
(variable-length attention), so only document segments count.
"""

from __future__ import annotations

import numpy as np

from loomdata.schemas.spec import CostSpec

__all__ = ["segment_cost"]


def segment_cost(
    lengths: np.ndarray, image_tokens: np.ndarray | None, cost: CostSpec, cp_size: int | np.ndarray = 1
) -> np.ndarray:
    """Cost (float64) of each segment of `lengths` tokens (with `image_tokens`) on one rank of its cp group."""
    n = np.asarray(lengths, dtype=np.float64)
    out = cost.attention * n * n + cost.linear * n
    if image_tokens is not None and cost.encoder:
        img = np.asarray(image_tokens, dtype=np.float64)
        out += cost.encoder * img * img
    return out / np.asarray(cp_size, dtype=np.float64)
