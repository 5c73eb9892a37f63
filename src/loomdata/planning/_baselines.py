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
  the tokens it packed). (Simplifications, so that a block of steps is one pass: what waits is
  counted by that factor instead of going first into the next step; next-fit, not first-fit, whose
  backfill has no vectorised form here and would pack a little denser.)

With `part="encoder"` (or "backbone") the same layouts are priced by that part of the cost alone
(CostSpec.parts): the baselines' encoder and backbone loads per rank, for the report of `cost.balance: both`.

Both use one shuffle per step, seeded by (plan seed, salt, step), so they are deterministic; a block's shuffles,
cutting into pieces, pricing and per-rank sums run in one compiled pass a step (_baseline_kernel.baselines_pass;
without encoder terms baselines_text, a piece's price looked up by its tokens; a part of the cost, steps outside
0..2^32-1 or an empty block: the pieces as arrays, priced and summed in NumPy, the same bits). Long-lane
segments are treated like text (no framework has loomdata's lanes): short cp, seq_len rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from loomdata.planning._baseline_kernel import (
    baselines_pass,
    baselines_text,
    concat_pieces,
    packed_pieces,
    price_table,
    shuffle_steps,
)
from loomdata.planning._cost import segment_cost, segment_parts
from loomdata.schemas.spec import CostSpec

__all__ = ["BASELINE_DESCRIPTION", "baselines_flat", "baselines_many", "concat_chunk", "perms"]

_SALT = 0xC0C4

BASELINE_DESCRIPTION = (
    "concat_chunk: shuffled documents concatenated and cut into seq_len rows (Megatron GPTDataset), row j "
    "to rank j % dp; packed: shuffled next-fit packing into exactly micro_batches sequences per rank, "
    "overflow waits for the next step; headline gain against the stronger (lower max) of the two"
)


def _perm(seed: int, salt: int, t: int, n: int) -> np.ndarray:
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, salt, t]).permutation(n)


def perms(seed: int, salt: int, ts: Sequence[int], ns: np.ndarray) -> np.ndarray:
    """_perm(seed, salt, t, n) of every (t, n), concatenated (the same bits): the seed sequences of all steps
    are hashed at once (_seed_states), and each step's PCG64 shuffle runs compiled (_baseline_kernel)."""
    steps = np.asarray(ts, dtype=np.int64)
    ns = np.asarray(ns, dtype=np.int64)
    if len(steps) == 0:
        return np.zeros(0, dtype=np.int64)
    if steps.min() < 0 or steps.max() > _MASK32:  # outside one 32-bit entropy word: numpy's own seeding
        return np.concatenate([_perm(seed, salt, int(t), int(n)) for t, n in zip(steps, ns, strict=True)])
    words = [*_uint32_words(int(seed) & 0xFFFFFFFFFFFFFFFF), salt]
    first = np.zeros(len(ns) + 1, dtype=np.int64)
    np.cumsum(ns, out=first[1:])
    out = np.arange(int(first[-1]), dtype=np.int64) - np.repeat(first[:-1], ns)  # each step's arange(n)
    shuffle_steps(_seed_states(words, steps.astype(np.uint32)), first, out)  # what permutation(n) does, in place
    return out


_MASK32 = 0xFFFFFFFF
_TABLE_MAX = 1 << 18
"""The longest seq_len whose pieces' prices baselines_flat tables (2 MiB) for the text pass."""
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715


def _uint32_words(n: int) -> list[int]:
    """A non-negative int as SeedSequence reads it: 32-bit words, least significant first ([0] for 0)."""
    out = [n & _MASK32]
    n >>= 32
    while n:
        out.append(n & _MASK32)
        n >>= 32
    return out


def _seed_states(words: list[int], last: np.ndarray) -> np.ndarray:
    """(len(last), 4) uint64: SeedSequence(words + [last[i]]).generate_state(4, uint64) of every i, at once
    (NumPy's SeedSequence hashing with a pool of 4 words; its hash constants do not depend on the data)."""
    n = len(last)
    entropy = [np.full(n, w, dtype=np.uint32) for w in words] + [last.astype(np.uint32)]
    hc = _INIT_A

    def hashmix(v: np.ndarray) -> np.ndarray:
        nonlocal hc
        v = v ^ np.uint32(hc)
        hc = (hc * _MULT_A) & _MASK32
        v = v * np.uint32(hc)
        return v ^ (v >> np.uint32(16))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r: np.ndarray = (np.uint32(_MIX_L) * x - np.uint32(_MIX_R) * y).astype(np.uint32, copy=False)
        return r ^ (r >> np.uint32(16))

    zero = np.zeros(n, dtype=np.uint32)
    pool = [hashmix(entropy[i] if i < len(entropy) else zero) for i in range(4)]
    for i_src in range(4):
        for i_dst in range(4):
            if i_src != i_dst:
                pool[i_dst] = mix(pool[i_dst], hashmix(pool[i_src]))
    for i_src in range(4, len(entropy)):
        for i_dst in range(4):
            pool[i_dst] = mix(pool[i_dst], hashmix(entropy[i_src]))
    hb = _INIT_B
    out = np.empty((n, 8), dtype=np.uint32)
    for i in range(8):
        v = pool[i % 4] ^ np.uint32(hb)
        hb = (hb * _MULT_B) & _MASK32
        v = v * np.uint32(hb)
        out[:, i] = v ^ (v >> np.uint32(16))
    return out.view("<u8").astype(np.uint64).reshape(n, 4)


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
        ts,
        length,
        image,
        ns,
        seed=seed,
        seq_len=seq_len,
        dp=dp,
        micro_batches=micro_batches,
        cost_spec=cost_spec,
        cp=cp,
        part=part,
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
    one_pass: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """baselines_many on a block's own segments laid out flat (`ns[i]` of step ts[i], one step after the other).
    The whole cost is worked out in one compiled pass a step (_baseline_kernel.baselines_pass: no piece arrays;
    without encoder terms baselines_text, the pieces priced from a table of seq_len + 1 prices); a part of it,
    steps past 32 bits or `one_pass=False` take the piece arrays' path (the same bits)."""

    def price(plen: np.ndarray, pimg: np.ndarray) -> np.ndarray:
        if part == "all":
            return segment_cost(plen, pimg, cost_spec, cp)
        return segment_parts(plen, pimg, cost_spec, cp)[0 if part == "backbone" else 1]

    b = len(ns)
    ns = np.asarray(ns, dtype=np.int64)
    first = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ns, out=first[1:])
    # a block's steps come as a range: np.arange, not np.asarray's element by element conversion
    steps = np.arange(ts.start, ts.stop, ts.step) if isinstance(ts, range) else np.asarray(ts, dtype=np.int64)
    if one_pass and part == "all" and b and steps.min() >= 0 and steps.max() <= _MASK32:  # one compiled pass a step
        words = [*_uint32_words(int(seed) & 0xFFFFFFFFFFFFFFFF), _SALT]
        c = cost_spec
        terms = np.array([c.attention, c.linear, c.encoder, c.encoder_linear, 1.0 if c.has_encoder else 0.0])
        window = -1 if c.encoder_window is None else int(c.encoder_window)
        states = _seed_states(words, steps.astype(np.uint32))
        if not c.has_encoder and seq_len <= _TABLE_MAX and int(ns.max()) <= _MASK32 + 1:  # text prices: a table
            table = price_table(seq_len, terms, window, float(cp))
            concat, packed, tokens, n_rows, done_int = baselines_text(
                states, first, length, seq_len, dp, dp * micro_batches, table
            )
        else:
            concat, packed, tokens, n_rows, done_int = baselines_pass(
                states, first, length, image, seq_len, dp, dp * micro_batches, terms, window, float(cp)
            )
    else:
        concat, packed, tokens, n_rows, done_int = _baselines_arrays(
            ts, length, image, ns, first, price, seed, seq_len, dp, micro_batches
        )
    rows = np.maximum((n_rows[:, None] - np.arange(dp)[None, :] + dp - 1) // dp, 1)
    concat = concat * (micro_batches / rows * (n_rows / (dp * micro_batches))[:, None])
    done = done_int.astype(np.float64)
    packed = packed * (tokens / np.maximum(done, 1))[:, None]
    return concat, packed, tokens - done


def _baselines_arrays(
    ts: Sequence[int],
    length: np.ndarray,
    image: np.ndarray,
    ns: np.ndarray,
    first: np.ndarray,
    price: Callable[[np.ndarray, np.ndarray], np.ndarray],
    seed: int,
    seq_len: int,
    dp: int,
    micro_batches: int,
) -> tuple[np.ndarray, ...]:
    """baselines_flat's per-rank sums before scaling, as piece arrays priced and summed by np.bincount (one part
    of the cost, steps outside 32 bits, an empty block or `one_pass=False`): (concat [steps, dp], packed
    [steps, dp], tokens, concat rows, packed tokens)."""
    b = len(ns)
    step_of = np.repeat(np.arange(b), ns)
    idx = perms(seed, _SALT, ts, ns) + first[:-1][step_of]
    ln = length[idx].astype(np.int64)
    im = image[idx].astype(np.int64)
    tokens = np.bincount(step_of, weights=ln, minlength=b)
    keys = b * dp
    # concat_chunk: each step's documents end to end from a row start of its own (pieces cut by the kernel)
    key, plen, pimg, n_rows = concat_pieces(ln, im, first, seq_len, dp)
    concat = np.bincount(key, weights=price(plen, pimg), minlength=keys).reshape(b, dp)
    # packed: documents cut into seq_len pieces, next-fit with a new sequence at each step's first piece
    key, plen, pimg, done_int = packed_pieces(ln, im, first, seq_len, dp, dp * micro_batches)
    packed = np.bincount(key, weights=price(plen, pimg), minlength=keys).reshape(b, dp)
    return concat, packed, tokens, n_rows, done_int


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
