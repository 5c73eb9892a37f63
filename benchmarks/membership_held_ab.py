"""Membership alone on the held pass: 300 sources, dp 4 x 4096 tokens x fill 0.96 a step, constant weights.

Prints the CPU seconds of 7 calls after a compile, and the pointers' total (the same on every tree that plans the
same). Run it once per tree, alternating (`PYTHONPATH=/tmp/base24/src` for the base):
`python benchmarks/membership_held_ab.py [steps]` (50,000 steps: about 1.1 CPU-s a call).
"""

from __future__ import annotations

import inspect
import sys
import time

import numpy as np

import loomdata
from loomdata.planning._mixture import CumulativeTargets, StepWeights, build_stream, membership
from loomdata.planning._packing import Lanes


def main() -> None:
    lanes = Lanes(seq_len=4096)
    n_src, steps = 300, int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    rng = np.random.default_rng(0)
    w = rng.random(n_src) + 0.2
    w /= w.sum()
    budget = np.full(steps, int(4 * 4096 * 0.96), dtype=np.int64)
    need = w * budget.sum()
    streams = []
    for k in range(n_src):
        n = int(need[k] / 600) + 2000
        ln = np.clip(rng.lognormal(5.8, 1.0, n), 1, 20000).astype(np.uint32)
        streams.append(build_stream(f"s{k}", 1, ln, lanes, int(need[k] // ln.sum()) + 2))
    sw = StepWeights(np.zeros(1), w[None, :], w / w.sum(), np.zeros(0), 0, 0, steps)
    tg = CumulativeTargets(sw, budget)
    # as plans at dp 4 call it: no give-back (planner version 10; older trees have no `budget`)
    kw = {"budget": 0} if "budget" in inspect.signature(membership).parameters else {}
    p = membership(tg, streams, lanes, 4, **kw)  # compile
    cpu = []
    for _ in range(7):
        t = time.process_time()
        p = membership(tg, streams, lanes, 4, **kw)
        cpu.append(time.process_time() - t)
    print(loomdata.__file__, "membership CPU-s", [round(x, 3) for x in cpu], "totals", int(p.totals()[-1]))


if __name__ == "__main__":
    main()
