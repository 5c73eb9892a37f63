"""How a planning cluster's windows are sent: one scatter per window, each range submitted at once (session 5's
first round), vs a worker's windows in one scatter before its ranges (`_distributed._deal`), same code otherwise.

Plans an index plan_scale wrote (its `--child index`) on an embedded 2-worker cluster, dp 64, and prints one
line: wall, scatter seconds and count, driver CPU, each worker's range CPU, the critical path. Run it
alternating the two modes in one sitting:

    .venv/bin/python benchmarks/plan_scale_send_ab.py WORKDIR each
    .venv/bin/python benchmarks/plan_scale_send_ab.py WORKDIR batch
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import plan_scale
from loomdata.planning import _distributed


def _each(real: Any) -> Any:
    """_deal with one range a batch, in order, to the workers in turn (a scatter per window)."""

    def deal(client: Any, n: int) -> list[tuple[list[int], list[str] | None]]:
        batches = real(client, n)
        if batches[0][1] is None:
            return batches
        addrs = [w[0] for _, w in batches if w]
        return [([i], [addrs[i % len(addrs)]]) for i in range(n)]

    return deal


def main(argv: list[str]) -> int:
    workdir, mode = Path(argv[0]), argv[1]
    if mode not in ("each", "batch"):
        raise SystemExit("mode must be 'each' or 'batch'")
    if mode == "each":
        _distributed._deal = _each(_distributed._deal)  # type: ignore[attr-defined]
    load = os.getloadavg()[0]
    r = plan_scale.child_loom(workdir, 64, 2)
    r.update(mode=mode, load_before=load)
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
