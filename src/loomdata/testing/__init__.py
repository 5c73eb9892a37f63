"""Tools for tests, benchmarks and demos, not for training jobs: data to index, and a check of resume.

- `generate_corpus` (and `CorpusSize`, `CorpusSummary`, `SourceSummary`): the seeded five-source
  corpus in four formats that `loom generate` writes;
- `write_megatron`, `write_webdataset_shard`: deterministic writers of the formats whose own
  libraries are heavy or absent (the readers in `loomdata.sources` only read);
- `verify_resume`: streams a rank, then restores a client at every position and compares the batches
  (loaded on first use: it needs Dask, the rest does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loomdata.testing._corpus import CorpusSize, CorpusSummary, SourceSummary, generate_corpus
from loomdata.testing._writers import write_megatron, write_webdataset_shard

if TYPE_CHECKING:
    from loomdata.testing._resume import verify_resume

__all__ = [
    "CorpusSize",
    "CorpusSummary",
    "SourceSummary",
    "generate_corpus",
    "verify_resume",
    "write_megatron",
    "write_webdataset_shard",
]


def __getattr__(name: str) -> Any:
    if name == "verify_resume":
        from loomdata.testing._resume import verify_resume

        return verify_resume
    raise AttributeError(f"module 'loomdata.testing' has no attribute {name!r}")
