"""The streaming executor on Dask: Source Loader and Data Constructor actors, serving a plan's batches.

`open_cluster` yields a Client (embedded LocalCluster or a running scheduler), `Executor` creates and
publishes the actors of one plan, `serve` runs an executor until Ctrl-C/SIGTERM (`loom serve`).
Clients find a running executor through `protocol` (serve.json and published datasets).
"""

from loomdata.execution._cluster import open_cluster
from loomdata.execution._executor import Executor
from loomdata.execution._packing import pack_arrays, pack_batch
from loomdata.execution._serve import serve

__all__ = ["Executor", "open_cluster", "pack_arrays", "pack_batch", "serve"]
