"""The files readers hold open in this process, at most `OPEN_FILES` of them, least recently used let go first.

Why: an open `pyarrow.parquet.ParquetFile` holds its parsed footer, about 25 KiB for a 2.6 KB footer on
disk (4 shards x 300 sources on one worker: 1,200 open files, 34 MiB). Readers keep each file's footer
serialized instead (`parquet._Layout`) and re-open a file let go here from it (no read of the footer: a
row-group read then costs about 0.36 ms against 0.24-0.39 on a held file; the parse itself 0.03 ms). A file
let go is not closed here: a read on another thread may hold it; it closes when the last reference goes
(its reader's `close` closes those still held).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["OPEN_FILES", "OpenFiles", "new_owner"]

OPEN_FILES = 128
"""Files held open per process by all readers together (each ~30 KiB of parsed footer and reader state). A file let
go is opened again from its held footer, which costs CPU: 32 saved about 11 MiB at 300 sources x 16 ranks but
took 1.12x the loaders' CPU where a process reads 51 files under a global shuffle (session 15)."""

T = TypeVar("T")
_OWNERS = itertools.count(1)


def new_owner() -> int:
    """A key for one reader's files (unique in this process)."""
    return next(_OWNERS)


class OpenFiles(Generic[T]):
    """An LRU of open files by (owner, path) (thread-safe); `put` lets the oldest go past `limit`."""

    def __init__(self, limit: int = OPEN_FILES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held: OrderedDict[tuple[int, str], T] = OrderedDict()

    def get(self, owner: int, path: str) -> T | None:
        with self._lock:
            got = self._held.get((owner, path))
            if got is not None:
                self._held.move_to_end((owner, path))
            return got

    def put(self, owner: int, path: str, value: T) -> T:
        """Hold `value` (another thread's for this key, if it put one first: that one is returned)."""
        with self._lock:
            value = self._held.setdefault((owner, path), value)
            self._held.move_to_end((owner, path))
            while len(self._held) > self.limit:
                self._held.popitem(last=False)
            return value

    def count(self, owner: int) -> int:
        with self._lock:
            return sum(1 for o, _ in self._held if o == owner)

    def drop(self, owner: int) -> list[T]:
        """Let go of every file of `owner`; returns them (for its reader to close)."""
        with self._lock:
            keys = [k for k in self._held if k[0] == owner]
            return [self._held.pop(k) for k in keys]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
