"""Balance a block of consecutive steps: LPT rounds of all steps at once, leftovers step by step, local search.

Per step the phases are LPT rounds (_deal) -> leftovers (_leftovers) -> local search (_refine, _wide). What a
step defers (image samples no slot could take, text the step had no room left for) goes first into the
next step: the first step of a block takes the previous block's carry in its dealing, and a block ends at
the first step that defers (rare: the next block starts with its carry; a step's result depends only on
its segments and its carry, never on its block). A block is laid out flat (balance_span: one array per
column, a step's items contiguous) and comes back as a BalancedBlock, so no phase but the leftovers does
Python work per step. A step's deferrals depend only on its rounds and leftovers, never on its local search, so
the local search of the whole block runs last, at once; with `cost.balance: both` the hybrid
encoder/backbone search (_hybrid) follows it, from the summed-cost placement. (The baselines a plan is compared with are
computed per step by planning._baselines, over each step's own segments.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from loomdata.planning._baselines import baselines_flat, baselines_many
from loomdata.planning._cost import segment_cost, segment_parts
from loomdata.planning._packing import Lanes
from loomdata.planning._report import PartFigures
from loomdata.planning._segments import Segments
from loomdata.planning.balance._deal import FlatDeal, deal_flat, deal_many
from loomdata.planning.balance._hybrid import hybrid_search
from loomdata.planning.balance._leftovers import place_leftovers
from loomdata.planning.balance._leftovers_kernel import text_leftovers
from loomdata.planning.balance._placed_kernel import placed_rows
from loomdata.planning.balance._refine import refine_flat, refine_many
from loomdata.planning.balance._state import Assignment, Dealt, members
from loomdata.schemas.errors import PlanError
from loomdata.schemas.spec import CostBalance, CostSpec

__all__ = ["BalanceConfig", "BalancedBlock", "BalancedStep", "balance_block", "balance_span", "balance_step"]

_NO_EXTRA: tuple[np.ndarray, ...] = (*(np.zeros(0, dtype=np.int64) for _ in range(5)), np.zeros((0, 3), np.int64))
_NO_PIECES = np.zeros((0, 6), dtype=np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class BalanceConfig:
    """What the balancer needs of the spec: the step's shape, the lanes, the cost model and the seed."""

    dp: int
    micro_batches: int
    lanes: Lanes
    cost_spec: CostSpec
    seed: int

    def cost_of(self, segs: Segments) -> np.ndarray:
        """Costs of these segments (as the step's items are costed)."""
        return segment_cost(segs.length, segs.image_tokens, self.cost_spec, self.lanes.cp_sizes(segs.lane))


@dataclass(frozen=True, slots=True)
class BalancedStep:
    """One balanced step: its segments (carried-in first) and costs, where they go, and what it defers."""

    segs: Segments
    cost: np.ndarray
    asg: Assignment
    in_step: np.ndarray | None  # bool per segment: False when wholly deferred; None when all are in the step
    carry: Segments | None  # what the step defers (goes first into the next step)
    concat_rank: np.ndarray  # [dp] per-rank time of the concat-and-chunk baseline (planning._baselines)
    packed_rank: np.ndarray  # [dp] per-rank time of the packed baseline
    packed_waiting: int  # tokens the packed baseline could not fit
    parts: PartFigures | None = None  # encoder and backbone apart (cost models with an encoder term)


@dataclass(frozen=True, slots=True)
class BalancedBlock:
    """Consecutive balanced steps as columns: their segments one step after the other (`off`), the placed
    pieces of every step in manifest order (`row_step`: the piece's step within the block), each step's slot
    and baseline figures. Only the last step of a block defers (`carry`): balance_span ends a block there."""

    steps: range
    segs: Segments  # every step's segments (carried-in first in the first step)
    cost: np.ndarray
    off: np.ndarray  # (steps + 1) where each step's segments start
    in_step: np.ndarray | None  # bool per segment: False when wholly deferred; None when all are in their step
    carry: Segments | None  # what the last step defers (goes first into the next step)
    deferred: np.ndarray  # int64 [n, 3] the last step's deferred (item within the step, offset delta, tokens)
    row_step: np.ndarray  # int64 per placed piece: its step within the block (rows by step, slot, placement)
    item: np.ndarray  # int64 per piece: its segment (index into segs)
    delta: np.ndarray  # int64 tokens into the segment where the piece starts
    length: np.ndarray  # int64 tokens of the piece
    rank: np.ndarray  # int64
    micro_batch: np.ndarray  # int64
    lane: np.ndarray  # uint8
    rank_cost: np.ndarray  # float64 [steps, dp]
    slot_cost: np.ndarray  # float64 [steps, dp, micro_batches]
    concat_rank: np.ndarray  # [steps, dp] per-rank time of the concat-and-chunk baseline
    packed_rank: np.ndarray  # [steps, dp] per-rank time of the packed baseline
    packed_waiting: np.ndarray  # [steps] tokens the packed baseline could not fit
    parts: list[PartFigures] | None = None  # per step, encoder and backbone apart (cost models with an encoder term)

    def step(self, k: int) -> BalancedStep:
        """Step k of the block on its own (what a per-step consumer takes)."""
        a, b = int(self.off[k]), int(self.off[k + 1])
        r0, r1 = np.searchsorted(self.row_step, [k, k + 1])
        last = k == len(self.steps) - 1
        asg = Assignment(
            item=self.item[r0:r1] - a,
            delta=self.delta[r0:r1],
            length=self.length[r0:r1],
            rank=self.rank[r0:r1],
            micro_batch=self.micro_batch[r0:r1],
            lane=self.lane[r0:r1],
            rank_cost=self.rank_cost[k],
            slot_cost=self.slot_cost[k],
            deferred=self.deferred if last else _NO_EXTRA[5],
        )
        m = None if self.in_step is None or self.in_step[a:b].all() else self.in_step[a:b]
        return BalancedStep(
            self.segs.take(slice(a, b)),
            self.cost[a:b],
            asg,
            m,
            self.carry if last else None,
            self.concat_rank[k],
            self.packed_rank[k],
            int(self.packed_waiting[k]),
            None if self.parts is None else self.parts[k],
        )


def balance_block(
    steps: range, drawn: Sequence[tuple[Segments, np.ndarray]], carry: Segments | None, cfg: BalanceConfig
) -> Iterator[BalancedStep]:
    """Balance steps (their drawn segments and costs each); `carry` goes first into the first step. Yields the
    steps in order (balance_span on the drawn segments laid out flat, one step at a time)."""
    drawn = list(drawn)
    if not drawn:
        return
    segs = Segments.concat([s for s, _ in drawn])
    cost = np.concatenate([c for _, c in drawn])
    off = np.zeros(len(drawn) + 1, dtype=np.int64)
    np.cumsum([len(c) for _, c in drawn], out=off[1:])
    i = 0
    while i < len(drawn):
        a, b = int(off[i]), int(off[-1])
        blk = balance_span(range(steps[i], steps[-1] + 1), segs.take(slice(a, b)), cost[a:b], off[i:] - a, carry, cfg)
        for k in range(len(blk.steps)):
            yield blk.step(k)
        carry = blk.carry
        i += len(blk.steps)


def balance_span(
    steps: range, segs: Segments, cost: np.ndarray, off: np.ndarray, carry: Segments | None, cfg: BalanceConfig
) -> BalancedBlock:
    """Balance consecutive steps whose segments and costs lie flat (step i's are off[i]..off[i+1]-1), `carry`
    first into the first step, all at once. The block ends at the first step that defers something (the next
    block takes it first): a step's result depends only on its segments and its carry, never on its block."""
    dp, mb = cfg.dp, cfg.micro_batches
    carried = 0
    if carry is not None:
        segs, cost = _with_carry(carry, (segs, cost), cfg)
        carried = len(carry)
        off = np.concatenate([[0], off[1:] + carried])
    nb = len(off) - 1
    first_carried = [carried] + [0] * (nb - 1) if carried else None
    fd = deal_flat(segs.length, cost, segs.lane, off, dp=dp, micro_batches=mb, lanes=cfg.lanes, carried=first_carried)
    # leftovers (what the LPT rounds could not place), in the few steps that have them: compiled for a block
    # without image samples (_leftovers_kernel), else step by step
    unplaced = np.flatnonzero(fd.p_rank[fd.order] < 0)  # positions in `order` (few): their steps by `cut`
    left_steps = members(np.searchsorted(fd.cut, unplaced, side="right") - 1, nb)
    pieces = _NO_PIECES
    new_carry: Segments | None = None
    in_step: np.ndarray | None = None
    deferred = _NO_EXTRA[5]
    if len(left_steps) and not segs.image_tokens.any():
        pieces, rests, done = text_leftovers(
            fd.cost3,
            fd.room3,
            fd.rank_cost,
            fd.p_rank,
            fd.p_mb,
            fd.length,
            np.ascontiguousarray(cost, dtype=np.float64),
            fd.order,
            fd.cut,
            left_steps,
            float(cfg.cost_spec.attention),
            float(cfg.cost_spec.linear),
            float(cfg.lanes.short_cp),
        )
        pieces[:, 1] -= off[pieces[:, 0]]
        if len(rests):
            i = int(left_steps[done - 1])
            rests[:, 1] -= off[i]
            nb, in_step, new_carry, deferred = _block_end(
                i, np.ascontiguousarray(rests[:, 1:]), segs, off, steps, dp * mb
            )
    else:
        by_step: list[np.ndarray] = []
        for i in left_steps.tolist():
            a, b = int(off[i]), int(off[i + 1])
            extra = _leftovers(fd.view(i), cost[a:b], segs.image_tokens[a:b] == 0, cfg)
            if len(extra[0]):
                by_step.append(np.stack([np.full(len(extra[0]), i, np.int64), *extra[:5]], axis=1))
            if len(extra[5]):  # the block ends here: the next one takes the carry first
                nb, in_step, new_carry, deferred = _block_end(i, extra[5], segs, off, steps, dp * mb)
                break
        if by_step:
            pieces = np.concatenate(by_step)
    n = int(off[nb])
    steps = range(steps.start, steps.start + nb)
    off = off[: nb + 1]
    if n < len(cost):
        segs, cost = segs.take(slice(0, n)), cost[:n]
    length, lane = fd.length[:n], segs.lane
    p_rank, p_mb = fd.p_rank[:n], fd.p_mb[:n]
    cost3, room3, lane3, rc = fd.cost3[:nb], fd.room3[:nb], fd.lane3[:nb], fd.rank_cost[:nb]
    step_of = np.repeat(np.arange(nb), np.diff(off))
    movable = (p_rank >= 0) & (lane != 1)
    g_cost = np.concatenate([cost, np.zeros(1)])
    g_len = np.concatenate([length, np.zeros(1, dtype=np.int64)])
    refine_flat(cost3, room3, lane3, rc, p_rank, p_mb, g_cost, g_len, movable, step_of)
    encs: list[np.ndarray] | None = None
    if cfg.cost_spec.has_encoder:
        enc = _encoder_part(segs, cfg)
        encs = [enc[off[i] : off[i + 1]] for i in range(nb)]
        if cfg.cost_spec.balance is CostBalance.BOTH:
            dealt = [fd.view(i) for i in range(nb)]
            costs = [cost[off[i] : off[i + 1]] for i in range(nb)]
            hybrid_search(dealt, costs, encs, [lane[off[i] : off[i + 1]] for i in range(nb)])
    own_len, own_img, own_n = segs.length, segs.image_tokens, np.diff(off)
    if in_step is not None:
        own_len, own_img = own_len[in_step], own_img[in_step]
        own_n = np.bincount(step_of[in_step], minlength=nb)
    concat, packed, waiting = baselines_flat(
        steps,
        own_len,
        own_img,
        own_n,
        seed=cfg.seed,
        seq_len=cfg.lanes.seq_len,
        dp=dp,
        micro_batches=mb,
        cost_spec=cfg.cost_spec,
        cp=cfg.lanes.short_cp,
    )
    parts = None
    if encs is not None:
        own_off = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(own_n, out=own_off[1:])
        own = [(own_len[own_off[i] : own_off[i + 1]], own_img[own_off[i] : own_off[i + 1]]) for i in range(nb)]
        costs = [cost[off[i] : off[i + 1]] for i in range(nb)]
        masks = [None if in_step is None or i < nb - 1 else in_step[off[i] : off[i + 1]] for i in range(nb)]
        dealt = [fd.view(i) for i in range(nb)]
        parts = _part_figures(steps, own, costs, dealt, encs, masks, cfg)
    rows = _placed(fd, nb, pieces, off, mb)
    return BalancedBlock(
        steps=steps,
        segs=segs,
        cost=cost,
        off=off,
        in_step=in_step,
        carry=new_carry,
        deferred=deferred,
        row_step=rows[0],
        item=rows[1],
        delta=rows[2],
        length=rows[3],
        rank=rows[4],
        micro_batch=rows[5],
        lane=np.take(lane3.reshape(-1), (rows[0] * dp + rows[4]) * mb + rows[5]),  # lane3[step, rank, mb], flat
        rank_cost=rc,
        slot_cost=cost3,
        concat_rank=concat,
        packed_rank=packed,
        packed_waiting=waiting,
        parts=parts,
    )


def _placed(fd: FlatDeal, nb: int, pieces: np.ndarray, off: np.ndarray, mb: int) -> tuple[np.ndarray, ...]:
    """The block's placed pieces in manifest order (step, slot, then placement order: long items, LPT order,
    split pieces (`pieces`: int64 (step, item within the step, delta, length, rank, micro-batch) rows, by step
    then placement)): (step, item, delta, length, rank, micro-batch), by one compiled counting sort
    (_placed_kernel.placed_rows)."""
    return placed_rows(
        fd.long_idx[: fd.long_cut[nb]],
        fd.order[: fd.cut[nb]],
        fd.p_rank,
        fd.p_mb,
        fd.length,
        np.ascontiguousarray(off, dtype=np.int64),
        pieces,
        nb,
        fd.cost3.shape[1],
        mb,
    )


def _encoder_part(segs: Segments, cfg: BalanceConfig) -> np.ndarray:
    """The encoder part of each segment's cost (as the step's items are costed)."""
    return segment_parts(segs.length, segs.image_tokens, cfg.cost_spec, cfg.lanes.cp_sizes(segs.lane))[1]


def _part_figures(
    steps: range,
    own: Sequence[tuple[np.ndarray, np.ndarray]],
    costs: Sequence[np.ndarray],
    dealt: Sequence[Dealt],
    encs: Sequence[np.ndarray],
    in_steps: Sequence[np.ndarray | None],
    cfg: BalanceConfig,
) -> list[PartFigures]:
    """Each step's encoder and backbone loads per rank (loomdata and both baselines) and each part's LB."""
    kw = {
        "seed": cfg.seed,
        "seq_len": cfg.lanes.seq_len,
        "dp": cfg.dp,
        "micro_batches": cfg.micro_batches,
        "cost_spec": cfg.cost_spec,
        "cp": cfg.lanes.short_cp,
    }
    c_enc, p_enc, _ = baselines_many(steps, own, part="encoder", **kw)  # type: ignore[arg-type]
    c_bb, p_bb, _ = baselines_many(steps, own, part="backbone", **kw)  # type: ignore[arg-type]
    out = []
    for k, (cost, d, enc, m) in enumerate(zip(costs, dealt, encs, in_steps, strict=True)):
        placed = d.p_rank >= 0
        loom_enc = np.bincount(d.p_rank[placed], weights=enc[placed], minlength=cfg.dp)
        e, b = (enc, cost - enc) if m is None else (enc[m], (cost - enc)[m])
        out.append(
            PartFigures(
                balance=cfg.cost_spec.balance.value,
                lb_enc=max(float(e.sum()) / cfg.dp, float(e.max(initial=0.0))),
                lb_bb=max(float(b.sum()) / cfg.dp, float(b.max(initial=0.0))),
                loom_enc=loom_enc,
                loom_bb=d.st.rank_cost - loom_enc,
                concat_enc=c_enc[k],
                concat_bb=c_bb[k],
                packed_enc=p_enc[k],
                packed_bb=p_bb[k],
            )
        )
    return out


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
    """Assign one step's segments (length, cost, lane, splittable) to dp x micro_batches slots: the block
    code on a block of one step. The first `carried` items came from the step before and are placed first.
    It balances the summed cost (`cost.balance: both` needs the segments' image tokens: balance_block)."""
    cfg = BalanceConfig(dp=dp, micro_batches=micro_batches, lanes=lanes, cost_spec=cost_spec, seed=0)
    dealt = deal_many([(length, cost, lane)], dp=dp, micro_batches=micro_batches, lanes=lanes, carried=[carried])
    extra = _leftovers(dealt[0], cost, splittable, cfg)
    refine_many(dealt, [cost], range(1), [lane])
    return _assignment(dealt[0], extra, micro_batches)


def _with_carry(carry: Segments, drawn: tuple[Segments, np.ndarray], cfg: BalanceConfig) -> tuple[Segments, np.ndarray]:
    segs, cost = drawn
    return Segments.concat([carry, segs]), np.concatenate([cfg.cost_of(carry), cost])


def _leftovers(d: Dealt, cost: np.ndarray, splittable: np.ndarray, cfg: BalanceConfig) -> tuple[np.ndarray, ...]:
    """Place what the LPT rounds could not (split pieces and deferred items); nothing to do in most steps."""
    left = d.order[d.p_rank[d.order] < 0]
    if len(left) == 0:
        return _NO_EXTRA
    return place_leftovers(left, d.length, cost, splittable, d.st, d.p_rank, d.p_mb, cfg.lanes, cfg.cost_spec)


def _deferred(segs: Segments, deferred: np.ndarray) -> tuple[Segments | None, np.ndarray | None]:
    """The carry into the next step (the deferred rests of segments) and which segments stay in this step."""
    if len(deferred) == 0:
        return None, None
    d, delta, rest = deferred.T
    carry = Segments(
        segs.source[d],
        segs.sample[d],
        (segs.offset[d] + delta).astype(np.uint32),
        rest,
        segs.lane[d],
        segs.image_tokens[d],
    )
    in_step = np.ones(len(segs), dtype=bool)
    in_step[d[delta == 0]] = False  # wholly deferred: not part of this step (for LB and the baseline)
    return carry, None if in_step.all() else in_step


def _block_end(
    i: int, rests: np.ndarray, segs: Segments, off: np.ndarray, steps: range, slots: int
) -> tuple[int, np.ndarray | None, Segments, np.ndarray]:
    """The block ends at step i, which deferred `rests` (int64 (item within the step, offset delta, tokens)):
    (steps in the block, in_step over the block's segments or None, the carry, the deferred rows)."""
    a, b = int(off[i]), int(off[i + 1])
    new_carry, m = _deferred(segs.take(slice(a, b)), rests)
    if new_carry is None:
        raise ValueError(f"step {steps[i]} ends a block but deferred nothing")
    if len(new_carry) > slots:
        raise PlanError(_no_room(steps[i], new_carry, slots))
    in_step = None
    if m is not None:
        in_step = np.ones(b, dtype=bool)
        in_step[a:b] = m
    return i + 1, in_step, new_carry, rests


def _no_room(step: int, carry: Segments, slots: int) -> str:
    """Why step `step` cannot hand its `carry` on (more deferred segments than the next step has sequences): image
    samples (never split) the mixture holds too many of, or text the step was given more of than its sequences take."""
    images = int((carry.image_tokens > 0).sum())
    if images == len(carry):
        return (
            f"step {step}: {len(carry)} samples with images found no room and wait for the next step, "
            f"more than it has sequences ({slots}): the mixture holds more image samples than sequences can "
            "take; raise micro_batches or seq_len, or lower the image sources' weights"
        )
    tokens = int(carry.length.sum())
    with_images = (
        "; with image samples among them, raising micro_batches or seq_len or lowering the image sources' weights "
        "helps too"
        if images
        else ""
    )
    return (
        f"step {step}: {len(carry)} segments ({tokens} tokens, {images} of them samples with images) found no room "
        f"and wait for the next step, more than it has sequences ({slots}): the step was given more tokens than its "
        "sequences take (membership or the look-ahead overfilled it); lower planning.fill, or set planning.lookahead "
        f"to 0, and report the spec and index as a planner issue{with_images}"
    )


def _assignment(d: Dealt, extra: tuple[np.ndarray, ...], micro_batches: int) -> Assignment:
    """The step's placed pieces in manifest order: by slot, then placement order (long items, LPT order,
    split pieces)."""
    st, p_rank, p_mb, length = d.st, d.p_rank, d.p_mb, d.length
    placed = np.concatenate([d.long_idx, d.order]) if len(d.long_idx) else d.order
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
    dp = st.cost.shape[0]
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
