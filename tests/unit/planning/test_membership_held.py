"""Membership's held pass (_mixture_kernel.held_membership: steps whose weights are all the held last row, worked
out without a (steps x sources) block) gives exactly the pointers of the chunked nearest-and-repair pass and of the
reference per-step loop, for a fixed mixture and a schedule that holds from a milestone on, across chunks."""

from __future__ import annotations

import numpy as np
import pytest
from tests.unit.planning.test_membership_repair import _case, _reference

from loomdata.planning import _mixture
from loomdata.planning._mixture import CumulativeTargets, StepWeights, membership
from loomdata.planning._packing import Lanes


def _weights(w: np.ndarray, steps: int, milestone: int | None) -> StepWeights:
    """A fixed mixture (milestone None) or one moving from uniform at step 0 to `w` at `milestone`, held after."""
    if milestone is None:
        xs, ys = np.zeros(1), w[None, :]
    else:
        xs = np.array([0.0, float(milestone)])
        ys = np.stack([np.full(len(w), 1.0 / len(w)), w])
    held = int(min(max(np.ceil(xs[-1]), 0), steps))
    sums = np.array([_mixture._interpolated(xs, ys, a, a + 1).sum() for a in range(held)])
    return StepWeights(xs, ys, ys[-1] / ys[-1].sum(), sums, held, 0, steps)


@pytest.mark.parametrize(
    ("seed", "n_src", "steps", "slots", "milestone", "chunk"),
    [(0, 40, 300, 2, None, 7), (1, 7, 400, 1, 150, 11), (4, 60, 250, 4, None, 1 << 14), (5, 1, 300, 1, 40, 5)],
)
def test_held_pass_matches_the_chunked_pass(
    seed: int, n_src: int, steps: int, slots: int, milestone: int | None, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    lanes = Lanes(seq_len=512)
    _, streams, step_slots = _case(seed, n_src, steps, slots, lanes)
    rng = np.random.default_rng(seed)
    w = rng.random(n_src) + 0.1
    w /= w.sum()
    targets = CumulativeTargets(_weights(w, steps, milestone), step_slots * int(lanes.seq_len * 0.96))
    monkeypatch.setattr(_mixture, "REPAIR_CHUNK_CELLS", chunk * n_src)  # chunk boundaries get crossed
    got = membership(targets, streams, lanes, step_slots, targets.budget)
    monkeypatch.setattr(_mixture, "_held_from", lambda tg, st: np.iinfo(np.int64).max)
    want = membership(targets, streams, lanes, step_slots, targets.budget)
    np.testing.assert_array_equal(got.dense(), want.dense())
    grid = np.stack([targets.rows(0, steps, None)[:, k] for k in range(n_src)], 1)
    np.testing.assert_array_equal(got.dense(), _reference(grid, streams, lanes, step_slots, targets.budget))
    np.testing.assert_array_equal(got.totals(), want.totals())
