"""The worker's C-heap trim: at most once per TRIM_EVERY_S, off the caller's thread, giving freed pages back (glibc)."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.execution import _heap
from loomdata.execution._heap import TRIM_EVERY_S, maybe_trim


def _anonymous_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))


@pytest.mark.skipif(_heap._TRIM is None, reason="not glibc")
def test_trims_at_most_once_per_interval_and_gives_freed_holes_back() -> None:
    t0 = 1e9  # far from any real trim of this process
    keep, holes = [], []
    for i in range(6000):  # 16 KiB arrays: below glibc's mmap threshold, so they come from the heap
        (keep if i % 4 == 0 else holes).append(np.ones(4096, dtype=np.int32))
    holes.clear()  # ~70 MiB freed between live arrays: resident until trimmed
    before = _anonymous_kib()
    first = maybe_trim(now=t0)
    assert first is not None
    first.result(timeout=60)  # on the trim thread, not the caller's
    after = _anonymous_kib()
    assert before - after > 20 * 1024, (before, after)
    assert maybe_trim(now=t0 + TRIM_EVERY_S / 2) is None  # too soon
    again = maybe_trim(now=t0 + TRIM_EVERY_S)
    assert again is not None
    again.result(timeout=60)
    assert len(keep) == 1500
