"""The two baselines a plan is compared with: what a user would run instead of loomdata, on the same steps.

- concat_chunk, as Megatron's GPTDataset and LitData's TokensLoader do: the step's documents (its
  segments) shuffled, concatenated and cut into full seq_len rows, a document split at row boundaries;
  each piece costs as its own segment; row j goes to rank j % dp (Megatron's sampler deals a global
  micro-batch of dp rows, one per rank). A step's tokens fill fewer rows than dp * micro_batches
  (planning.fill < 1): each rank's time is scaled to micro_batches rows, times rows / (dp * micro_batches),
  the steady state of a stream that never leaves a row empty.
- packed: shuffled greedy packing with exactly micro_batches sequences of seq_len per rank, as
  sequence packers do: documents longer than seq_len are cut into seq_len pieces, packed next-fit in
  shuffled order into the step's dp * micro_batches sequences; what does not fit waits (the tokens are
  reported). Sequence j goes to rank j % dp. Packing less densely than the plan, it needs more steps
  for the same tokens, so its time for a step's tokens is its per-rank time times (the step's tokens /
  the tokens it packed). (Simplifications, so that a block of steps is one NumPy pass: what waits is
  counted by that factor instead of going first into the next step; next-fit, not first-fit, whose
  backfill has no vectorised form here and would pack a little denser.)

With `part="encoder"` (or "backbone") the same layouts are priced by that part of the cost alone
(CostSpec.parts): the baselines' encoder and backbone loads per rank, for the report of `cost.balance: both`.

Both use one shuffle per step, seeded by (plan seed, salt, step), so they are deterministic. Long-lane
segments are treated like text (no framework has loomdata's lanes): short cp, seq_len rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from loomdata.planning._cost import segment_cost, segment_parts
from loomdata.planning._packing import next_fit
from loomdata.schemas.spec import CostSpec

__all__ = ["BASELINE_DESCRIPTION", "baselines_flat", "baselines_many", "concat_chunk"]

_SALT = 0xC0C4

BASELINE_DESCRIPTION = (
    "concat_chunk: shuffled documents concatenated and cut into seq_len rows (Megatron GPTDataset), row j "
    "to rank j % dp; packed: shuffled next-fit packing into exactly micro_batches sequences per rank, "
    "overflow waits for the next step; headline gain against the stronger (lower max) of the two"
)


def _perm(seed: int, salt: int, t: int, n: int) -> np.ndarray:
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, salt, t]).permutation(n)


def perms(seed: int, salt: int, ts: Sequence[int], ns: np.ndarray) -> np.ndarray:
    """_perm(seed, salt, t, n) of every (t, n), concatenated."""
    out = [_perm(seed, salt, int(t), int(n)) for t, n in zip(ts, ns, strict=True)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _pieces(length: np.ndarray, image: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, ...]:
    """Cut segments laid at `starts` (token offsets) at multiples of seq_len: (row, piece length, piece image
    tokens, segment index) of every piece."""
    end = starts + length
    first, last = starts // seq_len, (end - 1) // seq_len
    n = (last - first + 1).astype(np.int64)
    seg = np.repeat(np.arange(len(length)), n)
    row = first[seg] + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    lo = np.maximum(starts[seg], row * seq_len)
    hi = np.minimum(end[seg], (row + 1) * seq_len)
    plen = hi - lo
    pimg = image[seg] * plen // np.maximum(length[seg], 1)
    return row, plen, pimg, seg


def baselines_many(
    ts: Sequence[int],
    steps: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    seed: int,
    seq_len: int,
    dp: int,
    micro_batches: int,
    cost_spec: CostSpec,
    cp: int,
    part: Literal["all", "backbone", "encoder"] = "all",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both baselines for a block of steps ((length, image tokens) of each step's own segments), at once:
    (concat_chunk per-rank time [steps, dp], packed per-rank time [steps, dp], packed tokens waiting [steps]);
    times of one `part` of the cost only when asked."""
    ns = np.array([len(s[0]) for s in steps], dtype=np.int64)
    length = np.concatenate([s[0] for s in steps]) if len(steps) else np.zeros(0, dtype=np.int64)
    image = np.concatenate([s[1] for s in steps]) if len(steps) else np.zeros(0, dtype=np.int64)
    return baselines_flat(
        ts, length, image, ns, seed=seed, seq_len=seq_len, dp=dp, micro_batches=micro_batches,
        cost_spec=cost_spec, cp=cp, part=part,
    )


def baselines_flat(
    ts: Sequence[int],
    length: np.ndarray,
    image: np.ndarray,
    ns: np.ndarray,
    *,
    seed: int,
    seq_len: int,
    dp: int,
    micro_batches: int,
    cost_spec: CostSpec,
    cp: int,
    part: Literal["all", "backbone", "encoder"] = "all",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """baselines_many on a block's own segments laid out flat (`ns[i]` of step ts[i], one step after the other)."""

    def price(plen: np.ndarray, pimg: np.ndarray) -> np.ndarray:
        if part == "all":
            return segment_cost(plen, pimg, cost_spec, cp)
        return segment_parts(plen, pimg, cost_spec, cp)[0 if part == "backbone" else 1]

    b = len(ns)
    ns = np.asarray(ns, dtype=np.int64)
    first = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ns, out=first[1:])
    step_of = np.repeat(np.arange(b), ns)
    idx = perms(seed, _SALT, ts, ns) + first[:-1][step_of]
    ln = length[idx].astype(np.int64)
    im = image[idx].astype(np.int64)
    tokens = np.bincount(step_of, weights=ln, minlength=b)
    keys = b * dp
    # concat_chunk: each step's documents end to end from a row start of its own
    cum = np.cumsum(ln) - ln
    local = cum - cum[np.minimum(first[step_of], len(cum) - 1)]
    n_rows = -(-tokens.astype(np.int64) // seq_len)
    base = np.cumsum(n_rows) - n_rows
    row, plen, pimg, seg = _pieces(ln, im, local + base[step_of] * seq_len, seq_len)
    st = step_of[seg]
    key = st * dp + (row - base[st]) % dp
    concat = np.bincount(key, weights=price(plen, pimg), minlength=keys).reshape(b, dp)
    rows = np.maximum((n_rows[:, None] - np.arange(dp)[None, :] + dp - 1) // dp, 1)
    concat *= micro_batches / rows * (n_rows / (dp * micro_batches))[:, None]
    # packed: documents cut into seq_len pieces, next-fit with a new sequence at each step's first piece
    n = -(-ln // seq_len)
    _, plen, pimg, seg = _pieces(ln, im, np.cumsum(n * seq_len) - n * seq_len, seq_len)
    st = step_of[seg]
    brk = np.flatnonzero(st[1:] != st[:-1]) + 1
    seq = next_fit(np.insert(plen, brk, seq_len), seq_len) if len(plen) else np.zeros(0, dtype=np.int64)
    seq = np.delete(seq, brk + np.arange(len(brk)))
    p_first = np.zeros(len(plen), dtype=bool)
    if len(plen):
        p_first[0] = True
    p_first[brk] = True
    seq = seq - np.maximum.accumulate(np.where(p_first, seq, 0))  # sequence index within its step
    inside = seq < dp * micro_batches
    key = st[inside] * dp + seq[inside] % dp
    cost = price(plen[inside], pimg[inside])
    done = np.bincount(st[inside], weights=plen[inside], minlength=b)
    packed = np.bincount(key, weights=cost, minlength=keys).reshape(b, dp) * (tokens / np.maximum(done, 1))[:, None]
    return concat, packed, tokens - done


def concat_chunk(
    length: np.ndarray,
    image: np.ndarray,
    *,
    t: int,
    seed: int,
    seq_len: int,
    dp: int,
    micro_batches: int,
    cost_spec: CostSpec,
    cp: int,
) -> np.ndarray:
    """Per-rank time of the concat-and-chunk baseline for step t's segments (length, image tokens): one step
    of baselines_many (its reference form)."""
    if len(length) == 0:
        return np.zeros(dp)
    p = _perm(seed, _SALT, t, len(length))
    ln = length[p].astype(np.int64)
    starts = np.cumsum(ln) - ln
    row, plen, pimg, _ = _pieces(ln, image[p].astype(np.int64), starts, seq_len)
    cost = segment_cost(plen, pimg, cost_spec, cp)
    n_rows = int(row[-1]) + 1
    rank = row % dp
    per = np.bincount(rank, weights=cost, minlength=dp)
    rows = np.bincount(np.arange(n_rows) % dp, minlength=dp)
    return per * micro_batches / np.maximum(rows, 1) * (n_rows / (dp * micro_batches))
