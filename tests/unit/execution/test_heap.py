"""The worker's C-heap trim: at most once per TRIM_EVERY_S, off the caller's thread, giving freed pages back (glibc)."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata import _glibc
from loomdata.execution import _heap
from loomdata.execution._heap import TRIM_EVERY_S, maybe_trim


def _anonymous_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))


@pytest.mark.skipif(_glibc.glibc() is None, reason="not glibc")
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


@pytest.mark.skipif(_glibc.glibc() is None, reason="not glibc")
def test_a_call_too_soon_schedules_one_trim_at_the_end_of_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is freed after the last trim of a busy spell (steps released once the ranks stop) is given back too."""
    import threading

    pending = _heap._TRAILING[0]  # one another test's call left
    if pending is not None:
        pending.cancel()
    monkeypatch.setattr(_heap, "_LAST", [0.0])
    monkeypatch.setattr(_heap, "_TRAILING", [None])
    monkeypatch.setattr(_heap, "TRIM_EVERY_S", 0.2)
    done = threading.Event()
    monkeypatch.setattr(_heap, "_trim", done.set)
    t0 = _heap.time.monotonic()
    first = maybe_trim(now=t0)
    assert first is not None
    first.result(timeout=60)
    done.clear()
    assert maybe_trim(now=t0 + 0.05) is None and maybe_trim(now=t0 + 0.1) is None  # too soon: one trailing trim
    trailing = _heap._TRAILING[0]
    assert trailing is not None
    assert done.wait(timeout=30), "no trim at the end of the interval"
    trailing.join(timeout=30)
    assert _heap._TRAILING[0] is None
