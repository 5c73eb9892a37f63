"""The cost model: simulated compute of one document segment, the quantity the balancer equalizes.

cost(segment) = attention * L^2 + linear * L + encoder * I * min(I, encoder_window) + encoder_linear * I
(I: image tokens), divided by the context-parallel
size of the lane the segment is planned into (a lane's sequence is split evenly over its cp ranks, so
one dp rank's timeline carries 1/cp of it). Padding costs nothing: packed sequences are run unpadded
(variable-length attention), so only document segments count. `segment_parts` gives the backbone part
(the L terms) and the encoder part (the I terms) apart, for `cost.balance: both` (schemas.spec.CostSpec).

`fit_cost` calibrates the coefficients from measured step or micro-batch times (least squares); put the
result under `cost:` in the spec.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomdata.schemas.errors import PlanError
from loomdata.schemas.spec import CostSpec

__all__ = ["fit_cost", "segment_cost", "segment_parts"]


def segment_cost(
    lengths: np.ndarray, image_tokens: np.ndarray | None, cost: CostSpec, cp_size: int | np.ndarray = 1
) -> np.ndarray:
    """Cost (float64) of each segment of `lengths` tokens (with `image_tokens`) on one rank of its cp group."""
    return cost.of(lengths, image_tokens, cp_size)


def segment_parts(
    lengths: np.ndarray, image_tokens: np.ndarray | None, cost: CostSpec, cp_size: int | np.ndarray = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(backbone, encoder) cost (float64) of each segment on one rank of its cp group; their sum is `segment_cost`."""
    return cost.parts(lengths, image_tokens, cp_size)


def fit_cost(
    lengths: Sequence[np.ndarray],
    seconds: Sequence[float] | np.ndarray,
    image_tokens: Sequence[np.ndarray] | None = None,
) -> CostSpec:
    """Calibrate the cost model from measured times: entry i lists the segment lengths one run took seconds[i] for.

    A run is a micro-batch or a rank's step. Non-negative least squares over the features
    (sum L^2, sum L, sum image_tokens^2), by refitting without any term that comes out negative; the
    result is scaled so attention = 1 (or linear = 1 when the attention term vanishes), the spec's units.
    """
    y = np.asarray(seconds, dtype=np.float64)
    if len(lengths) != len(y) or len(y) < 2:
        raise PlanError(
            f"fit_cost: need one list of segment lengths per measured time and at least 2 runs, "
            f"got {len(lengths)} length lists and {len(y)} times"
        )
    feats = np.zeros((len(y), 3))
    for i, seg in enumerate(lengths):
        n = np.asarray(seg, dtype=np.float64)
        feats[i, 0] = (n * n).sum()
        feats[i, 1] = n.sum()
        if image_tokens is not None:
            img = np.asarray(image_tokens[i], dtype=np.float64)
            feats[i, 2] = (img * img).sum()
    active = [j for j in range(3) if feats[:, j].any()]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(feats[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    unit = coef[0] if coef[0] > 0 else coef[1]
    if not unit > 0:
        raise PlanError("fit_cost: the measured times do not grow with the segments' lengths; measure longer runs")
    return CostSpec(attention=float(coef[0] / unit), linear=float(coef[1] / unit), encoder=float(coef[2] / unit))
