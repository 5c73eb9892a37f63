"""Test oracle: the planner's per-step balancer as it was before the block code became the only one.

Copied from loomdata.planning._balance (`balance_step` with `_lpt_rounds`, leftovers and `_refine`) and
_baseline (`baseline_sequences`) at 00541df, with the switch to the block code removed, plus the
per-step chain of _plan._plan_step (carry in, balance, defer, baseline). tests/unit/planning/
test_balance_oracle.py checks that loomdata.planning.balance (the block code, which adds the wide local
search of balance._wide after these phases) gives the same segments, costs, deferrals and carry, and a
most loaded rank no costlier than this code's. Keep it as it is: it is the reference, not code to improve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loomdata.planning._cost import segment_cost
from loomdata.planning._packing import Lanes, next_fit
from loomdata.schemas.errors import PlanError
from loomdata.schemas.spec import CostSpec

__all__ = ["OracleStep", "balance_chain", "balance_step", "baseline_sequences"]

_BASELINE_SALT = 0xBA5E


def _perm(t: int, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, _BASELINE_SALT, t]).permutation(n)


def baseline_sequences(t: int, seed: int, length: np.ndarray, lane: np.ndarray, lanes: Lanes) -> np.ndarray:
    """Baseline sequence id of every segment: shuffled, next-fit per lane, sequences in stream order."""
    n = len(length)
    perm = _perm(t, seed, n)
    seq_local = np.zeros(n, dtype=np.int64)
    firsts = []
    lp = lane[perm]
    offset = 0
    for ln in (0, 1):
        pos = np.flatnonzero(lp == ln)
        if len(pos) == 0:
            continue
        cap = lanes.seq_len if ln == 0 else int(lanes.long_seq_len or 0)
        ids = next_fit(length[perm[pos]], cap)
        seq_local[pos] = ids + offset
        firsts.append(pos[np.flatnonzero(np.diff(ids, prepend=-1))])  # where each sequence starts
        offset += int(ids[-1]) + 1
    first = np.concatenate(firsts)
    rank_of_seq = np.empty(len(first), dtype=np.int64)
    rank_of_seq[np.argsort(first, kind="stable")] = np.arange(len(first))
    out = np.empty(n, dtype=np.int64)
    out[perm] = rank_of_seq[seq_local]
    return out


_SWAP_ROUNDS = 16
_TOLERANCE = 1e-3  # stop refining once the most and least loaded ranks differ by less than this fraction
_MAX_CANDIDATES = 512  # segments per rank considered by one refinement round
_FALLBACK_PASSES = 3  # vectorised passes for segments whose rank was full, before going one by one


def _subsample(idx: np.ndarray) -> np.ndarray:
    """At most _MAX_CANDIDATES evenly spaced entries of `idx` (bounds the pairwise swap search)."""
    if len(idx) <= _MAX_CANDIDATES:
        return idx
    return idx[:: -(-len(idx) // _MAX_CANDIDATES)]


@dataclass(frozen=True, slots=True)
class Assignment:
    """Placed pieces of a step's items, in manifest order (rank, micro-batch, placement order)."""

    item: np.ndarray  # int64 index into the step's items
    delta: np.ndarray  # int64 tokens into the item where the piece starts (0 unless split)
    length: np.ndarray  # int64 tokens of the piece
    rank: np.ndarray  # int64
    micro_batch: np.ndarray  # int64
    lane: np.ndarray  # uint8
    rank_cost: np.ndarray  # float64 [dp]
    slot_cost: np.ndarray  # float64 [dp, micro_batches]
    # int64 [n, 3] (item, offset delta, tokens) the step had no room for; the next step takes them first
    deferred: np.ndarray


@dataclass(slots=True)
class _Slots:
    """Mutable per-step slot state (private to one balance_step call)."""

    cost: np.ndarray  # [dp, mb]
    room: np.ndarray  # [dp, mb] free tokens (0 for long slots)
    lane: np.ndarray  # [dp, mb]
    rank_cost: np.ndarray  # [dp]


@dataclass(slots=True)
class Dealt:
    """A step after long-lane placement and the LPT rounds: slot state, placements and the dealing order."""

    st: _Slots
    p_rank: np.ndarray  # int64 rank of each item, -1 while unplaced
    p_mb: np.ndarray  # int64 micro-batch of each item, -1 while unplaced
    order: np.ndarray  # short items in dealing order
    long_idx: np.ndarray  # long-lane items
    length: np.ndarray  # int64


def prepare_step(
    length: np.ndarray,
    cost: np.ndarray,
    lane: np.ndarray,
    *,
    dp: int,
    micro_batches: int,
    lanes: Lanes,
    carried: int = 0,
) -> Dealt:
    """Empty slots, long-lane sequences placed, the short items' order."""
    length = length.astype(np.int64)
    n = len(length)
    st = _Slots(
        cost=np.zeros((dp, micro_batches)),
        room=np.full((dp, micro_batches), lanes.seq_len, dtype=np.int64),
        lane=np.zeros((dp, micro_batches), dtype=np.uint8),
        rank_cost=np.zeros(dp),
    )
    p_rank = np.full(n, -1, dtype=np.int64)
    p_mb = np.full(n, -1, dtype=np.int64)
    is_long = lane == 1
    long_idx = is_long.nonzero()[0]
    if len(long_idx):
        _place_long(long_idx, length, cost, st, p_rank, p_mb, lanes, float(cost.sum()))
    short = (~is_long).nonzero()[0]
    # items carried over from the previous step go first (into empty slots), then all others largest first
    order = short[np.lexsort((-cost[short], short >= carried))]
    return Dealt(st, p_rank, p_mb, order, long_idx, length)


def balance_step(
    length: np.ndarray,
    cost: np.ndarray,
    lane: np.ndarray,
    splittable: np.ndarray,
    *,
    dp: int,
    micro_batches: int,
    lanes: Lanes,
    cost_spec: CostSpec,
    carried: int = 0,
) -> Assignment:
    """Assign a step's segments (length, cost, lane, splittable) to dp x micro_batches slots.

    The first `carried` items were deferred by the previous step; they are placed first.
    """
    dealt = prepare_step(length, cost, lane, dp=dp, micro_batches=micro_batches, lanes=lanes, carried=carried)
    _lpt_rounds(dealt.order, dealt.length, cost, dealt.st, dealt.p_rank, dealt.p_mb)
    st, p_rank, p_mb, order, long_idx, length = (
        dealt.st,
        dealt.p_rank,
        dealt.p_mb,
        dealt.order,
        dealt.long_idx,
        dealt.length,
    )
    is_long = lane == 1
    extra = _place_leftovers(order[p_rank[order] < 0], length, cost, splittable, st, p_rank, p_mb, lanes, cost_spec)
    _refine(length, cost, st, p_rank, p_mb, is_long)

    # manifest order: by slot, then placement order (long items, LPT order, split pieces)
    placed = np.concatenate([long_idx, order]) if len(long_idx) else order
    placed = placed[p_rank[placed] >= 0]
    if len(extra[0]):
        item = np.concatenate([placed, extra[0]])
        delta = np.concatenate([np.zeros(len(placed), dtype=np.int64), extra[1]])
        plen = np.concatenate([length[placed], extra[2]])
        rank = np.concatenate([p_rank[placed], extra[3]])
        mb = np.concatenate([p_mb[placed], extra[4]])
    else:  # no split pieces (the common case): the same arrays without concatenating
        item, delta = placed, np.zeros(len(placed), dtype=np.int64)
        plen, rank, mb = length[placed], p_rank[placed], p_mb[placed]
    slot = rank * micro_batches + mb
    o = np.argsort(slot.astype(np.uint16 if dp * micro_batches <= 1 << 16 else np.int64), kind="stable")
    return Assignment(
        item=item[o],
        delta=delta[o],
        length=plen[o],
        rank=rank[o],
        micro_batch=mb[o],
        lane=st.lane[rank[o], mb[o]],
        rank_cost=st.rank_cost,
        slot_cost=st.cost,
        deferred=extra[5],
    )


def _place_long(
    idx: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    st: _Slots,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    lanes: Lanes,
    total_cost: float,
) -> None:
    """Pack long-lane segments into long sequences (next-fit decreasing) and give each sequence a whole
    free slot: in rounds, the largest sequences to the least loaded ranks that still have a free slot."""
    cap = int(lanes.long_seq_len or 0)
    by_len = np.argsort(-length[idx], kind="stable")
    bins = np.empty(len(idx), dtype=np.int64)
    bins[by_len] = next_fit(length[idx][by_len], cap)
    dp, mb = st.cost.shape
    # a long sequence heavier than half a rank's fair share is unpacked: one document per sequence
    # (membership left a slot for every long segment, and padding costs nothing)
    heavy_cap = max(total_cost / dp / 2, float(cost[idx].max()))
    heavy = np.bincount(bins, weights=cost[idx])[bins] > heavy_cap
    if heavy.any():
        bins[heavy] = bins.max() + 1 + np.arange(int(heavy.sum()))
        _, bins = np.unique(bins, return_inverse=True)
    n_bins = int(bins.max()) + 1
    bin_cost = np.bincount(bins, weights=cost[idx], minlength=n_bins)
    if n_bins > dp * mb:
        raise PlanError(f"a step needs {n_bins} long sequences but has only {dp * mb} slots; raise micro_batches")
    bin_rank = np.empty(n_bins, dtype=np.int64)
    bin_mb = np.empty(n_bins, dtype=np.int64)
    todo = np.argsort(-bin_cost, kind="stable")
    while len(todo):
        free = (st.lane == 0) & (st.room == lanes.seq_len)
        open_ranks = np.flatnonzero(free.any(axis=1))
        ranks = open_ranks[np.argsort(st.rank_cost[open_ranks], kind="stable")][: len(todo)]
        now, todo = todo[: len(ranks)], todo[len(ranks) :]
        m = free[ranks].argmax(axis=1)
        st.lane[ranks, m] = 1
        st.room[ranks, m] = 0
        st.cost[ranks, m] += bin_cost[now]
        st.rank_cost[ranks] += bin_cost[now]
        bin_rank[now] = ranks
        bin_mb[now] = m
    p_rank[idx] = bin_rank[bins]
    p_mb[idx] = bin_mb[bins]


def _lpt_rounds(
    order: np.ndarray, length: np.ndarray, cost: np.ndarray, st: _Slots, p_rank: np.ndarray, p_mb: np.ndarray
) -> None:
    """Deal `order` (largest first) in rounds: the i-th largest to the i-th least loaded rank, least loaded slot.

    A round serves only the ranks LPT would serve before giving the least loaded rank a second item:
    those whose load is within the round's largest cost of the minimum. So ranks made heavy by long
    sequences (or by a big segment) sit out rounds until the others catch up, as in sequential LPT,
    while rounds stay dp wide when loads are even.
    """
    # per-round work is a handful of NumPy calls on dp-sized arrays: ndarray methods, no wrappers
    n = len(order)
    dp = len(st.rank_cost)
    o_cost = cost[order]  # costs and lengths in dealing order, gathered once
    o_len = length[order]
    pos = 0
    while pos < n:
        ranks = st.rank_cost.argsort(kind="stable")
        loads = st.rank_cost[ranks]
        k = min(dp, n - pos, max(1, int(loads.searchsorted(loads[0] + o_cost[pos], side="right"))))
        idx = order[pos : pos + k]
        ln = o_len[pos : pos + k]
        c = o_cost[pos : pos + k]
        pos += k
        ranks = ranks[:k]
        sc = st.cost[ranks]
        sc[st.room[ranks] < ln[:, None]] = np.inf
        m = sc.argmin(axis=1)
        ok = sc.min(axis=1) < np.inf
        if ok.all():
            _commit(st, idx, ranks, m, ln, c, p_rank, p_mb)
            continue
        _commit(st, idx[ok], ranks[ok], m[ok], ln[ok], c[ok], p_rank, p_mb)
        _place_whole_many(idx[~ok], length, cost, st, p_rank, p_mb)  # their rank was full: others take them


def _commit(
    st: _Slots,
    items: np.ndarray,
    ranks: np.ndarray,
    mbs: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
) -> None:
    """Record placements of `items` (each (rank, micro-batch) pair at most once): costs, room, and where."""
    st.cost[ranks, mbs] += cost
    st.room[ranks, mbs] -= length
    st.rank_cost[ranks] += cost
    p_rank[items] = ranks
    p_mb[items] = mbs


def _place_whole(
    i: int, length: np.ndarray, cost: np.ndarray, st: _Slots, p_rank: np.ndarray, p_mb: np.ndarray
) -> bool:
    """Put item i whole into the least loaded rank that has a slot with room (its least loaded such slot)."""
    need = int(length[i])
    fits = st.room >= need
    has = fits.any(axis=1)
    if not has.any():
        return False
    r = int(np.argmin(np.where(has, st.rank_cost, np.inf)))
    m = int(np.argmin(np.where(fits[r], st.cost[r], np.inf)))
    _commit(st, np.array([i]), np.array([r]), np.array([m]), np.array([need]), cost[[i]], p_rank, p_mb)
    return True


def _place_whole_many(
    items: np.ndarray, length: np.ndarray, cost: np.ndarray, st: _Slots, p_rank: np.ndarray, p_mb: np.ndarray
) -> None:
    """Place items whose rank was full: a few vectorised passes pairing them (largest first) with the least
    loaded ranks that have room, then one by one; items no rank can hold whole stay for the leftover pass."""
    items = items[np.argsort(-cost[items], kind="stable")]
    for _ in range(_FALLBACK_PASSES):
        if len(items) == 0:
            return
        cand = np.flatnonzero(st.room.max(axis=1) >= length[items].min())
        if len(cand) == 0:
            return
        cand = cand[np.argsort(st.rank_cost[cand], kind="stable")][: len(items)]
        head, items = items[: len(cand)], items[len(cand) :]
        ln = length[head]
        sc = np.where(st.room[cand] >= ln[:, None], st.cost[cand], np.inf)
        m = sc.argmin(axis=1)
        ok = sc[np.arange(len(cand)), m] < np.inf
        i, r, m, ln = head[ok], cand[ok], m[ok], ln[ok]
        _commit(st, i, r, m, ln, cost[i], p_rank, p_mb)
        if ok.all() and len(items) == 0:
            return
        items = np.concatenate([head[~ok], items])
        items = items[np.argsort(-cost[items], kind="stable")]
    for i in items:
        _place_whole(int(i), length, cost, st, p_rank, p_mb)


def _evict_for(
    need: int,
    length: np.ndarray,
    cost: np.ndarray,
    splittable: np.ndarray,
    st: _Slots,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
) -> list[int] | None:
    """Make room for an unsplittable item in the roomiest short slot that can free enough by moving text out.

    Returns the text segments moved out (to be placed again), or None when no slot can make room.
    """
    dp, mb = st.room.shape
    movable = (p_rank >= 0) & splittable
    slot_of = p_rank[movable] * mb + p_mb[movable]
    freeable = np.bincount(slot_of, weights=length[movable], minlength=dp * mb).reshape(dp, mb) + st.room
    room = np.where((st.lane == 0) & (freeable >= need), st.room, -1)
    if room.max() < 0:
        return None
    r, m = divmod(int(np.argmax(room)), mb)
    members = np.flatnonzero((p_rank == r) & (p_mb == m) & splittable)
    members = members[np.argsort(-length[members], kind="stable")]
    freed = int(st.room[r, m]) + np.cumsum(length[members])
    k = int(np.searchsorted(freed, need)) + 1
    out = members[:k]
    st.cost[r, m] -= cost[out].sum()
    st.rank_cost[r] -= cost[out].sum()
    st.room[r, m] += int(length[out].sum())
    p_rank[out] = -1
    p_mb[out] = -1
    return [int(x) for x in out]


def _place_leftovers(
    left: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    splittable: np.ndarray,
    st: _Slots,
    p_rank: np.ndarray,
    p_mb: np.ndarray,
    lanes: Lanes,
    cost_spec: CostSpec,
) -> tuple[np.ndarray, ...]:
    """Place segments no slot could take whole when their turn came: whole if room appeared, else split.

    An image sample is never split: text segments are moved out of a slot to make room for it and
    placed again (whole, or split over the slots with most room); when no slot can make room (every
    slot already full of image samples) it is deferred to the next step, as is text for which the step
    has no room left at all (possible only after the previous step deferred some). Returns the split
    pieces (item, offset delta, length, rank, micro-batch) and the deferred (item, offset delta, length).
    """
    pieces: list[tuple[int, int, int, int, int]] = []
    deferred: list[tuple[int, int, int]] = []
    mb = st.cost.shape[1]
    queue = [int(i) for i in left[np.argsort(splittable[left], kind="stable")]]  # image samples first
    while queue:
        i = queue.pop(0)
        if _place_whole(i, length, cost, st, p_rank, p_mb):
            continue
        need = int(length[i])
        if not splittable[i]:
            moved = _evict_for(need, length, cost, splittable, st, p_rank, p_mb)
            if moved is None:
                deferred.append((i, 0, need))
            else:
                queue.extend(moved)
                _place_whole(i, length, cost, st, p_rank, p_mb)
            continue
        flat = np.argsort(-st.room.ravel(), kind="stable")
        done = 0
        for s in flat:
            r, m = divmod(int(s), mb)
            take = min(int(st.room[r, m]), need - done)
            if take <= 0:
                break
            c = float(segment_cost(np.array([take]), None, cost_spec, lanes.short_cp)[0])
            st.cost[r, m] += c
            st.room[r, m] -= take
            st.rank_cost[r] += c
            pieces.append((i, done, take, r, m))
            done += take
            if done == need:
                break
        if done < need:
            deferred.append((i, done, need - done))
    a = np.array(pieces, dtype=np.int64).reshape(-1, 5)
    return a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], np.array(deferred, dtype=np.int64).reshape(-1, 3)


def _refine(
    length: np.ndarray, cost: np.ndarray, st: _Slots, p_rank: np.ndarray, p_mb: np.ndarray, is_long: np.ndarray
) -> None:
    """Local search: move or swap one short segment between the most and least loaded ranks while max drops."""
    dp = st.cost.shape[0]
    if dp < 2:
        return
    movable = (p_rank >= 0) & ~is_long
    rc = st.rank_cost
    for _ in range(_SWAP_ROUNDS):
        hi = int(rc.argmax())
        lo = int(rc.argmin())
        gap = rc[hi] - rc[lo]
        if gap <= _TOLERANCE * rc[hi]:
            return
        a = _subsample((movable & (p_rank == hi)).nonzero()[0])
        b = _subsample((movable & (p_rank == lo)).nonzero()[0])
        if len(a) == 0:
            return
        # Candidate: move item a to lo (delta = c_a), or swap a with b (delta = c_a - c_b). Best delta is gap/2.
        ca = cost[a]
        cb = np.concatenate([[0.0], cost[b]])
        la = length[a]
        lb = np.concatenate([[0], length[b]])
        delta = ca[:, None] - cb[None, :]
        # capacity: a goes into lo's slot of b (or lo's roomiest slot for a pure move), b into a's slot
        ma = p_mb[a]
        mb_b = np.concatenate([[int(np.where(st.lane[lo] == 0, st.room[lo], -1).argmax())], p_mb[b]])
        room_lo = st.room[lo, mb_b] + lb
        room_hi = st.room[hi, ma] + la
        ok = (delta > 0) & (delta < gap) & (la[:, None] <= room_lo[None, :]) & (lb[None, :] <= room_hi[:, None])
        ok &= st.lane[lo, mb_b][None, :] == 0
        if not ok.any():
            return
        score = np.where(ok, np.abs(delta - gap / 2), np.inf)
        i, j = divmod(int(score.argmin()), score.shape[1])
        ia, ma_i, mbj = int(a[i]), int(ma[i]), int(mb_b[j])
        st.cost[hi, ma_i] -= ca[i]
        st.room[hi, ma_i] += la[i]
        st.cost[lo, mbj] += ca[i]
        st.room[lo, mbj] -= la[i]
        p_rank[ia], p_mb[ia] = lo, mbj
        if j > 0:
            ib = int(b[j - 1])
            st.cost[lo, mbj] -= cb[j]
            st.room[lo, mbj] += lb[j]
            st.cost[hi, ma_i] += cb[j]
            st.room[hi, ma_i] -= lb[j]
            p_rank[ib], p_mb[ib] = hi, ma_i
        st.rank_cost[hi] -= delta[i, j]
        st.rank_cost[lo] += delta[i, j]


@dataclass(frozen=True, slots=True)
class OracleStep:
    """One step as the per-step planner balanced it: its segment columns (carried-in first), costs, the
    assignment, the in-step mask, the carry into the next step and the baseline's sequences."""

    cols: tuple[np.ndarray, ...]  # (source, sample, offset, length, lane, image tokens)
    cost: np.ndarray
    asg: Assignment
    in_step: np.ndarray
    carry: tuple[np.ndarray, ...] | None
    base_seq: np.ndarray


def balance_chain(
    first_step: int,
    steps: Sequence[tuple[tuple[np.ndarray, ...], np.ndarray]],
    carry: tuple[np.ndarray, ...] | None,
    *,
    dp: int,
    micro_batches: int,
    lanes: Lanes,
    cost_spec: CostSpec,
    seed: int,
) -> list[OracleStep]:
    """Balance consecutive steps (their segment columns and costs) one by one as _plan._plan_step did."""
    out = []
    for i, (drawn, cost) in enumerate(steps):
        t = first_step + i
        if carry is not None:
            drawn = tuple(np.concatenate([c, d]) for c, d in zip(carry, drawn, strict=True))
            c_cost = segment_cost(carry[3], carry[5], cost_spec, lanes.cp(carry[4]))
            cost = np.concatenate([c_cost, cost])
        src_id, sample, offset, length, lane, img = drawn
        asg = balance_step(
            length,
            cost,
            lane,
            img == 0,
            dp=dp,
            micro_batches=micro_batches,
            lanes=lanes,
            cost_spec=cost_spec,
            carried=0 if carry is None else len(carry[0]),
        )
        next_carry = None
        in_step = np.ones(len(length), dtype=bool)
        if len(asg.deferred):
            d, delta, rest = asg.deferred.T
            next_carry = (src_id[d], sample[d], (offset[d] + delta).astype(np.uint32), rest, lane[d], img[d])
            in_step[d[delta == 0]] = False
        base_seq = baseline_sequences(t, seed, length[in_step], lane[in_step], lanes)
        out.append(OracleStep(drawn, cost, asg, in_step, next_carry, base_seq))
        if next_carry is not None and len(next_carry[0]) > dp * micro_batches:
            raise PlanError(f"step {t}: {len(next_carry[0])} samples with images found no room")
        carry = next_carry
    return out
