"""Balance a block of consecutive steps: LPT rounds of all steps at once, leftovers step by step, local search.

Per step the phases are LPT rounds (_deal) -> leftovers (_leftovers) -> local search (_refine, _wide). What a
step defers (image samples no slot could take, text the step had no room left for) goes first into the
next step: the first step of a block takes the previous block's carry in its dealing; a later step of
the block that receives a carry is dealt again as a block of one step with it (rare), before its
leftovers. A step's deferrals depend only on its rounds and leftovers, never on its local search, so
the local search of the whole block runs last, at once; with `cost.balance: both` the hybrid
encoder/backbone search (_hybrid) follows it, from the summed-cost placement. (The baselines a plan is compared with are
computed per step by planning._baselines, over each step's own segments.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from loomdata.planning._baselines import baselines_many
from loomdata.planning._cost import segment_cost, segment_parts
from loomdata.planning._packing import Lanes
from loomdata.planning._report import PartFigures
from loomdata.planning._segments import Segments
from loomdata.planning.balance._deal import deal_many
from loomdata.planning.balance._hybrid import hybrid_search
from loomdata.planning.balance._leftovers import place_leftovers
from loomdata.planning.balance._refine import refine_many
from loomdata.planning.balance._state import Assignment, Dealt
from loomdata.schemas.errors import PlanError
from loomdata.schemas.spec import CostBalance, CostSpec

__all__ = ["BalanceConfig", "BalancedStep", "balance_block", "balance_step"]

_NO_EXTRA: tuple[np.ndarray, ...] = (*(np.zeros(0, dtype=np.int64) for _ in range(5)), np.zeros((0, 3), np.int64))


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
        return segment_cost(segs.length, segs.image_tokens, self.cost_spec, self.lanes.cp(segs.lane))


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


def balance_block(
    steps: range, drawn: Sequence[tuple[Segments, np.ndarray]], carry: Segments | None, cfg: BalanceConfig
) -> Iterator[BalancedStep]:
    """Balance steps (their drawn segments and costs each); `carry` goes first into the first step. Yields the
    steps in order, each step's placements made when it is taken (so one step's rows are alive at a time)."""
    inputs = list(drawn)
    carried = [0] * len(inputs)
    if carry is not None:
        inputs[0], carried[0] = _with_carry(carry, inputs[0], cfg), len(carry)
    dealt = _deal([(s, c) for s, c in inputs], carried, cfg)
    extras = []
    carries: list[Segments | None] = []
    in_steps: list[np.ndarray | None] = []
    for i, t in enumerate(steps):
        if i > 0 and carry is not None:  # a carry from the step before: deal this step again with it first
            inputs[i] = _with_carry(carry, inputs[i], cfg)
            dealt[i] = _deal([inputs[i]], [len(carry)], cfg)[0]
        segs, cost = inputs[i]
        extra = _leftovers(dealt[i], cost, segs.image_tokens == 0, cfg)
        carry, in_step = _deferred(segs, extra[5])
        if carry is not None and len(carry) > cfg.dp * cfg.micro_batches:
            raise PlanError(
                f"step {t}: {len(carry)} samples with images found no room and wait for the next step, more "
                f"than it has sequences ({cfg.dp * cfg.micro_batches}): the mixture holds more image samples "
                "than sequences can take; raise micro_batches or seq_len, or lower the image sources' weights"
            )
        extras.append(extra)
        carries.append(carry)
        in_steps.append(in_step)
    refine_many(dealt, [c for _, c in inputs], range(len(inputs)), [s.lane for s, _ in inputs])
    encs = [_encoder_part(s, cfg) for s, _ in inputs] if cfg.cost_spec.has_encoder else None
    if encs is not None and cfg.cost_spec.balance is CostBalance.BOTH:
        hybrid_search(dealt, [c for _, c in inputs], encs, [s.lane for s, _ in inputs])
    own = [
        (s.length, s.image_tokens) if m is None else (s.length[m], s.image_tokens[m])
        for (s, _), m in zip(inputs, in_steps, strict=True)
    ]
    concat, packed, waiting = baselines_many(
        steps,
        own,
        seed=cfg.seed,
        seq_len=cfg.lanes.seq_len,
        dp=cfg.dp,
        micro_batches=cfg.micro_batches,
        cost_spec=cfg.cost_spec,
        cp=cfg.lanes.short_cp,
    )
    parts = None if encs is None else _part_figures(steps, own, inputs, dealt, encs, in_steps, cfg)
    for k, ((s, c), d, e, m, nxt) in enumerate(zip(inputs, dealt, extras, in_steps, carries, strict=True)):
        asg = _assignment(d, e, cfg.micro_batches)
        p = None if parts is None else parts[k]
        yield BalancedStep(s, c, asg, m, nxt, concat[k], packed[k], int(waiting[k]), p)


def _encoder_part(segs: Segments, cfg: BalanceConfig) -> np.ndarray:
    """The encoder part of each segment's cost (as the step's items are costed)."""
    return segment_parts(segs.length, segs.image_tokens, cfg.cost_spec, cfg.lanes.cp(segs.lane))[1]


def _part_figures(
    steps: range,
    own: Sequence[tuple[np.ndarray, np.ndarray]],
    inputs: Sequence[tuple[Segments, np.ndarray]],
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
    for k, ((_, cost), d, enc, m) in enumerate(zip(inputs, dealt, encs, in_steps, strict=True)):
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


def _deal(inputs: Sequence[tuple[Segments, np.ndarray]], carried: list[int], cfg: BalanceConfig) -> list[Dealt]:
    return deal_many(
        [(s.length, c, s.lane) for s, c in inputs],
        dp=cfg.dp,
        micro_batches=cfg.micro_batches,
        lanes=cfg.lanes,
        carried=carried,
    )


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
