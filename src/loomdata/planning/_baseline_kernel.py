"""Compiled parts of the baselines (planning._baselines): every step's shuffle and the pieces both baselines cut.

- shuffle_steps: NumPy's Generator(PCG64).shuffle of each step's arange(n), re-seeded per step from its
  SeedSequence state (the same bits: PCG64's XSL-RR output over 128-bit state, next_uint32 buffering the high
  half of a 64-bit draw, bounded draws by masked rejection, Fisher-Yates from the last position down);
- concat_pieces / packed_pieces: each step's documents cut into pieces at seq_len boundaries, concatenated
  (concat-and-chunk) or one sequence a document piece, packed next-fit (packed), as arrays (a part of the cost is
  priced and summed over them in NumPy);
- baselines_pass: all of it for the whole cost in one pass a step (shuffle, cut, price, add to the rank's sum in
  np.bincount's order): no piece arrays, the same bits;
- baselines_text: baselines_pass where the cost has no encoder terms (a piece's price depends on its tokens
  alone: a table), faster by parts that keep the bits: each step's lengths shuffled as values with the PCG64
  draws made ahead (a widening multiply, two chains of states) and accepted without a branch, one walk for
  both baselines and the token sum, each rank's running sum held in a register while its row lasts.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from loomdata.planning._jit import njit

__all__ = ["baselines_pass", "baselines_text", "concat_pieces", "packed_pieces", "price_table", "shuffle_steps"]

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
def _seeded(states: np.ndarray, t: int) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """PCG64 seeded with SeedSequence state states[t] (pcg_setseq_128_srandom_r, as Generator(PCG64(...)) seeds it):
    (state high, state low, increment high, increment low), the state before the first draw's step."""
    s0, s1, i0, i1 = states[t, 0], states[t, 1], states[t, 2], states[t, 3]
    inc_hi, inc_lo = (i0 << _S1) | (i1 >> _S63), (i1 << _S1) | _S1
    lo = s1 + inc_lo
    hi = s0 + inc_hi + (np.uint64(1) if lo < s1 else np.uint64(0))
    hi, lo = _step(hi, lo, inc_hi, inc_lo)
    return hi, lo, inc_hi, inc_lo


@njit
def _shuffle_one(states: np.ndarray, t: int, out: np.ndarray, a: int, n: int) -> None:
    """Shuffle out[a:a+n] in place as PCG64 seeded with SeedSequence state states[t] and Generator.shuffle would."""
    if n < 2:
        return
    hi, lo, inc_hi, inc_lo = _seeded(states, t)
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
def _block_sums(first: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """A block's baseline results, zeroed (concat and packed per-rank sums [steps, dp], tokens, concat rows, packed
    tokens done), and its widest step's segments (the shuffle's buffer)."""
    n_steps = len(first) - 1
    width = 0
    for t in range(n_steps):
        width = max(width, first[t + 1] - first[t])
    return (
        np.zeros((n_steps, dp)),
        np.zeros((n_steps, dp)),
        np.zeros(n_steps),
        np.zeros(n_steps, dtype=np.int64),
        np.zeros(n_steps, dtype=np.int64),
        width,
    )


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
    concat, packed, tokens, n_rows, done, width = _block_sums(first, dp)
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


@intrinsic
def _mulhi(typingctx, a, b):  # type: ignore[no-untyped-def]
    """The high word of the 128-bit product of two uint64 (one widening multiply, as LLVM's i128 gives it)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        wide = ir.IntType(128)
        p = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(p, ir.Constant(wide, 64)), ir.IntType(64))

    return sig, codegen


_MULT2_HI, _MULT2_LO = np.uint64(1710491942223705148), np.uint64(5953435361322512025)  # the multiplier squared
_REFILL = 8
"""PCG64 outputs _shuffle_values makes at a time once its first guess of a step's draws runs out."""


@njit
def _mul128(ah: np.uint64, al: np.uint64, bh: np.uint64, bl: np.uint64) -> tuple[np.uint64, np.uint64]:
    """a * b mod 2^128 of two (high, low) pairs of words: one widening multiply and two low products."""
    return _mulhi(al, bl) + al * bh + ah * bl, al * bl  # type: ignore[call-arg]


@njit
def _fill(
    ah: np.uint64,
    al: np.uint64,
    bh: np.uint64,
    bl: np.uint64,
    ch: np.uint64,
    cl: np.uint64,
    out: np.ndarray,
    count: int,
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """`count` (even) PCG64 outputs from the states a and b (b the step after a) as 32-bit draws, each output's low
    half then its high half (next_uint32's order), into out[:2 * count]; returns the two states after them. The
    states two steps apart run as two chains of state * multiplier^2 + c (c = (multiplier + 1) * increment),
    so one output's multiply does not wait for the other's."""
    for k in range(0, count, 2):
        w = _output(ah, al)
        out[2 * k] = np.uint32(w & _U32)
        out[2 * k + 1] = np.uint32(w >> _S32)
        w = _output(bh, bl)
        out[2 * k + 2] = np.uint32(w & _U32)
        out[2 * k + 3] = np.uint32(w >> _S32)
        h, low = _mul128(ah, al, _MULT2_HI, _MULT2_LO)
        al = low + cl
        ah = h + ch + (np.uint64(1) if al < low else np.uint64(0))
        h, low = _mul128(bh, bl, _MULT2_HI, _MULT2_LO)
        bl = low + cl
        bh = h + ch + (np.uint64(1) if bl < low else np.uint64(0))
    return ah, al, bh, bl


@njit
def _shuffle_values(states: np.ndarray, t: int, vals: np.ndarray, m: int, draws: np.ndarray) -> None:
    """vals[:m] in the order Generator.shuffle (PCG64 seeded with SeedSequence state states[t]) leaves them, as
    _shuffle_one leaves an index array, for m <= 2^32 (every bound fits next_uint32); `draws`: a uint32 buffer
    of at least 16 (about 1.4 m + 4 saves refills). The draws are made ahead (_fill: about the 1.4 a position
    masked rejection takes, then _REFILL outputs at a time); positions are taken a power of two at a time (one
    mask each), and a draw is accepted without a branch (a rejected one swaps vals[i] with itself, keeps i)."""
    if m < 2:
        return
    hi, lo, inc_hi, inc_lo = _seeded(states, t)
    ah, al = _step(hi, lo, inc_hi, inc_lo)  # the first draw's state, and the next
    bh, bl = _step(ah, al, inc_hi, inc_lo)
    ch, cl = _mul128(inc_hi, inc_lo, _MULT_HI, _MULT_LO + _S1)
    mask = m - 1
    for sh in (1, 2, 4, 8, 16, 32):
        mask |= mask >> sh
    cap = len(draws) >> 1
    count = min(cap, ((m * 11) >> 4) + 2) & ~1
    k, have = 0, 0
    i = m - 1
    while i > 0:
        below = mask >> 1
        while i > below:  # random_interval(i) for i in (below, mask]: masked draws until one is within [0, i]
            if k == have:
                ah, al, bh, bl = _fill(ah, al, bh, bl, ch, cl, draws, count)
                k, have, count = 0, 2 * count, min(cap, _REFILL)
            v = np.int64(draws[k]) & mask
            k += 1
            ok = v <= i
            j = v if ok else i
            x, y = vals[i], vals[j]
            vals[j] = x
            vals[i] = y
            i -= int(ok)
        mask = below


@njit
def baselines_text(
    states: np.ndarray, first: np.ndarray, length: np.ndarray, seq_len: int, dp: int, sequences: int, price: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """baselines_pass where a piece's price depends on its tokens alone (no encoder terms: image tokens do not
    count), price[p] = _price(p, ..) for p = 0..seq_len (price_table), and no step has over 2^32 segments: each
    step's lengths shuffled as values (_shuffle_values), then one walk over them sums the tokens and cuts both
    baselines' pieces, each piece's price added to its rank's sum kept in a register while the row (sequence)
    stays on one rank and stored when it moves on: the same additions in the same order, the same bits."""
    n_steps = len(first) - 1
    concat, packed, tokens, n_rows, done, width = _block_sums(first, dp)
    vals = np.empty(width, dtype=np.int64)
    draws = np.empty(2 * width + 16, dtype=np.uint32)
    for t in range(n_steps):
        a, m = first[t], first[t + 1] - first[t]
        for i in range(m):
            vals[i] = length[a + i]
        _shuffle_values(states, t, vals, m, draws)
        c, pk = concat[t], packed[t]
        tok = 0
        room, rk, acc = seq_len, 0, 0.0  # concat: the current row's tokens left, its rank, that rank's sum
        seq, fill, prk, pacc, got, live = 0, 0, 0, 0.0, 0, sequences > 0  # packed: the same of its sequences
        for i in range(m):
            n = vals[i]
            tok += n
            if n <= 0:
                continue
            if room == 0:  # the last document ended its row: this one starts the next
                c[rk] = acc
                rk = rk + 1 if rk + 1 < dp else 0
                room, acc = seq_len, c[rk]
            left = n
            while left > room:
                acc += price[room]
                c[rk] = acc
                left -= room
                rk = rk + 1 if rk + 1 < dp else 0
                room, acc = seq_len, c[rk]
            acc += price[left]
            room -= left
            if live:  # next-fit in seq_len pieces, until a piece would open sequence `sequences`
                left = n
                while left > 0:
                    p = min(seq_len, left)
                    if fill + p > seq_len:
                        pk[prk] = pacc
                        seq += 1
                        if seq >= sequences:
                            live = False
                            break
                        prk = prk + 1 if prk + 1 < dp else 0
                        fill, pacc = p, pk[prk]
                    else:
                        fill += p
                    pacc += price[p]
                    got += p
                    left -= p
        c[rk] = acc
        if live:
            pk[prk] = pacc
        tokens[t] = np.float64(tok)
        n_rows[t] = -(-tok // seq_len)
        done[t] = got
    return concat, packed, tokens, n_rows, done


@njit
def price_table(seq_len: int, terms: np.ndarray, window: int, cp: float) -> np.ndarray:
    """_price(p, 0, ..) of p = 0..seq_len: every piece's price where the cost has no encoder terms
    (baselines_text's table; image tokens are priced by the encoder terms alone)."""
    out = np.empty(seq_len + 1)
    for p in range(seq_len + 1):
        out[p] = _price(p, 0, terms, window, cp)
    return out
