"""Compiled parts of the baselines (planning._baselines): every step's shuffle and the pieces both baselines cut.

- shuffle_steps: NumPy's Generator(PCG64).shuffle of each step's arange(n), re-seeded per step from its
  SeedSequence state (the same bits: PCG64's XSL-RR output over 128-bit state, next_uint32 buffering the high
  half of a 64-bit draw, bounded draws by masked rejection, Fisher-Yates from the last position down);
- concat_pieces / packed_pieces: each step's documents cut into pieces at seq_len boundaries, concatenated
  (concat-and-chunk) or one sequence a document piece, packed next-fit (packed), as arrays (a part of the cost is
  priced and summed over them in NumPy);
- baselines_pass: all of it for the whole cost in one pass a step (shuffle, cut, price, add to the rank's sum in
  np.bincount's order): no piece arrays, the same bits.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._jit import njit

__all__ = ["baselines_pass", "concat_pieces", "packed_pieces", "shuffle_steps"]

_U32 = np.uint64(0xFFFFFFFF)
_S1, _S32, _S58, _S63, _S64M = np.uint64(1), np.uint64(32), np.uint64(58), np.uint64(63), np.uint64(63)
_MULT_HI, _MULT_LO = np.uint64(2549297995355413924), np.uint64(4865540595714422341)  # PCG's 128-bit multiplier


@njit
def _place(p: int, seq: int, fill: int, rk: int, seq_len: int, dp: int) -> tuple[int, int, int]:
    """A piece of `p` tokens packed in order: (sequence, its tokens, its rank) after it, a new sequence (the next
    rank, round robin) where it does not fit the current one. The baselines' packing step, shared by both passes."""
    if fill + p > seq_len:
        return seq + 1, p, rk + 1 if rk + 1 < dp else 0
    return seq, fill + p, rk


@njit
def _mul64(a: np.uint64, b: np.uint64) -> tuple[np.uint64, np.uint64]:
    """The 128-bit product of two 64-bit words as (high, low)."""
    a0, a1, b0, b1 = a & _U32, a >> _S32, b & _U32, b >> _S32
    p0, p1, p2, p3 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p0 >> _S32) + (p1 & _U32) + (p2 & _U32)
    return p3 + (p1 >> _S32) + (p2 >> _S32) + (mid >> _S32), (p0 & _U32) | (mid << _S32)


@njit
def _step(hi: np.uint64, lo: np.uint64, inc_hi: np.uint64, inc_lo: np.uint64) -> tuple[np.uint64, np.uint64]:
    """PCG's LCG step: state * multiplier + increment (mod 2^128)."""
    h, low = _mul64(lo, _MULT_LO)
    h = h + lo * _MULT_HI + hi * _MULT_LO
    out_lo = low + inc_lo
    carry = np.uint64(1) if out_lo < low else np.uint64(0)
    return h + inc_hi + carry, out_lo


@njit
def _output(hi: np.uint64, lo: np.uint64) -> np.uint64:
    """PCG64's XSL-RR output of a 128-bit state."""
    x = hi ^ lo
    rot = hi >> _S58
    return (x >> rot) | (x << ((np.uint64(64) - rot) & _S64M))


@njit
def shuffle_steps(states: np.ndarray, first: np.ndarray, out: np.ndarray) -> None:
    """Shuffle out[first[i]:first[i+1]] in place as PCG64 seeded with SeedSequence state states[i] (4 words) and
    Generator.shuffle would (steps of fewer than 2 items draw nothing)."""
    for t in range(len(first) - 1):
        _shuffle_one(states, t, out, first[t], first[t + 1] - first[t])


@njit
def _shuffle_one(states: np.ndarray, t: int, out: np.ndarray, a: int, n: int) -> None:
    """Shuffle out[a:a+n] in place as PCG64 seeded with SeedSequence state states[t] and Generator.shuffle would."""
    if n < 2:
        return
    s0, s1, i0, i1 = states[t, 0], states[t, 1], states[t, 2], states[t, 3]
    inc_hi, inc_lo = (i0 << _S1) | (i1 >> _S63), (i1 << _S1) | _S1  # pcg_setseq_128_srandom_r
    lo = s1 + inc_lo
    hi = s0 + inc_hi + (np.uint64(1) if lo < s1 else np.uint64(0))
    hi, lo = _step(hi, lo, inc_hi, inc_lo)
    has32, buf = False, np.uint64(0)
    for i in range(n - 1, 0, -1):
        top = np.uint64(i)
        mask = top
        for sh in (1, 2, 4, 8, 16, 32):
            mask |= mask >> np.uint64(sh)
        while True:  # random_interval(i): masked draws until one is within [0, i]
            if top <= _U32:
                if has32:
                    v, has32 = buf, False
                else:
                    hi, lo = _step(hi, lo, inc_hi, inc_lo)
                    w = _output(hi, lo)
                    v, buf, has32 = w & _U32, w >> _S32, True
            else:
                hi, lo = _step(hi, lo, inc_hi, inc_lo)
                v = _output(hi, lo)
            v &= mask
            if v <= top:
                break
        j = a + np.int64(v)
        out[a + i], out[j] = out[j], out[a + i]


@njit
def concat_pieces(ln: np.ndarray, im: np.ndarray, first: np.ndarray, seq_len: int, dp: int) -> tuple[np.ndarray, ...]:
    """Concat-and-chunk: each step's documents (ln, im: tokens and image tokens, shuffled; step t's are
    first[t]..first[t+1]-1) end to end from a row start, cut at rows of seq_len: per piece in order its key
    (step * dp + row % dp), tokens and image tokens (pro rata, rounded down), and each step's row count.
    One pass, the current row and its rank followed as the documents go (no division a piece); the arrays are
    sized by a bound (a piece starts a document or a row) and returned as views of what was written."""
    n_steps = len(first) - 1
    n_rows = np.zeros(n_steps, dtype=np.int64)
    bound = len(ln)
    for t in range(n_steps):
        at = 0
        for d in range(first[t], first[t + 1]):
            at += ln[d]
        n_rows[t] = -(-at // seq_len)
        bound += n_rows[t]
    key = np.empty(bound, dtype=np.int64)
    plen = np.empty(bound, dtype=np.int64)
    pimg = np.empty(bound, dtype=np.int64)
    k = 0
    for t in range(n_steps):
        at, rs, rk, base = 0, 0, 0, t * dp  # rs: the current row's first token; rk: its rank (row % dp)
        for d in range(first[t], first[t + 1]):
            n = ln[d]
            end = at + n
            if n > 0:
                while at >= rs + seq_len:  # the row holding token `at`
                    rs += seq_len
                    rk = rk + 1 if rk + 1 < dp else 0
                img = im[d]
                while True:  # rows at // seq_len .. (end - 1) // seq_len
                    p = min(end, rs + seq_len) - max(at, rs)
                    key[k], plen[k], pimg[k] = base + rk, p, img * p // n if img != 0 else 0
                    k += 1
                    if rs + seq_len >= end:
                        break
                    rs += seq_len
                    rk = rk + 1 if rk + 1 < dp else 0
            at = end
    return key[:k], plen[:k], pimg[:k], n_rows


@njit
def packed_pieces(
    ln: np.ndarray, im: np.ndarray, first: np.ndarray, seq_len: int, dp: int, sequences: int
) -> tuple[np.ndarray, ...]:
    """Packed: each step's documents (shuffled) cut into seq_len pieces, packed next-fit into the step's own
    sequences (a new one at its first piece): per piece that lands within the first `sequences` in order its
    key (step * dp + sequence % dp), tokens and image tokens, and each step's packed tokens. A step's pass ends
    at its first piece past the `sequences` (none after it lands); the arrays are sized by a bound (a document's
    pieces are at most its tokens // seq_len + 1) and returned as views of what was written."""
    n_steps = len(first) - 1
    total = 0
    for d in range(len(ln)):
        total += ln[d]
    bound = total // seq_len + len(ln)
    key = np.empty(bound, dtype=np.int64)
    plen = np.empty(bound, dtype=np.int64)
    pimg = np.empty(bound, dtype=np.int64)
    done = np.zeros(n_steps, dtype=np.int64)
    k = 0
    for t in range(n_steps):
        seq, fill, rk, base, tok = 0, 0, 0, t * dp, 0  # rk: seq % dp
        for d in range(first[t], first[t + 1]):
            n, img = ln[d], im[d]
            at = 0
            while at < n:
                p = min(seq_len, n - at)
                seq, fill, rk = _place(p, seq, fill, rk, seq_len, dp)
                if seq >= sequences:
                    break
                key[k], plen[k], pimg[k] = base + rk, p, img * p // n if img != 0 else 0
                tok += p
                k += 1
                at += seq_len
            if seq >= sequences:
                break
        done[t] = tok
    return key[:k], plen[:k], pimg[:k], done


@njit
def _price(p: int, img: int, terms: np.ndarray, window: int, cp: float) -> float:
    """CostSpec.of of one piece (p tokens, img image tokens) with the float operations in records.cost_of's order:
    terms = (attention, linear, encoder, encoder_linear, has_encoder); window < 0: no encoder window."""
    n = np.float64(p)
    out = terms[0] * n * n + terms[1] * n
    if terms[4] != 0.0:
        e = np.float64(img)
        w = e if window < 0 else min(e, np.float64(window))
        enc = terms[2] * e * w
        if terms[3] != 0.0:
            enc = enc + terms[3] * e
        out = out + enc
    return out / cp


@njit
def baselines_pass(
    states: np.ndarray,
    first: np.ndarray,
    length: np.ndarray,
    image: np.ndarray,
    seq_len: int,
    dp: int,
    sequences: int,
    terms: np.ndarray,
    window: int,
    cp: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Both baselines of a block in one pass a step: the step's shuffle (shuffle_steps), then its documents in that
    order cut by concat_pieces' and packed_pieces' rules, each piece priced (_price) and added to its rank's sum
    as it is cut (the order np.bincount adds the pieces in). No piece arrays. Returns (concat per-rank sums
    [steps, dp], packed per-rank sums [steps, dp], each step's tokens (float64), concat rows, packed tokens)."""
    n_steps = len(first) - 1
    concat = np.zeros((n_steps, dp))
    packed = np.zeros((n_steps, dp))
    tokens = np.zeros(n_steps)
    n_rows = np.zeros(n_steps, dtype=np.int64)
    done = np.zeros(n_steps, dtype=np.int64)
    width = 0
    for t in range(n_steps):
        width = max(width, first[t + 1] - first[t])
    perm = np.empty(width, dtype=np.int64)
    for t in range(n_steps):
        a, m = first[t], first[t + 1] - first[t]
        for i in range(m):
            perm[i] = i
        _shuffle_one(states, t, perm, 0, m)
        tok = 0
        for i in range(m):
            tok += int(length[a + perm[i]])
        tokens[t] = np.float64(tok)
        n_rows[t] = -(-tok // seq_len)
        # concat-and-chunk (concat_pieces)
        at, rs, rk = 0, 0, 0
        for i in range(m):
            d = a + perm[i]
            n = int(length[d])
            end = at + n
            if n > 0:
                while at >= rs + seq_len:
                    rs += seq_len
                    rk = rk + 1 if rk + 1 < dp else 0
                img = int(image[d])
                while True:
                    p = min(end, rs + seq_len) - max(at, rs)
                    concat[t, rk] += _price(p, img * p // n if img != 0 else 0, terms, window, cp)
                    if rs + seq_len >= end:
                        break
                    rs += seq_len
                    rk = rk + 1 if rk + 1 < dp else 0
            at = end
        # packed (packed_pieces)
        seq, fill, rk, got = 0, 0, 0, 0
        for i in range(m):
            d = a + perm[i]
            n = int(length[d])
            img = int(image[d])
            at = 0
            while at < n:
                p = min(seq_len, n - at)
                seq, fill, rk = _place(p, seq, fill, rk, seq_len, dp)
                if seq >= sequences:
                    break
                packed[t, rk] += _price(p, img * p // n if img != 0 else 0, terms, window, cp)
                got += p
                at += seq_len
            if seq >= sequences:
                break
        done[t] = got
    return concat, packed, tokens, n_rows, done
