"""Compiled report figures: the mixture error (planning._report.mixture_error: realized and target cumulative
shares and each step's worst error, in one pass over (sources, steps) tables, instead of a NumPy pass per operation;
the plan's own summary runs mixture_steps, the same operations step by step over its sparse token counts' cells) and
each step's cost total and largest segment (run_sums, for its LB).

The same values: token counts are integers, so their running and per-step totals are exact in any order;
the target's running sums run down the steps (as np.cumsum does) and every division is the same; a step's
worst error is a maximum, the same in any order of sources.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["mixture_rows", "mixture_shares", "mixture_steps", "mixture_totals", "run_sums", "running_totals"]


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
    div, b_div = mixture_totals(tokens, budgets)
    worst = np.zeros(steps)
    mixture_rows(tokens, weights, budgets, div, b_div, worst, realized, target, full)
    return worst * 100.0, realized, target


@njit
def mixture_totals(tokens: np.ndarray, budgets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(every source's tokens placed up to each step, the budgets (or steps) up to each step, at least 1) of
    (sources, steps) token counts: the shares' denominators."""
    n_src, steps = tokens.shape
    div = np.zeros(steps, dtype=np.int64)
    for k in range(n_src):
        for t in range(steps):
            div[t] += tokens[k, t]
    return running_totals(div, budgets)


@njit
def running_totals(div: np.ndarray, budgets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mixture_totals from every step's tokens over all sources (int64 `div`, made running in place)."""
    steps = len(div)
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
    return div, b_div


@njit
def mixture_rows(
    tokens: np.ndarray,
    weights: np.ndarray,
    budgets: np.ndarray,
    div: np.ndarray,
    b_div: np.ndarray,
    worst: np.ndarray,
    realized: np.ndarray,
    target: np.ndarray,
    full: bool,
) -> None:
    """The shares of some sources' rows (tokens, weights: (sources, steps)) against mixture_totals' `div` and
    `b_div`: each step's largest error so far raised in `worst`; their shares written to `realized` and
    `target` (each step's, or with `full` False the last step's only). Sources are independent of each other,
    so a block at a time gives what all at once would."""
    n_src, steps = tokens.shape
    weighted = len(budgets) > 0
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


@njit
def mixture_steps(
    per_step: np.ndarray,
    src: np.ndarray,
    value: np.ndarray,
    weights: np.ndarray,
    budgets: np.ndarray,
    t0: int,
    b_div: np.ndarray,
    cum: np.ndarray,
    run: np.ndarray,
    total: np.ndarray,
    worst: np.ndarray,
) -> None:
    """mixture_rows step by step over the nonzero cells of steps t0..t0+len(per_step)-1 (step-major: each step's
    per_step[i] cells, their sources and counts), every source's running tokens (`cum`, float64: integers, exact
    below 2^53) and target (`run`) carried across calls, and the running total of all tokens in total[0]: each
    step's worst error written to `worst`. `weights`: the steps' target rows (len(per_step), sources), or one row
    every step shares (a fixed mixture, or the steps after the schedule's last milestone). The same float
    operations on each (source, step) as mixture_rows, so the same bits; the sources' loop is free of carried
    dependencies (it vectorizes), the maximum taken after it."""
    n_src = len(cum)
    weighted = len(budgets) > 0
    one_row = weights.shape[0] == 1
    err = np.empty(n_src)
    c = 0
    tot = total[0]
    for i in range(len(per_step)):
        t = t0 + i
        for _ in range(per_step[i]):
            k = src[c]
            v = value[c]
            cum[k] += v
            tot += v
            c += 1
        d = float(tot) if tot > 0 else 1.0
        bd = b_div[t]
        w = weights[0] if one_row else weights[i]
        if weighted:
            bt = budgets[t]
            for k in range(n_src):
                run[k] += w[k] * bt
                err[k] = abs(cum[k] / d - run[k] / bd)
        else:
            for k in range(n_src):
                run[k] += w[k]
                err[k] = abs(cum[k] / d - run[k] / bd)
        # the largest error, in 4 independent running maxima (one chain of n_src dependent max operations was the
        # pass's bound); a maximum of finite values is the same in any order
        m0 = m1 = m2 = m3 = worst[t]
        k = 0
        while k + 4 <= n_src:
            m0 = max(m0, err[k])
            m1 = max(m1, err[k + 1])
            m2 = max(m2, err[k + 2])
            m3 = max(m3, err[k + 3])
            k += 4
        while k < n_src:
            m0 = max(m0, err[k])
            k += 1
        worst[t] = max(max(m0, m1), max(m2, m3))
    total[0] = tot


_PW_BLOCK = 128  # NumPy's PW_BLOCKSIZE: pairwise summation recurses above this many values


@njit
def _pairwise(a: np.ndarray, lo: int, n: int) -> float:
    """NumPy's pairwise sum of a[lo : lo + n] (DOUBLE_pairwise_sum: 8 accumulators within a block of 128, halves
    at multiples of 8 above), the same float additions in the same order."""
    if n < 8:
        res = -0.0
        for i in range(n):
            res += a[lo + i]
        return res
    if n <= _PW_BLOCK:
        r = a[lo : lo + 8].copy()
        i = 8
        while i < n - n % 8:
            for j in range(8):
                r[j] += a[lo + i + j]
            i += 8
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        while i < n:
            res += a[lo + i]
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise(a, lo, n2) + _pairwise(a, lo + n2, n - n2)


@njit
def run_sums(values: np.ndarray, off: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum and max of each non-empty run values[off[i]:off[i+1]], each sum the bits of the run's own .sum()
    (NumPy's add.reduce of a contiguous run: its pairwise sum). Empty arrays when a run is empty."""
    n = len(off) - 1
    total = np.zeros(n)
    top = np.zeros(n)
    for i in range(n):
        a, b = off[i], off[i + 1]
        if b <= a:
            return np.zeros(0), np.zeros(0)
        total[i] = 0.0 + _pairwise(values, a, b - a)  # add.reduce starts from +0.0 (its identity)
        m = values[a]
        for j in range(a + 1, b):
            if values[j] > m or values[j] != values[j]:  # NaN propagates, as in max
                m = values[j]
                if m != m:
                    break
        top[i] = m
    return total, top
