"""The balancer's wide local search: after the pairwise rounds (_refine), look past the lightest rank.

A round works on units: a step's most loaded rank h with its partner ranks (all other ranks at small
dp; at large dp the WIDE_PARTNERS least and next most loaded, or, when many ranks are over the
threshold, several units per step on disjoint ranks, so that a round fixes many ranks at once). A unit
moves one of h's short segments a to a partner's roomiest micro-batch, swaps it for one segment b of a
partner, or (only where neither helps) trades it for the j <= EXCHANGE_MAX cheapest segments of one
partner micro-batch: one long document for several short ones, where the lightest rank is full. It
takes the candidate that leaves the pair (h, partner) with the smallest maximum, if that is below h's
load (a move that brings h under the threshold is taken without looking at swaps), so a step's maximum
never rises. A step stops when its maximum is within WIDE_TOLERANCE of its lower bound
max(total / dp, largest segment) (then within 0.1% of its optimum), when no unit improves, when
WIDE_STALL rounds lowered its maximum by less than WIDE_MIN_GAIN, or after WIDE_ROUNDS rounds. All
units of a block run a round together, in padded (units, |a|, |b|) grids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning.balance._state import members

__all__ = ["WideState", "wide_search"]

WIDE_ROUNDS = 24
WIDE_TOLERANCE = 1e-3  # a step within this fraction of its lower bound is done (then within 0.1% of its optimum)
WIDE_MIN_GAIN = 2e-5  # a round lowering a step's maximum by less than this fraction is no real gain
WIDE_STALL = 4  # a step stops after this many rounds without a real gain
WIDE_PARTNERS = 4  # partner ranks at each end of the load order for a lone unit (all ranks at dp <= 2x this + 1)
WIDE_CANDIDATES = 16  # segments of the most loaded rank considered per round
PARTNER_CANDIDATES = 64  # segments of the partner ranks considered per round (swaps)
MULTI_PARTNERS = 2  # partner ranks of each unit when a step runs several units in a round
MULTI_CANDIDATES = 16  # segments of those partners considered per round (swaps)
EXCHANGE_MAX = 6  # at most this many cheapest segments of one partner micro-batch for one of h's


@dataclass(slots=True)
class WideState:
    """A block's flattened search state, shared with _refine (views, updated in place)."""

    cost3: np.ndarray  # (steps, dp, mb) slot cost
    room3: np.ndarray  # (steps, dp, mb) free tokens (0 in long slots)
    rc: np.ndarray  # (steps, dp) rank cost
    p_rank: np.ndarray  # rank of every item of the block (-1: unplaced)
    p_mb: np.ndarray
    key: np.ndarray  # step * dp + rank of every movable item, steps * dp for the others
    g_cost: np.ndarray  # item costs, plus a dummy 0 at the end
    g_len: np.ndarray  # item lengths, plus a dummy 0 at the end
    step_of: np.ndarray  # step of every item
    lb: np.ndarray  # (steps,) lower bound


def _grid(members: np.ndarray, step: np.ndarray, n_steps: int, cap: int | np.ndarray) -> np.ndarray:
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


@dataclass(frozen=True, slots=True)
class _Exchanges:
    """Every partner slot's j cheapest movable segments (j = 2..EXCHANGE_MAX) of one round."""

    cost: np.ndarray  # (na, S, J) summed cost (inf where the slot has fewer than j)
    length: np.ndarray  # (na, S, J) summed length
    rank: np.ndarray  # (na, S) the slot's rank
    mb: np.ndarray  # (na, S) the slot's micro-batch
    sel: np.ndarray  # the slots' members, by slot then cost
    first: np.ndarray  # where each slot's members start in sel (slot = row * S + s)

    def members(self, rows: np.ndarray, e: np.ndarray, j: np.ndarray) -> np.ndarray:
        """(n, EXCHANGE_MAX) the j cheapest members of slot e of each given row (-1 past j)."""
        sid = rows * self.rank.shape[1] + e
        t = np.arange(EXCHANGE_MAX)[None, :]
        at = np.minimum(self.first[sid][:, None] + t, max(len(self.sel) - 1, 0))
        return np.where(t < j[:, None], self.sel[at], -1)


def _exchanges(w: WideState, u_step: np.ndarray, partners: np.ndarray, dp: int) -> _Exchanges:
    """For every partner slot (step, rank, micro-batch) of every unit, the j cheapest movable segments' summed
    cost and length, j = 2..EXCHANGE_MAX (partners -1: none)."""
    nu, n_p = partners.shape
    mb = w.cost3.shape[2]
    jmax = EXCHANGE_MAX
    n_slots = nu * n_p * mb
    slot_key = (u_step[:, None] * dp + partners)[:, :, None] * mb + np.arange(mb)  # (nu, P, mb)
    lut = np.full(w.cost3.shape[0] * dp * mb + 1, -1, dtype=np.int64)
    valid_p = np.broadcast_to((partners >= 0)[:, :, None], slot_key.shape).ravel()
    lut[slot_key.ravel()[valid_p]] = np.arange(n_slots)[valid_p]
    movable = w.key < w.cost3.shape[0] * dp
    pos = lut[np.where(movable, w.key * mb + np.maximum(w.p_mb, 0), len(lut) - 1)]
    sel = np.flatnonzero(pos >= 0)
    sid = pos[sel]
    order = np.lexsort((w.g_cost[sel], sid))
    sel, sid = sel[order], sid[order]
    cnt = np.bincount(sid, minlength=n_slots)
    first = np.zeros(n_slots + 1, dtype=np.int64)
    np.cumsum(cnt, out=first[1:])
    rank_in = np.arange(len(sel)) - first[sid]
    keep = rank_in < jmax
    cc = np.zeros((n_slots, jmax))
    ll = np.zeros((n_slots, jmax), dtype=np.int64)
    cc[sid[keep], rank_in[keep]] = w.g_cost[sel[keep]]
    ll[sid[keep], rank_in[keep]] = w.g_len[sel[keep]]
    ccum, lcum = np.cumsum(cc, axis=1)[:, 1:], np.cumsum(ll, axis=1)[:, 1:]  # j = 2..jmax
    ccum = np.where(np.arange(2, jmax + 1)[None, :] <= cnt[:, None], ccum, np.inf)
    shape = (nu, n_p * mb, jmax - 1)
    r = np.broadcast_to(partners[:, :, None], (nu, n_p, mb)).reshape(nu, n_p * mb)
    m = np.broadcast_to(np.arange(mb), (nu, n_p, mb)).reshape(nu, n_p * mb)
    return _Exchanges(ccum.reshape(shape), lcum.reshape(shape), np.maximum(r, 0), m, sel, first)


def _units(load: np.ndarray, over: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The round's units of the active steps: (row of the step, heavy rank, partner ranks (n, Q), -1 = none).

    A step with P ranks over its threshold gets min(P, dp // (WIDE_PARTNERS + 1)) units (at least one):
    unit k is its k-th most loaded rank with MULTI_PARTNERS of every P-th of the other ranks from the k-th
    least loaded on,
    so the units of a step share no rank and all run in the same round. A step of one unit at large dp
    pairs its most loaded rank with the WIDE_PARTNERS least and WIDE_PARTNERS next most loaded ranks."""
    na = len(load)
    by = load.argsort(axis=1, kind="stable")
    n_u = np.clip(np.minimum(over.sum(axis=1), dp // (WIDE_PARTNERS + 1)), 1, None)
    u_row = np.repeat(np.arange(na), n_u)
    k = np.arange(len(u_row)) - np.repeat(np.cumsum(n_u) - n_u, n_u)
    p = n_u[u_row]
    h = by[u_row, dp - 1 - k]
    q = 2 * WIDE_PARTNERS
    jj = np.arange(q)[None, :]
    idx = k[:, None] + jj * p[:, None]
    ok = (idx < (dp - p)[:, None]) & ((jj < MULTI_PARTNERS) | (p == 1)[:, None])
    if dp > q + 1:  # one unit at large dp: the least and the next most loaded ranks
        wide = p == 1
        idx[wide] = np.where(jj < WIDE_PARTNERS, jj, dp - 1 - q + jj)[0]
        ok[wide] = True
    part = np.where(ok, by[u_row[:, None], np.minimum(idx, dp - 1)], -1)
    width = int(ok.sum(axis=1).max(initial=1))
    return u_row, h, part[:, :width]


def wide_search(w: WideState, dp: int) -> None:
    """Run the wide search on every step of the block (see the module docstring), updating `w` in place."""
    n_steps = w.cost3.shape[0]
    if dp < 2 or n_steps == 0:
        return
    n_keys = n_steps * dp
    act = np.arange(n_steps)
    dummy = len(w.g_cost) - 1
    best_max = w.rc.max(axis=1)  # each step's maximum at its last real gain
    stall = np.zeros(n_steps, dtype=np.int64)  # rounds since then
    for _ in range(WIDE_ROUNDS):
        load = w.rc[act]
        top = load.max(axis=1)
        gained = top < best_max[act] * (1 - WIDE_MIN_GAIN)
        best_max[act[gained]] = top[gained]
        stall[act] = np.where(gained, 0, stall[act] + 1)
        thr = w.lb[act] * (1 + WIDE_TOLERANCE)
        go = (top > thr) & (stall[act] <= WIDE_STALL)
        act, load, thr = act[go], load[go], thr[go]
        if len(act) == 0:
            return
        u_row, h, part = _units(load, load > thr[:, None], dp)
        u_step = act[u_row]
        nu = len(u_row)
        units = np.arange(nu)
        lh = load[u_row, h]
        # every item's unit and role (1: on the unit's heavy rank, 2: on one of its partners)
        unit_of = np.full(n_keys + 1, -1, dtype=np.int64)
        role = np.zeros(n_keys + 1, dtype=np.int8)
        unit_of[u_step * dp + h] = units
        role[u_step * dp + h] = 1
        pk = (u_step[:, None] * dp + part)[part >= 0]
        unit_of[pk] = np.broadcast_to(units[:, None], part.shape)[part >= 0]
        role[pk] = 2
        r_item = role[w.key]
        ia = np.flatnonzero(r_item == 1)
        ia = ia[np.argsort(unit_of[w.key[ia]], kind="stable")]
        a = _grid(ia, unit_of[w.key[ia]], nu, WIDE_CANDIDATES)
        if a.shape[1] == 0:
            return
        a_ok = a >= 0
        a_i = np.where(a_ok, a, dummy)
        ca, la = w.g_cost[a_i], w.g_len[a_i]
        ma = np.where(a_ok, w.p_mb[np.maximum(a, 0)], 0)
        room_h = w.room3[u_step[:, None], h[:, None], ma]  # (nu, wa) room of a's slot on h
        # moves: a to a partner's roomiest micro-batch
        p_ok = part >= 0
        p_r = np.maximum(part, 0)
        room = w.room3[u_step[:, None], p_r]  # (nu, Q, mb)
        best_mb = room.argmax(axis=2)
        rmax = np.where(p_ok, np.take_along_axis(room, best_mb[:, :, None], axis=2)[:, :, 0], -1)
        lp = w.rc[u_step[:, None], p_r]
        pair = np.maximum((lh[:, None] - ca)[:, :, None], lp[:, None, :] + ca[:, :, None])  # (nu, wa, Q)
        ok = a_ok[:, :, None] & (la[:, :, None] <= rmax[:, None, :])
        s_move = np.where(ok, pair, np.inf).reshape(nu, -1)
        bm = s_move.argmin(axis=1)
        vm = s_move[units, bm]
        # a move that brings h within the step's threshold is taken as it is; the other units look at swaps
        enough = vm <= thr[u_row]
        r = np.flatnonzero(enough)
        i, q = np.divmod(bm[r], part.shape[1])
        _trade(w, u_step[r], h[r], a[r, i], ma[r, i], part[r, q], best_mb[r, q], np.zeros((len(r), 0), np.int64), dp)
        better = enough.copy()
        sw = np.flatnonzero(~enough)
        if len(sw):  # swaps: a for one segment b of a partner
            in_sw = np.zeros(nu, dtype=bool)
            in_sw[sw] = True
            ib = np.flatnonzero(r_item == 2)
            ib = ib[in_sw[unit_of[w.key[ib]]]]
            ub = unit_of[w.key[ib]]
            o = np.argsort(ub, kind="stable")
            row_of = np.full(nu, -1, dtype=np.int64)
            row_of[sw] = np.arange(len(sw))
            lone = (np.bincount(u_row)[u_row] == 1)[sw]  # a step's only unit (all ranks or more partners)
            b = _grid(ib[o], row_of[ub[o]], len(sw), np.where(lone, PARTNER_CANDIDATES, MULTI_CANDIDATES))
            b_ok = b >= 0
            b_i = np.where(b_ok, b, dummy)
            cb, lbn = w.g_cost[b_i], w.g_len[b_i]
            rb = np.where(b_ok, w.p_rank[np.maximum(b, 0)], 0)
            mbb = np.where(b_ok, w.p_mb[np.maximum(b, 0)], 0)
            us = u_step[sw][:, None]
            lrb = w.rc[us, rb]
            room_b = w.room3[us, rb, mbb]
            ca_, la_ = ca[sw], la[sw]
            d = ca_[:, :, None] - cb[:, None, :]
            pair = np.maximum(lh[sw][:, None, None] - d, lrb[:, None, :] + d)
            ok = (d > 0) & a_ok[sw][:, :, None] & b_ok[:, None, :]
            ok &= (la_[:, :, None] <= (room_b + lbn)[:, None, :]) & (lbn[:, None, :] <= (room_h[sw] + la_)[:, :, None])
            s_swap = np.where(ok, pair, np.inf).reshape(len(sw), -1)
            bs = s_swap.argmin(axis=1) if s_swap.shape[1] else np.zeros(len(sw), dtype=np.int64)
            vs = s_swap[np.arange(len(sw)), bs] if s_swap.shape[1] else np.full(len(sw), np.inf)
            take_move = (vm[sw] <= vs) & (vm[sw] < lh[sw] * (1 - 1e-12))
            take_swap = (vs < vm[sw]) & (vs < lh[sw] * (1 - 1e-12))
            r = sw[take_move]
            i, q = np.divmod(bm[r], part.shape[1])
            _trade(
                w, u_step[r], h[r], a[r, i], ma[r, i], part[r, q], best_mb[r, q], np.zeros((len(r), 0), np.int64), dp
            )
            k = np.flatnonzero(take_swap)
            r = sw[k]
            i, jb = np.divmod(bs[k], b.shape[1])
            _trade(w, u_step[r], h[r], a[r, i], ma[r, i], rb[k, jb], mbb[k, jb], b[k, jb][:, None], dp)
            better[sw] = take_move | take_swap
        done = better
        # exchanges (only where no move or swap helps): a for the j cheapest segments of one partner micro-batch
        r = np.flatnonzero(~better)
        if len(r):
            ex = _exchanges(w, u_step[r], part[r], dp)
            ec, el, er, em = ex.cost, ex.length, ex.rank, ex.mb
            us = u_step[r][:, None]
            ler = w.rc[us, er]  # (n, S)
            room_e = w.room3[us, er, em]
            ca_, la_, rh_ = ca[r], la[r], room_h[r]
            d = ca_[:, :, None, None] - ec[:, None, :, :]  # (n, wa, S, J)
            pair = np.maximum(lh[r][:, None, None, None] - d, ler[:, None, :, None] + d)
            ok = (d > 0) & a_ok[r][:, :, None, None] & np.isfinite(ec)[:, None, :, :]
            ok &= la_[:, :, None, None] <= (room_e[:, :, None] + el)[:, None, :, :]
            ok &= el[:, None, :, :] <= (rh_ + la_)[:, :, None, None]
            s_ex = np.where(ok, pair, np.inf).reshape(len(r), -1)
            best = s_ex.argmin(axis=1)
            good = s_ex[np.arange(len(r)), best] < lh[r] * (1 - 1e-12)
            g = np.flatnonzero(good)
            i, rest = np.divmod(best[g], ec.shape[1] * ec.shape[2])
            e, jx = np.divmod(rest, ec.shape[2])
            rg = r[g]
            _trade(w, u_step[rg], h[rg], a[rg, i], ma[rg, i], er[g, e], em[g, e], ex.members(g, e, jx + 2), dp)
            done = done.copy()
            done[rg] = True
        if not done.any():
            return
        act = members(u_step[done], n_steps)


def _trade(
    w: WideState,
    s: np.ndarray,
    h: np.ndarray,
    a: np.ndarray,
    ma: np.ndarray,
    r: np.ndarray,
    m: np.ndarray,
    back: np.ndarray,
    dp: int,
) -> None:
    """Per unit: move segment a from slot (h, ma) to (r, m) and the segments `back` (n, k; -1: none) the
    other way (units share no rank, so all go at once)."""
    _move(w, a, s, h, ma, r, m, dp)
    for bi in back.T:
        ok = bi >= 0
        _move(w, bi[ok], s[ok], r[ok], m[ok], h[ok], ma[ok], dp)


def _move(
    w: WideState,
    item: np.ndarray,
    s: np.ndarray,
    r0: np.ndarray,
    m0: np.ndarray,
    r1: np.ndarray,
    m1: np.ndarray,
    dp: int,
) -> None:
    """Move items (one per step) from slot (s, r0, m0) to (s, r1, m1)."""
    c, ln = w.g_cost[item], w.g_len[item]
    w.cost3[s, r0, m0] -= c
    w.room3[s, r0, m0] += ln
    w.rc[s, r0] -= c
    w.cost3[s, r1, m1] += c
    w.room3[s, r1, m1] -= ln
    w.rc[s, r1] += c
    w.p_rank[item], w.p_mb[item] = r1, m1
    w.key[item] = s * dp + r1
