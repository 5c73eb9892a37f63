"""The streaming executor on Dask: Source Loader and Data Constructor actors, serving a plan's batches.

`open_cluster` yields a Client (embedded LocalCluster or a running scheduler), `Executor` creates and
publishes the actors of one plan and recreates those lost with a worker, `serve` runs an executor
until Ctrl-C/SIGTERM (`loom serve`); `ServeConfig` (with `Autoscaling` and `Timings`) holds every
serving setting, built once at the edge and passed down.
Clients find a running executor through `protocol` (serve.json and published datasets). Names are
imported lazily so that a client importing `loomdata.execution.protocol` loads no executor code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loomdata.execution._cluster import open_cluster
    from loomdata.execution._config import Autoscaling, ServeConfig, Timings
    from loomdata.execution._executor import Executor
    from loomdata.execution._packing import pack_arrays, pack_batch, shard_batch
    from loomdata.execution._serve import serve

__all__ = [
    "Autoscaling",
    "Executor",
    "ServeConfig",
    "Timings",
    "open_cluster",
    "pack_arrays",
    "pack_batch",
    "serve",
    "shard_batch",
]

_WHERE = {
    "Autoscaling": "loomdata.execution._config",
    "ServeConfig": "loomdata.execution._config",
    "Timings": "loomdata.execution._config",
    "Executor": "loomdata.execution._executor",
    "open_cluster": "loomdata.execution._cluster",
    "pack_arrays": "loomdata.execution._packing",
    "pack_batch": "loomdata.execution._packing",
    "serve": "loomdata.execution._serve",
    "shard_batch": "loomdata.execution._packing",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'loomdata.execution' has no attribute {name!r}")
