"""Arrow's allocator for each kind of serving process, chosen before pyarrow loads (a user's own setting wins).

Arrow fixes its default memory pool when pyarrow is imported (`ARROW_DEFAULT_MEMORY_POOL`); part of its
allocations keep that pool even after `pyarrow.set_memory_pool`, so the choice is made by environment, before
the import, or not at all. Which pool fits depends on what the process does:

- Worker processes (`WORKER_ARROW_POOL`, jemalloc, through the nanny's environment: `_cluster.worker_env`):
  they decode row groups all day; mimalloc, Arrow's default, kept their freed pages (1,871 against 942 MiB for
  two workers at 300 sources, benchmarks/memory.py).
- The serving process of the embedded cluster's default layout (`SERVING_ARROW_POOL`, glibc's): it runs the
  scheduler and the Executor, whose Arrow work is reading index columns at start and a few manifest steps per
  autoscaling round through `pyarrow.dataset`. With mimalloc those scans kept 25-37 MiB of freed pages resident
  (huge pages; 45 manifest scans of 32 steps at 300 sources: +45 MiB with mimalloc, +20 with
  `set_memory_pool(system)` after the import, +9 with jemalloc and +4-9 with the system allocator chosen before it).
- The serving process of the in-process layout (`loom serve --workers 0`): the worker runs in it, so jemalloc.

`choose_before_import` sets the variable only where pyarrow is not loaded yet and the user set none, and marks
it as loomdata's choice (`LOOM_CHOSEN_ARROW_POOL`), so that `user_pool` tells a user's setting (which the workers
inherit too) from one loomdata made for the serving process alone.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "CHOSEN_MARK",
    "SERVING_ARROW_POOL",
    "WORKER_ARROW_POOL",
    "choose_before_import",
    "serving_pool",
    "user_pool",
]

ENV = "ARROW_DEFAULT_MEMORY_POOL"

WORKER_ARROW_POOL = "jemalloc"
"""Arrow's allocator in the embedded cluster's workers and in the in-process layout's serving process."""

SERVING_ARROW_POOL = "system"
"""Arrow's allocator in a serving process whose workers are other processes (scheduler + Executor only)."""

CHOSEN_MARK = "LOOM_CHOSEN_ARROW_POOL"
"""Set beside ARROW_DEFAULT_MEMORY_POOL when loomdata chose it (inherited by child processes with it)."""


def serving_pool(n_workers: int, scheduler: str | None) -> str:
    """The pool for a process serving with `n_workers` embedded workers (0: in this process) or on `scheduler`."""
    return WORKER_ARROW_POOL if n_workers == 0 and scheduler is None else SERVING_ARROW_POOL


def choose_before_import(pool: str) -> bool:
    """Make `pool` Arrow's default in this process (and in processes it starts) if pyarrow is not loaded yet and
    the user set no pool; True if it did. Nothing changes otherwise (a later choice would not take)."""
    if "pyarrow" in sys.modules or ENV in os.environ:
        return False
    os.environ[ENV] = pool
    os.environ[CHOSEN_MARK] = pool
    return True


def user_pool() -> str | None:
    """ARROW_DEFAULT_MEMORY_POOL as the user set it; None where unset or set by `choose_before_import`."""
    chosen = os.environ.get(ENV)
    if chosen is not None and chosen == os.environ.get(CHOSEN_MARK):
        return None
    return chosen
