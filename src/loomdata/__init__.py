"""loomdata: multi-source training data, planned globally with balanced attention cost, streamed on Dask.

The public API, one import away (every name loads lazily, so `import loomdata` and a training rank stay cheap):

- spec and contracts: `load_spec`, `Spec`, `Batch` (and `reassemble_cp` for CP shards), `PlanMeta`,
  `read_plan`, and the errors
  (`LoomError` and its subclasses);
- index: `build_index`, `IndexSummary`; plan: `make_plan`, `PlanResult`, `plan_report`, `plot_plan`;
- stream: `open_cluster`, `Executor`, `serve`, `StreamClient` (and `loomdata.torch.LoomDataset`);
- data for demos and tests: `generate_corpus`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loomdata.client import StreamClient
    from loomdata.execution import Executor, open_cluster, serve
    from loomdata.indexing import IndexSummary, build_index
    from loomdata.planning import PlanResult, make_plan, plan_report, plot_plan
    from loomdata.schemas import (
        Batch,
        ContractError,
        ExecutionError,
        IndexBuildError,
        LoomError,
        PlanError,
        PlanMeta,
        SourceDataError,
        Spec,
        SpecError,
        StaleIndexError,
        load_spec,
        read_plan,
        reassemble_cp,
    )
    from loomdata.testing import generate_corpus

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "ContractError",
    "ExecutionError",
    "Executor",
    "IndexBuildError",
    "IndexSummary",
    "LoomError",
    "PlanError",
    "PlanMeta",
    "PlanResult",
    "SourceDataError",
    "Spec",
    "SpecError",
    "StaleIndexError",
    "StreamClient",
    "build_index",
    "generate_corpus",
    "load_spec",
    "make_plan",
    "open_cluster",
    "plan_report",
    "plot_plan",
    "read_plan",
    "reassemble_cp",
    "serve",
]

_LAZY = {
    "Batch": "loomdata.schemas",
    "ContractError": "loomdata.schemas",
    "ExecutionError": "loomdata.schemas",
    "IndexBuildError": "loomdata.schemas",
    "LoomError": "loomdata.schemas",
    "PlanError": "loomdata.schemas",
    "PlanMeta": "loomdata.schemas",
    "SourceDataError": "loomdata.schemas",
    "Spec": "loomdata.schemas",
    "SpecError": "loomdata.schemas",
    "StaleIndexError": "loomdata.schemas",
    "load_spec": "loomdata.schemas",
    "read_plan": "loomdata.schemas",
    "reassemble_cp": "loomdata.schemas",
    "StreamClient": "loomdata.client",
    "Executor": "loomdata.execution",
    "open_cluster": "loomdata.execution",
    "serve": "loomdata.execution",
    "IndexSummary": "loomdata.indexing",
    "build_index": "loomdata.indexing",
    "PlanResult": "loomdata.planning",
    "make_plan": "loomdata.planning",
    "plan_report": "loomdata.planning",
    "plot_plan": "loomdata.planning",
    "generate_corpus": "loomdata.testing",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loomdata' has no attribute {name!r}")
