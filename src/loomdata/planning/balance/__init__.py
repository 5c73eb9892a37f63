"""Cost-balanced assignment of steps' segments to (dp_rank, micro_batch) slots, packing as it goes.

Every step has dp_size x micro_batches slots; a slot holds one packed sequence. Lanes share a step by
slots: long-lane segments are first packed next-fit-decreasing into long sequences (capacity
long_context.seq_len), and each long sequence takes one whole free slot, least loaded rank first (its
Batch has lane 1 and long_context.seq_len tokens, split over long_context.cp_size context-parallel
ranks, so it weighs cost / cp on its dp rank); all other slots are short-lane sequences of capacity
seq_len. Membership guarantees the short tokens fit the slots left over (see _mixture).

One implementation, run a block of consecutive steps at a time (_block; a block may be one step):
- _deal: a vectorised LPT that packs while it balances (segments largest first, dealt in rounds to
  the least loaded ranks, into each rank's least loaded micro-batch with room); items carried in from
  the step before go first;
- _leftovers: what fits nowhere whole when its turn came is placed whole if room appeared, else text
  is split over the slots with most room; an image sample is never split (text is moved out to make
  room, or it is deferred to the next step);
- _refine: a local search moves or swaps one segment between the most and the least loaded ranks
  while that lowers the maximum (bounded rounds);
- _wide: then a wider local search: the most loaded ranks (several disjoint units per round at large
  dp) move a segment to any partner rank with room, swap one, or trade it for several cheap segments of
  one partner micro-batch, until the step is within 0.1% of its lower bound or nothing improves;
- _hybrid (`cost.balance: both` only): from that placement, moves, swaps and exchanges that lower the
  larger of the encoder and backbone maxima, each over its own lower bound (never raising it);
The lower bound is LB = max(total cost / dp_size, largest segment cost).

Cost: O(segments/dp) rounds of O(dp log dp) work per step. The dealing order and the LPT rounds
(_deal_kernel), the pairwise and the wide local search (_refine_kernel, _wide_kernel), a text-only block's
leftovers (_leftovers_kernel: every leftover step of the block in one call) and the placed pieces' manifest order
(_placed_kernel) are compiled numba kernels run step after step over the block's flat arrays (the same decisions
as the NumPy code they replaced); the long lane, the hybrid search and the leftovers of blocks holding image
samples stay NumPy/Python.
"""

from loomdata.planning.balance._block import (
    BalanceConfig,
    BalancedBlock,
    BalancedStep,
    balance_block,
    balance_span,
    balance_step,
)
from loomdata.planning.balance._state import Assignment

__all__ = [
    "Assignment",
    "BalanceConfig",
    "BalancedBlock",
    "BalancedStep",
    "balance_block",
    "balance_span",
    "balance_step",
]
