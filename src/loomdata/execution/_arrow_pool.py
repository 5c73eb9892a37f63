"""Arrow's allocator for each kind of serving process, chosen before pyarrow loads (a user's own setting wins).

Arrow fixes its default memory pool when pyarrow is imported (`ARROW_DEFAULT_MEMORY_POOL`); part of its
allocations keep that pool even after `pyarrow.set_memory_pool`, so the choice is made by environment, before
the import, or not at all. Which pool fits depends on what the process does:

- Worker processes (`WORKER_ARROW_POOL`, jemalloc, through the nanny's environment: `_cluster.worker_env`):
  they decode row groups all day; mimalloc, Arrow's default, kept their freed pages (1,871 against 942 MiB for
  two workers at 300 sources, benchmarks/memory.py).
- The serving process of the embedded cluster's default layout (`SERVING_ARROW_POOL`, glibc's): it runs the
  scheduler and the Executor, whose Arrow work is reading index columns at start and a few manifest steps per
  autoscaling round (through `pyarrow.dataset` until session 13). With mimalloc those scans kept 25-37 MiB of
  freed pages resident (huge pages; 45 manifest scans of 32 steps at 300 sources: +45 MiB with mimalloc, +20 with
  `set_memory_pool(system)` after the import, +9 with jemalloc and +4-9 with the system allocator chosen before it).
- The serving process of the in-process layout (`loom serve --workers 0`): the worker runs in it, so jemalloc.

Where the pool is jemalloc and the user set no `JE_ARROW_MALLOC_CONF`, loomdata also sets that (read by Arrow's
jemalloc when it starts, so also before pyarrow allocates): `WORKER_JEMALLOC_CONF`: no per-thread caches, one arena
per CPU. A worker runs ~50 threads (strands, read-ahead, planning, Dask's) that allocate through Arrow; jemalloc
gave each a cache of freed small blocks and spread their allocations over 4 arenas per CPU, each with its own
partly used pages (see docs/streaming.md, "session 13", for what it saved).

`choose_before_import` sets the variable only where pyarrow is not loaded yet and the user set none, and marks
it as loomdata's choice (`LOOM_CHOSEN_ARROW_POOL`), so that `user_pool` tells a user's setting (which the workers
inherit too) from one loomdata made for the serving process alone.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "CHOSEN_MARK",
    "JEMALLOC_CONF_ENV",
    "SERVING_ARROW_POOL",
    "WORKER_ARROW_POOL",
    "WORKER_JEMALLOC_CONF",
    "choose_before_import",
    "jemalloc_conf_env",
    "serving_pool",
    "user_pool",
]

ENV = "ARROW_DEFAULT_MEMORY_POOL"

WORKER_ARROW_POOL = "jemalloc"
"""Arrow's allocator in the embedded cluster's workers and in the in-process layout's serving process."""

SERVING_ARROW_POOL = "system"
"""Arrow's allocator in a serving process whose workers are other processes (scheduler + Executor only)."""

JEMALLOC_CONF_ENV = "JE_ARROW_MALLOC_CONF"
"""Arrow's jemalloc reads its options from this variable (jemalloc's MALLOC_CONF under Arrow's prefix)."""


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


WORKER_JEMALLOC_CONF = f"tcache:false,narenas:{_cpus()}"
"""jemalloc's options where loomdata uses jemalloc and the user set none (see the module docstring): no thread
caches, one arena per CPU (jemalloc's default is four)."""

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
    if pool == "jemalloc":
        os.environ.update(jemalloc_conf_env())
    return True


def jemalloc_conf_env() -> dict[str, str]:
    """`JE_ARROW_MALLOC_CONF` for a process whose Arrow pool is jemalloc: `WORKER_JEMALLOC_CONF`, or nothing where
    the user set the variable (theirs is inherited and wins)."""
    return {} if JEMALLOC_CONF_ENV in os.environ else {JEMALLOC_CONF_ENV: WORKER_JEMALLOC_CONF}


def user_pool() -> str | None:
    """ARROW_DEFAULT_MEMORY_POOL as the user set it; None where unset or set by `choose_before_import`."""
    chosen = os.environ.get(ENV)
    if chosen is not None and chosen == os.environ.get(CHOSEN_MARK):
        return None
    return chosen
