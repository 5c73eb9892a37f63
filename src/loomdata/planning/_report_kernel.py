"""Compiled mixture error (planning._report.mixture_error): realized and target cumulative shares and each
step's worst error, in one pass over the (steps, sources) tables instead of a NumPy pass per operation.

The same values: token counts are integers, so their running and per-step totals are exact in any order;
the target's running sums run down the steps (as np.cumsum does) and every division is the same.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["mixture_shares"]


@njit
def mixture_shares(
    tokens: np.ndarray, weights: np.ndarray, budgets: np.ndarray, full: bool = True
) -> tuple[np.ndarray, ...]:
    """(worst error per step in pp, realized cumulative shares, target cumulative shares) of (steps, sources)
    token counts and weights; targets weighted by the steps' `budgets` unless that is empty. `full` False: the
    shares of the last step only (one row each; the summary's need, without two (steps, sources) tables)."""
    steps, n_src = tokens.shape
    err = np.zeros(steps)
    rows = steps if full or steps == 0 else 1
    realized = np.empty((rows, n_src))
    target = np.empty((rows, n_src))
    cum = np.zeros(n_src, dtype=np.int64)
    run = np.zeros(n_src)
    run_b = 0.0
    weighted = len(budgets) > 0
    for t in range(steps):
        tot = 0
        for k in range(n_src):
            cum[k] += tokens[t, k]
            tot += cum[k]
        div = float(tot) if tot > 0 else 1.0
        if weighted:
            run_b += budgets[t]
            b_div = max(run_b, 1.0)
        else:
            b_div = float(t + 1)
        worst = 0.0
        r = t if full else 0
        for k in range(n_src):
            realized[r, k] = float(cum[k]) / div
            run[k] += weights[t, k] * budgets[t] if weighted else weights[t, k]
            target[r, k] = run[k] / b_div
            worst = max(worst, abs(realized[r, k] - target[r, k]))
        err[t] = worst * 100.0
    return err, realized, target
