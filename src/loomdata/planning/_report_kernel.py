"""Compiled mixture error (planning._report.mixture_error): realized and target cumulative shares and each
step's worst error, in one pass over the (sources, steps) tables (the report keeps them source-major) instead of
a NumPy pass per operation.

The same values: token counts are integers, so their running and per-step totals are exact in any order;
the target's running sums run down the steps (as np.cumsum does) and every division is the same; a step's
worst error is a maximum, the same in any order of sources.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["mixture_shares"]


@njit
def mixture_shares(
    tokens: np.ndarray, weights: np.ndarray, budgets: np.ndarray, full: bool = True
) -> tuple[np.ndarray, ...]:
    """(worst error per step in pp, realized cumulative shares, target cumulative shares) of (sources, steps)
    token counts and weights, the shares (sources, steps) too; targets weighted by the steps' `budgets` unless
    that is empty. `full` False: the shares of the last step only (one column each; the summary's need, without
    two (sources, steps) tables)."""
    n_src, steps = tokens.shape
    cols = steps if full or steps == 0 else 1
    realized = np.empty((n_src, cols))
    target = np.empty((n_src, cols))
    div = np.zeros(steps, dtype=np.int64)  # every source's tokens placed up to each step
    for k in range(n_src):
        for t in range(steps):
            div[t] += tokens[k, t]
    b_div = np.empty(steps)
    weighted = len(budgets) > 0
    run_b, tot = 0.0, 0
    for t in range(steps):
        tot += div[t]
        div[t] = tot
        if weighted:
            run_b += budgets[t]
            b_div[t] = max(run_b, 1.0)
        else:
            b_div[t] = float(t + 1)
    worst = np.zeros(steps)
    for k in range(n_src):
        cum, run, r, g = 0, 0.0, 0.0, 0.0
        for t in range(steps):
            cum += tokens[k, t]
            r = float(cum) / (float(div[t]) if div[t] > 0 else 1.0)
            run += weights[k, t] * budgets[t] if weighted else weights[k, t]
            g = run / b_div[t]
            worst[t] = max(worst[t], abs(r - g))
            if full:
                realized[k, t] = r
                target[k, t] = g
        if not full and steps:
            realized[k, 0] = r
            target[k, 0] = g
    return worst * 100.0, realized, target
