"""Imported once by the embedded cluster's fork server (`_cluster.forked_workers`): everything a serving worker
imports, then `gc.freeze()`, so each worker forked from it shares these modules' pages instead of importing its
own copy.

A spawned worker imported about 29 MiB of Python objects (code, module dicts, classes; tracemalloc,
benchmarks/memory.py at 300 sources) and the C libraries' start-up allocations, each worker its own copy.
Forked from one process that imported them, the workers share every page neither writes. Freezing moves
the imported objects out of the collector's generations: a collection in a worker would otherwise write to
every tracked object's header and so copy nearly every page of them into that worker.
"""

from __future__ import annotations

import gc

import distributed.nanny  # noqa: F401  (the worker process's entry point and the worker itself)
import distributed.worker  # noqa: F401
import numpy  # noqa: F401
import pyarrow  # noqa: F401
import pyarrow.compute  # noqa: F401
import pyarrow.parquet  # noqa: F401

import loomdata.execution._actors  # noqa: F401  (loaders, constructors and what they import)
import loomdata.sources  # noqa: F401

gc.collect()
gc.freeze()
