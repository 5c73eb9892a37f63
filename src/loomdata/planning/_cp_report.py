"""How evenly each long-lane sequence of a stored plan splits over its context-parallel ranks.

The balancer prices a long sequence as cost / cp on its dp rank (an even split); in the served layout
(schemas.context_parallel: chunks i and 2cp-1-i) the CP ranks of a packed sequence differ when its
documents cross chunk boundaries, and the micro-batch takes as long as its costliest CP rank. This
reads the manifest's long-lane rows (four columns, one vectorised pass) and prices every CP rank's
shard with `cp_rank_costs`; nothing is stored, so plans stay byte-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from loomdata.schemas.context_parallel import cp_imbalance, cp_rank_costs
from loomdata.schemas.plan import PlanMeta, read_manifest

__all__ = ["cp_figures"]


def cp_figures(plan_dir: Path, meta: PlanMeta) -> dict[str, Any] | None:
    """Per-CP-rank balance of the plan's long-lane sequences; None without a long lane of cp > 1.

    `imbalance`: distribution over sequences of max CP rank cost / mean; `time_ratio`: sum over
    sequences of the costliest CP rank / sum of the even split (what the planner assumed), i.e. how
    much longer the long-lane micro-batches run than planned, all together.
    """
    cp = meta.long_cp_size
    if meta.long_seq_len is None or cp <= 1:
        return None
    worst = even = 0.0
    imb: list[np.ndarray] = []
    for f in meta.manifest:  # a partition at a time (sequences never span one), four columns
        t = read_manifest(
            plan_dir, meta, f.first_step, f.last_step, columns=["step", "dp_rank", "micro_batch", "lane", "length"]
        )
        t = t.filter(pc.equal(t.column("lane"), 1))
        cols = [t.column(c).to_numpy().astype(np.int64) for c in ("step", "dp_rank", "micro_batch")]
        length = t.column("length").to_numpy().astype(np.int64)
        if not len(length):
            continue
        new = np.r_[True, (np.diff(cols[0]) != 0) | (np.diff(cols[1]) != 0) | (np.diff(cols[2]) != 0)]
        seq = np.cumsum(new) - 1  # one long sequence per (step, dp_rank, micro_batch) slot
        costs = cp_rank_costs(length, seq, meta.long_seq_len, cp, meta.parameters.cost)
        worst += float(costs.max(axis=1).sum())
        even += float(costs.sum()) / cp
        imb.append(cp_imbalance(costs))
    x = np.concatenate(imb) if imb else np.zeros(0)
    return {
        "cp_size": cp,
        "sequences": len(x),
        "imbalance": _dist(x),
        "time_ratio": float(worst / even) if even > 0 else 1.0,
    }


def _dist(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {"mean": 1.0, "p99": 1.0, "max": 1.0}
    return {"mean": float(x.mean()), "p99": float(np.quantile(x, 0.99)), "max": float(x.max())}
