"""Hybrid encoder/backbone local search (`cost.balance: both`), for a block of steps at once.

When the vision encoder and the language backbone run on different stages or devices, a step takes as
long as the slower stage, so what counts is each part's most loaded rank, not the most loaded sum. A
rank's load is a vector (E_r encoder, B_r backbone); the objective of a step is

    max over ranks of max(E_r / LB_E, B_r / LB_B),   LB_X = max(total X / dp, largest segment's X)

(each part normalized by its own lower bound, 1.0 being as even as that part allows). The search starts
from the summed-cost plan (the `sum` balancer's placement, so a step's segments, deferrals and carries are
those of `sum`) and never raises a step's objective, so `both` is never worse than `sum` on it.

A round works on units: a step's rank h of largest objective with its partner ranks (all other ranks at
small dp; at large dp the HYBRID_PARTNERS least loaded by the objective and by h's binding part, or, when
several ranks are over the tolerance, up to dp // (HYBRID_MULTI_PARTNERS + 1) units per step on disjoint
ranks). A unit scores, in padded (units, |a|, |partners| or |b|) grids: moving a segment a of h to a
partner's roomiest short micro-batch, swapping a for a partner's segment b (room checked in both slots),
and (where neither helps) trading a for the j <= HYBRID_EXCHANGE_MAX lightest segments of one partner
micro-batch (an image sample for several short texts, when every rank is full). It takes the candidate
that leaves the pair with the smallest objective if that is below h's. h's candidates are its segments
with the most of its binding part (the image samples when the encoder binds). A step stops when its
objective is within HYBRID_TOLERANCE of 1, when no unit improves, after HYBRID_STALL rounds without a
real gain, or after HYBRID_ROUNDS rounds. All units of a block run a round together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loomdata.planning.balance._state import Dealt, members
from loomdata.planning.balance._state import step_max as _step_max

__all__ = ["hybrid_objective", "hybrid_search"]

HYBRID_ROUNDS = 32  # at dp 512 rounds 32-64 gain 0.2% (1.0056 -> 1.0037 at 8K) for twice the time
HYBRID_TOLERANCE = 1e-3  # a step whose objective is within this of 1.0 is done
HYBRID_PARTNERS = 8  # partner ranks of h (all other ranks at dp <= this + 1)
HYBRID_A = 24  # segments of h considered per round (the most of its binding part first)
HYBRID_B = 96  # segments of a lone unit's partners considered per round (swaps), evenly spaced
HYBRID_MULTI_B = 32  # the same for a unit of a step with several units
HYBRID_MULTI_A = 8  # segments of h considered per round in a step with several units
HYBRID_MULTI_PARTNERS = 3  # partner ranks of each unit when a step runs several units in a round
HYBRID_MIN_GAIN = 1e-4  # a round lowering a step's objective by less than this fraction is no real gain
HYBRID_STALL = 6  # a step stops after this many rounds without a real gain
HYBRID_EXCHANGE_A = 8  # segments of h considered for exchanges
HYBRID_EXCHANGE_MAX = 8  # at most this many of a partner slot's lightest segments for one of h's


def hybrid_objective(enc: np.ndarray, bb: np.ndarray, lb_enc: np.ndarray, lb_bb: np.ndarray) -> np.ndarray:
    """Per step (rows of (steps, dp) loads) max over ranks of max(enc / lb_enc, bb / lb_bb) (a part whose LB
    is 0 does not count)."""
    ie = np.where(lb_enc > 0, 1.0 / np.where(lb_enc > 0, lb_enc, 1.0), 0.0)
    ib = np.where(lb_bb > 0, 1.0 / np.where(lb_bb > 0, lb_bb, 1.0), 0.0)
    return np.maximum(enc * ie[:, None], bb * ib[:, None]).max(axis=1)


def _spaced(members: np.ndarray, step: np.ndarray, n_steps: int, cap: int | np.ndarray) -> np.ndarray:
    """Members of each step (sorted by step) in a padded (n_steps, width) grid (-1 = none), at most `cap`
    (one for all, or one per step) evenly spaced ones per step."""
    count = np.bincount(step, minlength=n_steps)
    first = np.zeros(n_steps + 1, dtype=np.int64)
    np.cumsum(count, out=first[1:])
    at = np.arange(len(members)) - first[step]
    stride = np.maximum(1, -(-count // cap))
    keep = at % stride[step] == 0
    members, step, at = members[keep], step[keep], at[keep] // stride[step[keep]]
    n = np.bincount(step, minlength=n_steps)
    grid = np.full((n_steps, int(n.max(initial=0))), -1, dtype=np.int64)
    grid[step, at] = members
    return grid


def _units(obj: np.ndarray, e_n: np.ndarray, b_n: np.ndarray, dp: int) -> tuple[np.ndarray, ...]:
    """The round's units: (row of the step, heavy rank h, partner ranks (n, P), -1 = none).

    A step with U > 1 ranks over the tolerance gets min(U, dp // (HYBRID_MULTI_PARTNERS + 1)) units on
    disjoint ranks: unit k is its k-th rank of largest objective with HYBRID_MULTI_PARTNERS of every n_u-th
    rank from its k-th least loaded on; a step of one unit pairs h with all other ranks (small dp) or with
    the least loaded ranks by the objective and by h's binding part."""
    na = len(obj)
    by = obj.argsort(axis=1, kind="stable")
    over = (obj > 1 + HYBRID_TOLERANCE).sum(axis=1)
    most = dp // (HYBRID_MULTI_PARTNERS + 1) if dp > HYBRID_PARTNERS + 1 else 1  # units share no rank
    n_u = np.clip(np.minimum(over, most), 1, None)
    u_row = np.repeat(np.arange(na), n_u)
    k = np.arange(len(u_row)) - np.repeat(np.cumsum(n_u) - n_u, n_u)
    h = by[u_row, dp - 1 - k]
    if dp <= HYBRID_PARTNERS + 1:  # then one unit per step
        part = np.broadcast_to(np.arange(dp), (len(h), dp)).copy()
        part[part == h[:, None]] = -1
        return u_row, h, part
    p = n_u[u_row][:, None]
    jj = np.arange(HYBRID_PARTNERS)[None, :]
    idx = k[:, None] + jj * p
    part = by[u_row[:, None], np.minimum(idx, dp - 1)]
    part[(idx >= dp - p) | ((jj >= HYBRID_MULTI_PARTNERS) & (p > 1))] = -1
    lone = n_u[u_row] == 1
    if lone.any():  # the least loaded by the objective, and by h's binding part
        r, hl = u_row[lone], h[lone]
        binds = e_n[r, hl] >= b_n[r, hl]
        half = HYBRID_PARTNERS // 2
        by_part = np.where(binds[:, None], e_n[r], b_n[r]).argsort(axis=1, kind="stable")
        part[lone] = np.concatenate([by[r, :half], by_part[:, : HYBRID_PARTNERS - half]], axis=1)
    part[part == h[:, None]] = -1
    width = int((part >= 0).sum(axis=1).max(initial=1))
    if width < part.shape[1]:  # only steps of several units: their partners come first
        part = part[:, :width]
    return u_row, h, part


def _by_unit(unit: np.ndarray, n_units: int) -> np.ndarray:
    """A stable order of `unit` (small non-negative ints): NumPy's radix sort when they fit in 16 bits."""
    return np.argsort(unit.astype(np.uint16) if n_units <= 1 << 16 else unit, kind="stable")


def _top(members: np.ndarray, unit: np.ndarray, n_units: int, cap: np.ndarray) -> np.ndarray:
    """The first `cap[u]` members of each unit u (members sorted by unit, best first) in a padded grid (-1 = none)."""
    count = np.bincount(unit, minlength=n_units)
    first = np.zeros(n_units + 1, dtype=np.int64)
    np.cumsum(count, out=first[1:])
    at = np.arange(len(members)) - first[unit]
    keep = at < cap[unit]
    grid = np.full((n_units, int(np.minimum(cap, count).max(initial=0))), -1, dtype=np.int64)
    grid[unit[keep], at[keep]] = members[keep]
    return grid


def hybrid_search(
    dealt: Sequence[Dealt], costs: Sequence[np.ndarray], encs: Sequence[np.ndarray], lanes_of: Sequence[np.ndarray]
) -> None:
    """Lower every step's hybrid objective (module docstring) by moves and swaps, updating `dealt` in place.

    `costs[i]` and `encs[i]` are step i's items' summed cost and encoder part (backbone = cost - encoder);
    slot and rank costs stay summed costs (what the report and serving read).
    """
    if not dealt:
        return
    dp = dealt[0].st.cost.shape[0]
    if dp < 2:
        return
    n_steps = len(dealt)
    ns = np.array([len(d.length) for d in dealt], dtype=np.int64)
    off = np.zeros(n_steps + 1, dtype=np.int64)
    np.cumsum(ns, out=off[1:])
    g_cost = np.concatenate([*costs, np.zeros(1)])
    g_enc = np.concatenate([*encs, np.zeros(1)])
    g_bb = g_cost - g_enc
    g_len = np.concatenate([d.length for d in dealt] + [np.zeros(1, dtype=np.int64)])
    p_rank = np.concatenate([d.p_rank for d in dealt])
    p_mb = np.concatenate([d.p_mb for d in dealt])
    step_of = np.repeat(np.arange(n_steps), ns)
    placed = p_rank >= 0
    movable = placed & np.concatenate([lane != 1 for lane in lanes_of])
    cost3 = np.stack([d.st.cost for d in dealt])
    room3 = np.stack([d.st.room for d in dealt])
    lane3 = np.stack([d.st.lane for d in dealt])
    rc = np.stack([d.st.rank_cost for d in dealt])
    n_keys = n_steps * dp
    slot_key = np.where(placed, step_of * dp + np.maximum(p_rank, 0), n_keys)
    enc = np.bincount(slot_key, weights=g_enc[:-1], minlength=n_keys + 1)[:n_keys].reshape(n_steps, dp)
    bb = rc - enc  # split pieces (text) and long sequences are in rank_cost: backbone
    top_e = _step_max(g_enc[:-1][placed], step_of[placed], n_steps)
    top_b = _step_max(g_bb[:-1][placed], step_of[placed], n_steps)
    lb_e = np.maximum(enc.sum(axis=1) / dp, top_e)
    lb_b = np.maximum(bb.sum(axis=1) / dp, top_b)
    ie = np.where(lb_e > 0, 1.0 / np.where(lb_e > 0, lb_e, 1.0), 0.0)
    ib = np.where(lb_b > 0, 1.0 / np.where(lb_b > 0, lb_b, 1.0), 0.0)
    key = np.where(movable, step_of * dp + np.maximum(p_rank, 0), n_keys)
    dummy = len(g_cost) - 1
    st = _State(dp, g_cost, g_enc, g_len, cost3, room3, rc, enc, p_rank, p_mb, key)
    act = np.flatnonzero(lb_e > 0)  # steps without encoder load have nothing to rebalance
    best_max = np.full(n_steps, np.inf)  # each step's objective at its last real gain
    stall = np.zeros(n_steps, dtype=np.int64)  # rounds since then
    for _ in range(HYBRID_ROUNDS):
        if len(act) == 0:
            break
        e_n, b_n = enc[act] * ie[act, None], bb[act] * ib[act, None]
        obj = np.maximum(e_n, b_n)
        step_max = obj.max(axis=1)
        gained = step_max < best_max[act] * (1 - HYBRID_MIN_GAIN)
        best_max[act[gained]] = step_max[gained]
        stall[act] = np.where(gained, 0, stall[act] + 1)
        go = (step_max > 1 + HYBRID_TOLERANCE) & (stall[act] <= HYBRID_STALL)
        act, e_n, b_n, obj = act[go], e_n[go], b_n[go], obj[go]
        if len(act) == 0:
            break
        u_row, h, part = _units(obj, e_n, b_n, dp)
        us = act[u_row]  # the step of each unit
        nu = len(us)
        rows = np.arange(nu)
        top = obj[u_row, h]
        e_n, b_n = e_n[u_row], b_n[u_row]
        enc_binds = e_n[rows, h] >= b_n[rows, h]
        # h's candidates, the most of its binding part first
        unit_of = np.full(n_keys + 1, -1, dtype=np.int64)
        unit_of[us * dp + h] = rows
        ia = np.flatnonzero(unit_of[key] >= 0)
        if len(ia) == 0:
            break
        ua = unit_of[key[ia]]
        val = np.where(enc_binds[ua], g_enc[ia], g_bb[ia])
        o = np.argsort(-val, kind="stable")
        o = o[_by_unit(ua[o], nu)]  # by unit, then the most of h's binding part first
        lone = (np.bincount(u_row, minlength=len(act)) == 1)[u_row]
        a = _top(ia[o], ua[o], nu, np.where(lone, HYBRID_A, HYBRID_MULTI_A))
        a_ok = a >= 0
        a_i = np.where(a_ok, a, dummy)
        ea, ba, la = g_enc[a_i], g_bb[a_i], g_len[a_i]
        ma = np.where(a_ok, p_mb[np.maximum(a, 0)], 0)
        room_a = room3[us[:, None], h[:, None], ma]
        eh, bh = enc[us, h], bb[us, h]
        s_ie, s_ib = ie[us], ib[us]
        # moves: a to a partner's roomiest short micro-batch
        p_ok = part >= 0
        p_r = np.maximum(part, 0)
        room_p = np.where(lane3[us[:, None], p_r] == 0, room3[us[:, None], p_r], -1)  # (na, P, mb)
        best_mb = room_p.argmax(axis=2)
        rmax = np.where(p_ok, np.take_along_axis(room_p, best_mb[:, :, None], axis=2)[:, :, 0], -1)
        oh = np.maximum((eh[:, None] - ea) * s_ie[:, None], (bh[:, None] - ba) * s_ib[:, None])  # (na, A)
        ep, bp = enc[us[:, None], p_r], bb[us[:, None], p_r]  # (na, P)
        op = np.maximum(
            (ep[:, None, :] + ea[:, :, None]) * s_ie[:, None, None],
            (bp[:, None, :] + ba[:, :, None]) * s_ib[:, None, None],
        )
        s_move = np.maximum(oh[:, :, None], op)
        s_move = np.where(a_ok[:, :, None] & (la[:, :, None] <= rmax[:, None, :]), s_move, np.inf).reshape(nu, -1)
        bm = s_move.argmin(axis=1)
        vm = s_move[rows, bm]
        # swaps: a for a segment b of a partner
        pu = np.full(n_keys + 1, -1, dtype=np.int64)
        pk = (us[:, None] * dp + p_r)[p_ok]
        pu[pk] = np.broadcast_to(rows[:, None], part.shape)[p_ok]
        ib_ = np.flatnonzero(pu[key] >= 0)
        ub = pu[key[ib_]]
        o = _by_unit(ub, nu)
        b = _spaced(ib_[o], ub[o], nu, np.where(lone, HYBRID_B, HYBRID_MULTI_B))
        if b.shape[1]:
            b_ok = b >= 0
            b_i = np.where(b_ok, b, dummy)
            eb, bbb, lbn = g_enc[b_i], g_bb[b_i], g_len[b_i]
            rb = np.where(b_ok, p_rank[np.maximum(b, 0)], 0)
            mbb = np.where(b_ok, p_mb[np.maximum(b, 0)], 0)
            room_b = room3[us[:, None], rb, mbb]
            de = ea[:, :, None] - eb[:, None, :]
            db = ba[:, :, None] - bbb[:, None, :]
            oh2 = np.maximum(
                (eh[:, None, None] - de) * s_ie[:, None, None], (bh[:, None, None] - db) * s_ib[:, None, None]
            )
            er, br = enc[us[:, None], rb], bb[us[:, None], rb]
            ob2 = np.maximum((er[:, None, :] + de) * s_ie[:, None, None], (br[:, None, :] + db) * s_ib[:, None, None])
            ok = a_ok[:, :, None] & b_ok[:, None, :]
            ok &= (la[:, :, None] <= (room_b + lbn)[:, None, :]) & (lbn[:, None, :] <= (room_a + la)[:, :, None])
            s_swap = np.where(ok, np.maximum(oh2, ob2), np.inf).reshape(nu, -1)
            bs = s_swap.argmin(axis=1)
            vs = s_swap[rows, bs]
        else:
            vs = np.full(nu, np.inf)
            bs = np.zeros(nu, dtype=np.int64)
        gain = top * (1 - 1e-9)
        take_move = (vm <= vs) & (vm < gain)
        take_swap = (vs < vm) & (vs < gain)
        r = np.flatnonzero(take_move)
        i, q = np.divmod(bm[r], part.shape[1])
        s_ = us[r]
        _move(st, a[r, i], s_, h[r], ma[r, i], p_r[r, q], best_mb[r, q])
        r = np.flatnonzero(take_swap)
        if len(r):
            i, j = np.divmod(bs[r], b.shape[1])
            s_, bi = us[r], b[r, j]
            rbj, mbj = rb[r, j], mbb[r, j]
            _move(st, a[r, i], s_, h[r], ma[r, i], rbj, mbj)
            _move(st, bi, s_, rbj, mbj, h[r], ma[r, i])
        done = take_move | take_swap
        # exchanges (only where no move or swap helps): a for the j lightest segments of one partner slot
        r = np.flatnonzero(~done)
        if len(r):
            xa = slice(0, HYBRID_EXCHANGE_A)
            ex = _exchanges(st, us[r], part[r], a[r, xa], ie[us[r]], ib[us[r]], h[r], ma[r, xa])
            g = np.flatnonzero(ex.score < gain[r])
            rg = r[g]
            _move(st, a[rg, ex.i[g]], us[rg], h[rg], ma[rg, ex.i[g]], ex.rank[g], ex.mb[g])
            for col in ex.members[g].T:
                ok = col >= 0
                _move(st, col[ok], us[rg][ok], ex.rank[g][ok], ex.mb[g][ok], h[rg][ok], ma[rg, ex.i[g]][ok])
            done[rg] = True
        bb = rc - enc
        act = members(us[done], n_steps)
    for k, d in enumerate(dealt):
        d.st.cost[...] = cost3[k]
        d.st.room[...] = room3[k]
        d.st.rank_cost[...] = rc[k]
        d.p_rank[...] = p_rank[off[k] : off[k + 1]]
        d.p_mb[...] = p_mb[off[k] : off[k + 1]]


@dataclass(frozen=True, slots=True)
class _Exchange:
    """The best exchange of each unit: h's candidate i for the members of partner slot (rank, mb)."""

    score: np.ndarray  # (n,) the pair's objective after it (inf: none)
    i: np.ndarray  # (n,) column of h's candidate
    rank: np.ndarray  # (n,) partner rank
    mb: np.ndarray  # (n,) partner micro-batch
    members: np.ndarray  # (n, HYBRID_EXCHANGE_MAX) the partner slot's segments that go to h (-1: none)


def _exchanges(
    w: _State,
    u_step: np.ndarray,
    partners: np.ndarray,
    a: np.ndarray,
    ie: np.ndarray,
    ib: np.ndarray,
    h: np.ndarray,
    ma: np.ndarray,
) -> _Exchange:
    """For units (step, heavy rank h, partners, h's candidates a), score trading a for the j = 2..J lightest
    segments (by encoder part, then backbone) of each partner slot and return each unit's best."""
    dp, jmax = w.dp, HYBRID_EXCHANGE_MAX
    n, n_p = partners.shape
    mb = w.cost3.shape[2]
    n_slots = n * n_p * mb
    p_r = np.maximum(partners, 0)
    slot_key = ((u_step[:, None] * dp + p_r)[:, :, None] * mb + np.arange(mb)).reshape(n, n_p * mb)
    valid = np.repeat(partners >= 0, mb, axis=1)
    lut = np.full(w.cost3.shape[0] * dp * mb + 1, -1, dtype=np.int64)
    lut[slot_key[valid]] = np.arange(n_slots).reshape(n, n_p * mb)[valid]
    movable = w.key < w.cost3.shape[0] * dp
    pos = lut[np.where(movable, w.key * mb + np.maximum(w.p_mb, 0), len(lut) - 1)]
    sel = np.flatnonzero(pos >= 0)
    sid = pos[sel]
    g_bb = w.g_cost - w.g_enc
    o = np.lexsort((g_bb[sel], w.g_enc[sel], sid))
    sel, sid = sel[o], sid[o]
    cnt = np.bincount(sid, minlength=n_slots)
    first = np.zeros(n_slots + 1, dtype=np.int64)
    np.cumsum(cnt, out=first[1:])
    at = np.arange(len(sel)) - first[sid]
    keep = at < jmax
    ce, cb, cl = np.zeros((n_slots, jmax)), np.zeros((n_slots, jmax)), np.zeros((n_slots, jmax), dtype=np.int64)
    ce[sid[keep], at[keep]] = w.g_enc[sel[keep]]
    cb[sid[keep], at[keep]] = g_bb[sel[keep]]
    cl[sid[keep], at[keep]] = w.g_len[sel[keep]]
    have = np.arange(2, jmax + 1)[None, :] <= cnt[:, None]
    se = np.cumsum(ce, axis=1)[:, 1:].reshape(n, n_p * mb, jmax - 1)
    sb = np.cumsum(cb, axis=1)[:, 1:].reshape(n, n_p * mb, jmax - 1)
    sl = np.cumsum(cl, axis=1)[:, 1:].reshape(n, n_p * mb, jmax - 1)
    have = have.reshape(n, n_p * mb, jmax - 1)
    s_rank = np.repeat(p_r, mb, axis=1)
    s_mb = np.tile(np.arange(mb), (n, n_p))
    rows = np.arange(n)[:, None]
    room_s = w.room3[u_step[:, None], s_rank, s_mb]  # (n, S)
    er, br = w.enc[u_step[:, None], s_rank], (w.rc - w.enc)[u_step[:, None], s_rank]
    a_ok = a >= 0
    a_i = np.where(a_ok, a, len(w.g_cost) - 1)
    ea, ba, la = w.g_enc[a_i], g_bb[a_i], w.g_len[a_i]
    room_a = w.room3[u_step[:, None], h[:, None], ma]
    eh, bh = w.enc[u_step, h], (w.rc - w.enc)[u_step, h]
    de = ea[:, :, None, None] - se[:, None]  # (n, A, S, J)
    db = ba[:, :, None, None] - sb[:, None]
    x_ie, x_ib = ie[:, None, None, None], ib[:, None, None, None]
    oh = np.maximum((eh[:, None, None, None] - de) * x_ie, (bh[:, None, None, None] - db) * x_ib)
    op = np.maximum((er[:, None, :, None] + de) * x_ie, (br[:, None, :, None] + db) * x_ib)
    ok = a_ok[:, :, None, None] & have[:, None]
    ok &= la[:, :, None, None] <= (room_s[:, :, None] + sl)[:, None]
    ok &= sl[:, None] <= (room_a + la)[:, :, None, None]
    score = np.where(ok, np.maximum(oh, op), np.inf).reshape(n, -1)
    best = score.argmin(axis=1) if score.shape[1] else np.zeros(n, dtype=np.int64)
    val = score[rows[:, 0], best] if score.shape[1] else np.full(n, np.inf)
    i, rest = np.divmod(best, n_p * mb * (jmax - 1))
    e, j = np.divmod(rest, jmax - 1)
    sidx = rows[:, 0] * n_p * mb + e
    t = np.arange(jmax)[None, :]
    idx = np.minimum(first[sidx][:, None] + t, max(len(sel) - 1, 0))
    members = np.where(t < (j + 2)[:, None], sel[idx] if len(sel) else -1, -1)
    return _Exchange(val, i, s_rank[rows[:, 0], e], s_mb[rows[:, 0], e], members)


@dataclass(frozen=True, slots=True)
class _State:
    """The block's flattened search state (arrays updated in place by _move)."""

    dp: int
    g_cost: np.ndarray  # item summed cost (dummy 0 at the end)
    g_enc: np.ndarray  # item encoder part
    g_len: np.ndarray
    cost3: np.ndarray  # (steps, dp, mb) slot summed cost
    room3: np.ndarray
    rc: np.ndarray  # (steps, dp) rank summed cost
    enc: np.ndarray  # (steps, dp) rank encoder load
    p_rank: np.ndarray
    p_mb: np.ndarray
    key: np.ndarray  # step * dp + rank of movable items


def _move(
    w: _State, item: np.ndarray, s: np.ndarray, r0: np.ndarray, m0: np.ndarray, r1: np.ndarray, m1: np.ndarray
) -> None:
    """Move items (at most one per step) from slot (s, r0, m0) to (s, r1, m1)."""
    c, e, ln = w.g_cost[item], w.g_enc[item], w.g_len[item]
    w.cost3[s, r0, m0] -= c
    w.room3[s, r0, m0] += ln
    w.rc[s, r0] -= c
    w.enc[s, r0] -= e
    w.cost3[s, r1, m1] += c
    w.room3[s, r1, m1] -= ln
    w.rc[s, r1] += c
    w.enc[s, r1] += e
    w.p_rank[item], w.p_mb[item] = r1, m1
    w.key[item] = s * w.dp + r1
