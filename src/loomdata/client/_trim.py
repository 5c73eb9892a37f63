"""A training rank gives its C heap's freed pages back now and then (glibc `malloc_trim`), on the calling thread.

Importing the client and opening its connection leave about 0.9 MiB freed but resident at the top of glibc's
heap (importlib reads each module's bytecode into buffers it frees; an idle torch process has 0.04 MiB to give
back), and frames received and freed while batches are consumed leave more between live objects. glibc
returns pages only at a heap's top unless asked. At 16 ranks each such MiB is 16 of the job's memory
(`benchmarks/memory.py` counts each rank's private memory above an idle torch process). `malloc_trim(0)` on a
rank's heap takes 0.02-2 ms; `maybe_trim` runs it at most every `TRIM_EVERY_S` (0.01-0.1% of a consumer's
time), synchronously: a rank starts no thread for it. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import time

from loomdata import _glibc
from loomdata._glibc import TRIM_EVERY_S

__all__ = ["TRIM_EVERY_S", "RankTrim"]


class RankTrim:
    """Throttled `malloc_trim(0)` for one client: the first call trims, later ones once `every_s` passed."""

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = every_s
        self.last = -float("inf")
        self.trims = 0

    def maybe_trim(self, now: float | None = None) -> bool:
        """Trim if `every_s` passed since this client's last trim; whether it did."""
        t = time.monotonic() if now is None else now
        if t - self.last < self.every_s:
            return False
        self.last = t
        if not _glibc.trim():
            return False
        self.trims += 1
        return True
