"""Imported once by the embedded cluster's fork server (`_cluster.forked_workers`): everything a serving worker
imports, then `gc.freeze()`, so each worker forked from it shares these modules' pages instead of importing its
own copy.

A spawned worker imported about 29 MiB of Python objects (code, module dicts, classes; tracemalloc,
benchmarks/memory.py at 300 sources) and the C libraries' start-up allocations, each worker its own copy.
Forked from one process that imported them, the workers share every page neither writes. Freezing moves
the imported objects out of the collector's generations: a collection in a worker would otherwise write to
every tracked object's header and so copy nearly every page of them into that worker. What the imports freed is
given back to the OS (`malloc_trim`) before any worker is forked.
"""

from __future__ import annotations

import gc
import importlib

from loomdata import _glibc

WORKER_MODULES = (
    "distributed.nanny",  # the worker process's entry point
    "distributed.worker",
    "numpy",
    "pyarrow.compute",
    "pyarrow.parquet",
    "loomdata.execution._actors",  # loaders, constructors and all they import (pydantic, the schemas, sources)
    "loomdata.sources",
)
"""What a serving worker imports, imported here once."""

for _name in WORKER_MODULES:
    importlib.import_module(_name)

gc.collect()
gc.freeze()
_glibc.trim()  # what the imports freed goes back to the OS before any worker is forked
