"""A tiny in-process sampling profiler (py-spy is not installed): where a process's threads spend time.

Every `interval_s` a daemon thread reads `sys._current_frames()` and counts, per stack, the frames
of threads that are not idle (waiting in a selector, a lock, a queue or a sleep). `report()` gives
the top functions by self and inclusive samples. Used by `stream_throughput.py --profile` inside the
Dask workers, the scheduler process and each consumer; a benchmark tool, never imported by loomdata.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Any

_IDLE = ("_recv", "_recv_bytes", "select", "poll", "epoll", "wait", "_worker", "sleep", "get", "acquire", "_run_once")
_IDLE_FILES = ("selectors.py", "threading.py", "queue.py", "thread.py", "connection.py", "base_events.py")


class Sampler:
    """Samples the stacks of every thread but its own; `report()` summarises them."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.self_counts: collections.Counter[str] = collections.Counter()
        self.incl_counts: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self.busy = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            time.sleep(self.interval_s)
            self.samples += 1
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                code = frame.f_code
                if code.co_name in _IDLE and code.co_filename.endswith(_IDLE_FILES):
                    continue
                self.busy += 1
                leaf = f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}"
                self.self_counts[leaf] += 1
                seen = set()
                f: Any = frame
                while f is not None:
                    key = f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_code.co_name}"
                    if key not in seen:
                        seen.add(key)
                        self.incl_counts[key] += 1
                    f = f.f_back

    def report(self, top: int = 25) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "busy_thread_samples": self.busy,
            "self": self.self_counts.most_common(top),
            "inclusive": self.incl_counts.most_common(top),
        }


_ACTIVE: dict[str, Sampler] = {}


def start(name: str = "default", interval_s: float = 0.002) -> None:
    """Start a named sampler in this process (a `client.run` target)."""
    _ACTIVE[name] = Sampler(interval_s).start()


def stop(name: str = "default", top: int = 25) -> dict[str, Any]:
    """Stop the named sampler and return its report (a `client.run` target)."""
    s = _ACTIVE.pop(name)
    s.stop()
    return s.report(top)
