"""The storage latency a process sees: the duration of its range GETs alone, per store, for sizing read-ahead.

A read-ahead sized from whole unit reads (GET + decode + waiting for a CPU) grows with the machine's load,
not with the store, and knows nothing until its first unit has landed; the GETs of a loader's shard opens
(footers, edge reads) come first. The GET alone is what reading ahead must hide (session 7: sized from it,
the reach widens at once and the long wait at step ~145 of a 100 ms run is gone). Where the server shares
the machine's CPUs (moto in a benchmark) its GETs are CPU-bound too: this measures the store as seen.

Each successful range GET (one attempt, not its retries' back-off) is recorded under its store (the URL's
scheme and bucket or host); `latency` is the median of a store's last `WINDOW` GETs (a descheduled thread's
one slow GET does not widen the reach), the largest over the stores asked.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

import numpy as np

__all__ = ["WINDOW", "RequestLatency", "request_latency", "reset_request_latency", "store_of"]

WINDOW = 32
"""Recent range GETs per store whose median is the store's latency."""


def store_of(url: str) -> str:
    """The store a URL's requests go to: its scheme and bucket (or host), `s3://bucket` (a store is its own store)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme.lower()}://{rest.split('/', 1)[0]}" if sep else url


class RequestLatency:
    """Recent range-GET durations per store (thread-safe)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._lock = threading.Lock()
        self._window = window
        self._recent: dict[str, deque[float]] = {}

    def record(self, url: str, seconds: float) -> None:
        """Note one range GET of `url` that took `seconds` (the request alone)."""
        store = store_of(url)
        with self._lock:
            q = self._recent.get(store)
            if q is None:
                q = self._recent[store] = deque(maxlen=self._window)
            q.append(float(seconds))

    def latency(self, urls: Iterable[str]) -> float:
        """Median recent GET duration of the stores of `urls`, the largest of them (0.0: none measured yet)."""
        stores = {store_of(u) for u in urls}
        with self._lock:
            seen = [np.fromiter(self._recent[s], dtype=np.float64) for s in stores if self._recent.get(s)]
        return max((float(np.median(a)) for a in seen), default=0.0)

    def reset(self) -> None:
        with self._lock:
            self._recent.clear()


_LATENCY = RequestLatency()


def request_latency(urls: Iterable[str]) -> float:
    """This process's storage latency for `urls` (seconds; 0.0 before any of their stores answered a GET)."""
    return _LATENCY.latency(urls)


def reset_request_latency() -> None:
    """Forget every GET duration recorded (tests)."""
    _LATENCY.reset()
