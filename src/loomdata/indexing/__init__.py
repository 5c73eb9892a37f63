"""The index stage: a Dask scan of every source's shards into index tables, incremental by fingerprint.

`build_index(spec, client)` writes `workdir/index/<source>/{samples,shards,errors}.parquet` and
returns an `IndexSummary`; a re-run scans only new or changed shards.
"""

from loomdata.indexing._fingerprint import fingerprint_file
from loomdata.indexing._job import build_index
from loomdata.indexing._summary import IndexSummary, SourceSummary

__all__ = ["IndexSummary", "SourceSummary", "build_index", "fingerprint_file"]
